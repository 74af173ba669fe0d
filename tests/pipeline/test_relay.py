"""A request's relay with data only: its attempts, output and budget together, batch by
batch, across failures and the reasoning budget."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.engines.neutral import (
    Constraint,
    ConstraintKind,
    EngineEvent,
    Finished,
    FinishReason,
    TokenDelta,
    TokenLogprob,
)
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import FaultsConfig, FrontendConfig
from direct_frontend.openai.parsers.registry import ChoiceParser
from direct_frontend.openai.types import CompletionRequest
from direct_frontend.pipeline.attempt import Attempt, Phase
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.failover import Decision
from direct_frontend.pipeline.output_track import OutputTrack
from direct_frontend.pipeline.postprocess import OutputProcessor
from direct_frontend.pipeline.preempt import new_hold
from direct_frontend.pipeline.preprocess import PreparedRequest, build_call
from direct_frontend.pipeline.relay_events import Batch, Usage
from direct_frontend.pipeline.relay_state import RelayState
from direct_frontend.pipeline.settings import Settings
from direct_frontend.pipeline.thinking import ThinkingBudget
from direct_frontend.routing.catalog import Catalog
from direct_frontend.routing.policies import RoundRobin
from direct_frontend.text.model_dir import TextModel
from tests.support.fleet import StaticFleet, engine

PROMPT = (11, 12, 13, 14)
DEFAULT_FAULTS = FaultsConfig()
STALL_S = DEFAULT_FAULTS.stall_timeout_s
WAIT_S = DEFAULT_FAULTS.wait_for_engine_s
TIMEOUT_S = 90.0


class Queued:
    """Events an engine call has already delivered; an error where the stream broke."""

    def __init__(self, *items: EngineEvent | EngineError) -> None:
        self.items = collections.deque(items)

    def receive_nowait(self) -> EngineEvent | None:
        if not self.items:
            return None
        item = self.items.popleft()
        if isinstance(item, EngineError):
            raise item
        return item


def relay_state(
    text_model: TextModel,
    catalog: Catalog,
    *,
    max_tokens: int = 16,
    faults: FaultsConfig = DEFAULT_FAULTS,
    logprobs: int | None = None,
    constraint: Constraint | None = None,
    temperature: float = 1.0,
    budget: int | None = None,
    sampling: dict[str, Any] | None = None,
) -> tuple[RelayState, Dispatcher]:
    """A request placed on the catalog's first engine, as the relay starts it; with a
    ``budget``, its reply is read by the qwen3 reasoning parser."""
    frontend = FrontendConfig(served_model_name="demo", tokenizer=Path("demo-model"),
                              request_timeout_s=TIMEOUT_S, faults=faults)
    settings = Settings.first(frontend, RoundRobin(start=0))
    request = CompletionRequest(model="demo", prompt=PROMPT, max_tokens=max_tokens,
                                logprobs=logprobs)
    prepared = PreparedRequest("completion", "req", request, PROMPT, "")
    dispatcher = Dispatcher(StaticFleet(catalog))
    placement = dispatcher.choose(settings.policy, PROMPT, max_tokens)
    processor = OutputProcessor(
        text_model.new_detokenizer(), (), max_tokens, track_tokens=logprobs is not None
    )
    call = build_call(prepared, max_tokens, stream=True)
    if constraint is not None:
        call = dataclasses.replace(call, sampling=dataclasses.replace(
            call.sampling, constraint=constraint, temperature=temperature))
    if sampling is not None:
        call = dataclasses.replace(call, sampling=dataclasses.replace(call.sampling, **sampling))
    parser = None if budget is None else ChoiceParser(reasoning_parser="qwen3")
    output = OutputTrack(request, PROMPT, processor, parser, logprobs=logprobs is not None)
    attempt = Attempt(settings, prepared, placement, call, now=100.0)
    thinking = None if budget is None else ThinkingBudget(budget)
    return RelayState(attempt, output, thinking), dispatcher


def two_engines() -> Catalog:
    return Catalog(1, (engine("a"), engine("b")))


def word_ids(text_model: TextModel, text: str) -> tuple[int, ...]:
    return tuple(text_model.encode(text, add_special_tokens=False))


def gone(name: str | None = "a") -> EngineError:
    return EngineError(ErrorKind.UNAVAILABLE, "gone", engine=name)


# -- one batch -----------------------------------------------------------------------------


def test_a_batch_takes_every_queued_event_up_to_the_end(text_model: TextModel) -> None:
    state, _ = relay_state(text_model, two_engines())
    ids = word_ids(text_model, "hello there world")
    assert len(ids) >= 3
    assert state.attempt.wait(0.0) == STALL_S and state.attempt.phase is Phase.WAITING
    first = TokenDelta(ids[:1], cached_tokens=2)
    rest = Queued(TokenDelta(ids[1:]), Finished(FinishReason.STOP, 4, len(ids), 2))
    batch = state.take(first, rest)
    assert (batch.text, batch.tokens) == ("hello there world", len(ids))
    assert state.attempt.phase is Phase.FINISHED and state.output.final is not None
    end = state.output.finished(batch)
    assert end.finish_reason == "stop" and end.usage == Usage(len(PROMPT), len(ids), 2)


def test_an_error_behind_tokens_is_raised_at_the_next_wait(text_model: TextModel) -> None:
    state, _ = relay_state(text_model, two_engines())
    ids = word_ids(text_model, "hello there")
    broken = gone()
    state.attempt.wait(0.0)
    batch = state.take(TokenDelta(ids), Queued(broken))
    assert (batch.text, batch.tokens) == ("hello there", len(ids))
    assert state.attempt.phase is Phase.RELAYING and state.output.final is None
    with pytest.raises(EngineError) as raised:
        state.attempt.wait(1.0)
    assert raised.value is broken


def test_a_request_that_gives_up_tells_the_client_and_its_usage(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, Catalog(1, (engine("a"),)),
                                    faults=FaultsConfig(wait_for_engine_s=0))
    ids = word_ids(text_model, "hello there")
    state.take(TokenDelta(ids, cached_tokens=1), Queued())
    with pytest.raises(EngineError) as raised:
        state.next_attempt(gone(), dispatcher, 100.0)
    failed = state.failed(raised.value)
    assert failed.error.status == 502 and failed.usage == Usage(len(PROMPT), len(ids), 1)


# -- across engines ------------------------------------------------------------------------


def logprobs_of(ids: tuple[int, ...], first: int) -> tuple[TokenLogprob, ...]:
    """Distinct logprobs per position (``first`` is the position of ``ids[0]``)."""
    return tuple(TokenLogprob(t, -(first + i + 1) / 8) for i, t in enumerate(ids))


def test_a_migrated_stream_goes_on_with_its_logprobs_once_and_its_own_cache_hits(
    text_model: TextModel,
) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), logprobs=1, max_tokens=8)
    ids = word_ids(text_model, "hello there world at sea")
    head, tail = ids[:2], ids[2:]
    first = state.take(TokenDelta(head, cached_tokens=3, logprobs=logprobs_of(head, 0)),
                       Queued())
    assert [lp.token_id for lp in first.logprobs] == list(head)
    assert state.next_attempt(gone(), dispatcher, 100.0) is Decision.MIGRATE
    assert state.attempt.call.input_ids == PROMPT + head
    assert state.attempt.call.sampling.logprobs == 1  # asked again of the next engine
    # the new engine's logprobs start at its first new token: none repeated, none lost
    rest = state.take(TokenDelta(tail, cached_tokens=9, logprobs=logprobs_of(tail, len(head))),
                      Queued(Finished(FinishReason.LENGTH, 4, len(ids))))
    assert [lp.logprob for lp in rest.logprobs] == [-(i + 1) / 8
                                                    for i in range(len(head), len(ids))]
    assert rest.offsets[0] == len(first.text)
    assert rest.cached_tokens == 3  # the client's prompt's, not the continuation's


REGEX = Constraint(ConstraintKind.REGEX, "[a-z ]+", param="guided_regex")


def test_a_deterministic_constrained_stream_is_replayed_and_its_repeat_dropped(
    text_model: TextModel,
) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), constraint=REGEX, temperature=0,
                                    logprobs=1, max_tokens=12)
    ids = word_ids(text_model, "hello there world at sea")
    head, tail = ids[:3], ids[3:]
    first = state.take(TokenDelta(head, cached_tokens=3, logprobs=logprobs_of(head, 0)),
                       Queued())
    assert state.next_attempt(gone(), dispatcher, 100.0) is Decision.MIGRATE
    assert state.attempt.call.input_ids == PROMPT  # the client's own call again
    # the replay repeats the head (in pieces, across batches) before anything new
    all_logprobs = logprobs_of(ids, 0)
    second = state.take(TokenDelta(head[:2], cached_tokens=9, logprobs=all_logprobs[:2]),
                        Queued(TokenDelta(ids[2:4], logprobs=all_logprobs[2:4])))
    rest = state.take(TokenDelta(ids[4:], logprobs=all_logprobs[4:]), Queued(
        Finished(FinishReason.STOP, 4, len(ids))))
    assert state.output.final is not None
    assert first.text + second.text + rest.text == "hello there world at sea"
    assert state.output.processor.generated_ids == ids  # each token once
    assert [lp.token_id for lp in [*second.logprobs, *rest.logprobs]] == list(tail)
    assert rest.cached_tokens == 3 and not state.attempt.failover.refused_migration


def test_a_replay_that_differs_streams_nothing_twice_and_ends_with_an_error(
    text_model: TextModel,
) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), constraint=REGEX, temperature=0)
    ids = word_ids(text_model, "hello there world")
    state.take(TokenDelta(ids), Queued())
    assert state.next_attempt(gone(), dispatcher, 100.0) is Decision.MIGRATE
    other = (*ids[:2], ids[2] + 1, *ids[3:])  # the same but for its third token
    batch = state.take(TokenDelta(other), Queued(TokenDelta(ids)))
    assert (batch.text, batch.tokens) == ("", 0)  # nothing streamed twice, nothing after
    with pytest.raises(EngineError) as raised:
        state.attempt.wait(101.0)
    assert f"other tokens after 2 of the {len(ids)} already streamed" in str(raised.value)
    with pytest.raises(EngineError, match="replaying its structured-output constraint"):
        state.next_attempt(raised.value, dispatcher, 101.0)  # no further attempt
    assert state.failed(raised.value).error.status == 500


# -- the reasoning budget ---------------------------------------------------------------------


def test_a_budget_cuts_its_batch_exactly_and_closes_an_open_block(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), max_tokens=40, budget=9)
    ids = word_ids(text_model, "<think>one two three four five six seven")
    assert len(ids) > 9
    batch = state.take(TokenDelta(ids[:4]), Queued(TokenDelta(ids[4:])))
    assert batch.tokens == 9 and state.output.processor.generated_ids == ids[:9]
    assert batch.parsed is not None and batch.parsed.reasoning  # parsed as it went out
    assert state.budget is not None and state.budget.held is not None
    assert state.thinking_due() == "</think>" and state.budget.held is None  # rest dropped
    closing = word_ids(text_model, "\n</think>\n\n")
    closed = state.close_thinking(closing)
    assert closed.tokens == len(closing) and state.budget.limit is None
    assert isinstance(closed, Batch) and closed.parsed is not None
    assert closed.parsed.reasoning == ""  # the block is closed for the parser
    state.resume(dispatcher)
    assert state.attempt.call.input_ids == PROMPT + ids[:9] + closing
    assert state.attempt.call.sampling.max_tokens == 40 - 9 - len(closing)
    assert state.attempt.call.request_id == "req~1" and state.attempt.continued
    answer = state.take(TokenDelta(word_ids(text_model, " the answer")), Queued())
    assert answer.parsed is not None and answer.parsed.content.strip() == "the answer"


def test_output_held_at_a_budget_with_no_block_open_goes_on_or_is_made_again(
    text_model: TextModel,
) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), max_tokens=40, budget=2)
    ids = word_ids(text_model, "plain answer here, no thinking")
    state.take(TokenDelta(ids), Queued())
    assert state.thinking_due() is None  # nothing to close
    assert state.budget is not None and state.budget.limit is None
    assert state.budget.held is not None and state.budget.held.token_ids == ids[2:]  # next ...
    assert state.next_attempt(gone(None), dispatcher, 100.0) is Decision.MIGRATE
    assert state.budget.held is None  # ... unless its engine fails: the next one makes it again
    assert state.attempt.call.input_ids == PROMPT + ids[:2]


# -- preemption ------------------------------------------------------------------------------


def test_a_preempted_stream_leaves_at_a_safe_point_and_goes_on_from_its_tokens(
    text_model: TextModel,
) -> None:
    """Asked off its engine while it relays (no wait to cut), it leaves at the next safe
    point; it then continues from its tokens (the prompt and them), each token once; a
    finished one no longer gives way."""
    state, dispatcher = relay_state(text_model, two_engines(), max_tokens=12)
    hold = new_hold("flood", 1, "default", 0.0)
    state.preemptible(hold)
    assert state.hold is hold
    ids = word_ids(text_model, "hello there world at sea")
    first = state.take(TokenDelta(ids[:3]), Queued())
    cut: list[bool] = []
    assert state.attempt.give_way(lambda: cut.append(True))
    assert state.attempt.phase is Phase.MOVING and cut == []  # relaying: no wait to cut
    assert state.attempt.interrupted(100.0).kind is ErrorKind.DRAINING
    state.resume(dispatcher)
    assert state.attempt.call.input_ids == PROMPT + ids[:3]
    assert state.attempt.call.sampling.max_tokens == 12 - 3
    rest = state.take(TokenDelta(ids[3:]), Queued(Finished(FinishReason.STOP, 4, 2)))
    assert first.text + rest.text == "hello there world at sea"
    assert state.output.processor.generated_ids == ids
    assert not state.attempt.give_way(lambda: cut.append(True))  # finished
    assert cut == []


def test_a_wait_on_the_engine_is_cut_short_by_a_preemption(text_model: TextModel) -> None:
    state, _ = relay_state(text_model, two_engines())
    state.attempt.wait(100.0)
    cut: list[bool] = []
    assert state.attempt.give_way(lambda: cut.append(True)) and cut == [True]


def test_only_a_stream_a_continuation_loses_nothing_of_may_be_preempted(
    text_model: TextModel,
) -> None:
    """Not a constrained one, one with a reasoning budget, one with a seed (a continuation
    starts its random stream again) or with output-only penalties (a continuation has its
    tokens in the prompt)."""
    for kwargs in ({"constraint": REGEX, "temperature": 0.0}, {"budget": 8},
                   {"sampling": {"seed": 7}}, {"sampling": {"frequency_penalty": 0.5}},
                   {"sampling": {"presence_penalty": -0.5}}):
        state, _ = relay_state(text_model, two_engines(), **kwargs)  # type: ignore[arg-type]
        state.preemptible(new_hold("flood", 1, "default", 0.0))
        assert state.hold is None, kwargs
    state, _ = relay_state(text_model, two_engines(), sampling={"repetition_penalty": 1.2})
    state.preemptible(hold := new_hold("flood", 1, "default", 0.0))
    assert state.hold is hold  # applied to the prompt's tokens too: a continuation keeps it


def test_asked_off_it_requeues_only_when_it_left_for_that(text_model: TextModel) -> None:
    """A preempted request waits for its slots again only when it left its engine for the
    preemption; when the engine failed first (its error kept behind the batch), or the call
    ended otherwise, it fails over from that failure, keeps its slots and is no longer asked
    off (it may be asked again, and is counted as past its share)."""
    state, _ = relay_state(text_model, two_engines())
    hold = new_hold("flood", 1, "default", 0.0)
    state.preemptible(hold)
    hold.asked = True
    assert state.attempt.give_way(lambda: None)
    draining = state.attempt.interrupted(100.0)
    assert draining.kind is ErrorKind.DRAINING
    assert state.asked_off(hold, draining) is None and hold.asked  # left for it: requeue

    broken = gone(None)
    state.attempt.pending_error = broken  # the engine failed in the batch before it left
    assert state.asked_off(hold, draining) is broken and not hold.asked

    hold.asked = True
    state.attempt.pending_error = None
    stalled = gone(None)
    assert state.asked_off(hold, stalled) is stalled and not hold.asked
