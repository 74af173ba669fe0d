"""The relay's decisions, with data only: batches, waits, moves, stalls, the next attempt,
waiting for an engine."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

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
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.parsers.registry import ChoiceParser
from direct_frontend.openai.types import CompletionRequest
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.failover import Decision
from direct_frontend.pipeline.postprocess import OutputProcessor
from direct_frontend.pipeline.preprocess import PreparedRequest, build_call
from direct_frontend.pipeline.relay import EngineWait, Phase, RelayState, first_placement
from direct_frontend.pipeline.settings import Settings
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
    stop: tuple[str, ...] = (),
    faults: FaultsConfig = DEFAULT_FAULTS,
    logprobs: int | None = None,
    constraint: Constraint | None = None,
    temperature: float = 1.0,
) -> tuple[RelayState, Dispatcher]:
    """A request placed on the catalog's first engine, as the relay starts it."""
    frontend = FrontendConfig(served_model_name="demo", tokenizer=Path("demo-model"),
                              request_timeout_s=TIMEOUT_S, faults=faults)
    settings = Settings.first(frontend, RoundRobin(start=0))
    request = CompletionRequest(
        model="demo", prompt=PROMPT, max_tokens=max_tokens, stop=stop, logprobs=logprobs
    )
    prepared = PreparedRequest("completion", "req", request, PROMPT, "")
    dispatcher = Dispatcher(StaticFleet(catalog))
    placement = dispatcher.choose(settings.policy, PROMPT, max_tokens)
    processor = OutputProcessor(
        text_model.new_detokenizer(), stop, max_tokens, track_tokens=logprobs is not None
    )
    call = build_call(prepared, max_tokens, stream=True)
    if constraint is not None:
        call = dataclasses.replace(call, sampling=dataclasses.replace(
            call.sampling, constraint=constraint, temperature=temperature))
    state = RelayState(settings, prepared, placement, call, processor, now=100.0)
    return state, dispatcher


def two_engines() -> Catalog:
    return Catalog(1, (engine("a"), engine("b")))


def word_ids(text_model: TextModel, text: str) -> tuple[int, ...]:
    return tuple(text_model.encode(text, add_special_tokens=False))


# -- one batch -----------------------------------------------------------------------------


def test_a_batch_takes_every_queued_event_up_to_the_end(text_model: TextModel) -> None:
    state, _ = relay_state(text_model, two_engines())
    ids = word_ids(text_model, "hello there world")
    assert len(ids) >= 3
    assert state.wait(0.0) == STALL_S and state.phase is Phase.WAITING
    first = TokenDelta(ids[:1], cached_tokens=2)
    rest = Queued(TokenDelta(ids[1:]), Finished(FinishReason.STOP, 4, len(ids), 2))
    text, tokens, finished = state.take(first, rest)
    assert (text, tokens, finished) == ("hello there world", len(ids), True)
    assert state.phase is Phase.FINISHED and state.cached_tokens == 2
    assert state.final is not None and state.final.finish_reason == "stop"


def test_an_error_behind_tokens_is_raised_at_the_next_wait(text_model: TextModel) -> None:
    state, _ = relay_state(text_model, two_engines())
    ids = word_ids(text_model, "hello there")
    broken = EngineError(ErrorKind.UNAVAILABLE, "connection lost", engine="a")
    text, tokens, finished = state.take(TokenDelta(ids), Queued(broken))
    assert (text, tokens, finished) == ("hello there", len(ids), False)
    assert state.phase is Phase.RELAYING
    with pytest.raises(EngineError) as raised:
        state.wait(1.0)
    assert raised.value is broken and state.pending_error is None


def test_the_stall_watch_never_outlasts_the_request(text_model: TextModel) -> None:
    state, _ = relay_state(text_model, two_engines())
    assert state.wait(110.0) == 110.0 + STALL_S
    assert state.wait(state.deadline - 1.0) == state.deadline


def test_the_engine_ending_by_itself_needs_no_abort(text_model: TextModel) -> None:
    eos = 7
    catalog = Catalog(1, (engine("a", eos_token_ids=(eos,)),))
    ids = word_ids(text_model, "hello there")
    state, _ = relay_state(text_model, catalog, max_tokens=len(ids))
    state.take(TokenDelta(ids), Queued())
    assert state.final is not None and state.final.finish_reason == "length"
    assert state.ends_by_itself(catalog.engines[0])
    on_eos, _ = relay_state(text_model, catalog)
    on_eos.take(Finished(FinishReason.STOP, 4, 1, matched_token_id=eos), Queued())
    assert on_eos.ends_by_itself(catalog.engines[0])
    on_stop_string, _ = relay_state(text_model, catalog, stop=("there",))
    on_stop_string.take(TokenDelta(ids), Queued())
    assert on_stop_string.final is not None and on_stop_string.final.stop_reason == "there"
    assert not on_stop_string.ends_by_itself(catalog.engines[0])  # the engine would go on
    unfinished, _ = relay_state(text_model, catalog)
    assert not unfinished.ends_by_itself(catalog.engines[0])


# -- leaving an engine ---------------------------------------------------------------------


def test_a_move_cuts_a_wait_short_but_never_a_write(text_model: TextModel) -> None:
    waiting, _ = relay_state(text_model, two_engines())
    waiting.wait(0.0)
    assert waiting.move() and waiting.phase is Phase.MOVING
    writing, _ = relay_state(text_model, two_engines())
    assert not writing.move() and writing.phase is Phase.MOVING  # leaves at the next wait
    draining = writing.interrupted(now=1.0)
    assert draining.kind is ErrorKind.DRAINING and draining.engine == "a"
    done, _ = relay_state(text_model, two_engines())
    done.take(Finished(FinishReason.STOP, 4, 0), Queued())
    assert not done.move() and done.phase is Phase.FINISHED  # the output is complete anyway


def test_a_silent_engine_stalls_and_a_late_request_times_out(text_model: TextModel) -> None:
    stalled, _ = relay_state(text_model, two_engines())
    stalled.wait(0.0)
    error = stalled.interrupted(now=STALL_S)
    assert error.kind is ErrorKind.TIMEOUT and stalled.phase is Phase.WAITING
    late, dispatcher = relay_state(text_model, two_engines())
    late.wait(late.deadline - 1.0)
    error = late.interrupted(now=late.deadline)
    assert error.kind is ErrorKind.CANCELLED and late.phase is Phase.TIMED_OUT
    with pytest.raises(EngineError):
        late.next_attempt(error, dispatcher, 100.0)  # no retry once the time is up
    assert late.phase is Phase.TIMED_OUT
    refusal = late.error_for(error)
    assert refusal.status == 504 and f"within {TIMEOUT_S:g} s" in refusal.message


# -- the next attempt ----------------------------------------------------------------------


def test_a_failure_before_output_retries_the_same_call_elsewhere(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines())
    error = EngineError(ErrorKind.UNAVAILABLE, "refused", engine="a")
    assert state.next_attempt(error, dispatcher, 100.0) is Decision.RETRY
    assert state.placement.engine.name == "b" and state.phase is Phase.RELAYING
    assert state.call.input_ids == PROMPT and state.call.request_id == "req~1"
    assert state.call.sampling.max_tokens == 16


def test_a_failure_after_output_migrates_with_the_tokens_produced(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines())
    ids = word_ids(text_model, "hello there")
    state.take(TokenDelta(ids, cached_tokens=3), Queued())
    error = EngineError(ErrorKind.TIMEOUT, "the stream stalled")  # no engine named: this one
    assert state.next_attempt(error, dispatcher, 100.0) is Decision.MIGRATE
    assert error.engine == "a" and state.failover.tried == {"a"}
    assert state.call.input_ids == PROMPT + ids
    assert state.call.sampling.max_tokens == 16 - len(ids)
    # the client's cached tokens are its own prompt's, not the continuation's
    state.take(TokenDelta(word_ids(text_model, " world"), cached_tokens=9), Queued())
    assert state.cached_tokens == 3


def test_the_retry_budget_is_bounded(text_model: TextModel) -> None:
    catalog = Catalog(1, tuple(engine(name) for name in "abcd"))
    state, dispatcher = relay_state(text_model, catalog, faults=FaultsConfig(max_retries=1))
    state.next_attempt(EngineError(ErrorKind.OVERLOADED, "busy", engine="a"), dispatcher, 100.0)
    last = EngineError(ErrorKind.OVERLOADED, "busy", engine="b")
    with pytest.raises(EngineError) as raised:
        state.next_attempt(last, dispatcher, 100.0)
    assert raised.value is last and state.phase is Phase.FAILED
    assert state.error_for(last).status == 429  # every engine tried was saturated


def test_no_engine_left_waits_for_one_and_too_short_a_context_gives_up(
    text_model: TextModel,
) -> None:
    alone, dispatcher = relay_state(text_model, Catalog(1, (engine("a"),)))
    error = EngineError(ErrorKind.UNAVAILABLE, "refused", engine="a")
    assert alone.next_attempt(error, dispatcher, 100.0) is Decision.RETRY
    assert alone.phase is Phase.NO_ENGINE and alone.engine_wait.until == 100.0 + WAIT_S
    impatient, dispatcher = relay_state(
        text_model, Catalog(1, (engine("a"),)), faults=FaultsConfig(wait_for_engine_s=0)
    )
    with pytest.raises(EngineError) as raised:
        impatient.next_attempt(error, dispatcher, 100.0)
    assert raised.value is error and impatient.phase is Phase.FAILED
    short = Catalog(1, (engine("a"), engine("b", context_length=len(PROMPT) + 4)))
    state, dispatcher = relay_state(text_model, short)
    with pytest.raises(EngineError) as cannot:
        state.next_attempt(EngineError(ErrorKind.UNAVAILABLE, "refused"), dispatcher, 100.0)
    assert "cannot resume on b: context too short" in cannot.value.message
    assert state.placement.engine.name == "a" and state.phase is Phase.FAILED


# -- waiting for an engine -----------------------------------------------------------------


def fleet_of(dispatcher: Dispatcher) -> StaticFleet:
    fleet = dispatcher.fleet
    assert isinstance(fleet, StaticFleet)
    return fleet


def test_a_new_request_waits_for_an_engine_bounded_then_gets_a_503() -> None:
    dispatcher = Dispatcher(StaticFleet(Catalog(1, ())))
    frontend = FrontendConfig(served_model_name="demo", tokenizer=Path("demo-model"))
    settings = Settings.first(frontend, RoundRobin())
    request = CompletionRequest(model="demo", prompt=PROMPT, max_tokens=4)
    prepared = PreparedRequest("completion", "req", request, PROMPT, "")
    wait = EngineWait(WAIT_S, deadline=100.0 + TIMEOUT_S)
    assert first_placement(dispatcher, settings, prepared, wait, 100.0) is None
    assert wait.until == 100.0 + WAIT_S and wait.waits == 1
    assert first_placement(dispatcher, settings, prepared, wait, 102.0) is None  # the same wait
    assert wait.until == 100.0 + WAIT_S and wait.waits == 1
    fleet_of(dispatcher).catalog = Catalog(2, (engine("a"),))
    placed = first_placement(dispatcher, settings, prepared, wait, 103.0)
    assert placed is not None and placed.engine.name == "a" and wait.until is None
    fleet_of(dispatcher).catalog = Catalog(3, ())
    assert first_placement(dispatcher, settings, prepared, wait, 150.0) is None
    assert wait.until == 150.0 + WAIT_S and wait.waits == 2  # a new wait, as long
    with pytest.raises(OpenAIHTTPError) as refused:
        first_placement(dispatcher, settings, prepared, wait, 150.0 + WAIT_S)
    assert refused.value.status == 503 and refused.value.code == "no_engine_available"
    never = EngineWait(0.0, deadline=100.0 + TIMEOUT_S)  # wait_for_engine_s = 0: at once
    with pytest.raises(OpenAIHTTPError):
        first_placement(dispatcher, settings, prepared, never, 100.0)
    late = EngineWait(WAIT_S, deadline=101.0)  # never past the request's own deadline
    assert late.may_wait(100.0) and late.until == 101.0
    assert not late.may_wait(101.0)


def test_a_retry_waits_for_an_engine_then_gives_up_with_the_last_failure(
    text_model: TextModel,
) -> None:
    state, dispatcher = relay_state(text_model, Catalog(1, (engine("a"),)))
    error = EngineError(ErrorKind.UNAVAILABLE, "refused", engine="a")
    fleet_of(dispatcher).catalog = Catalog(2, ())  # the fault took it out
    state.next_attempt(error, dispatcher, 100.0)
    assert state.phase is Phase.NO_ENGINE
    assert state.place(dispatcher, 101.0) is None and state.phase is Phase.NO_ENGINE
    with pytest.raises(EngineError) as raised:
        state.place(dispatcher, 100.0 + WAIT_S)
    assert raised.value is error and state.phase is Phase.FAILED
    assert state.error_for(error).status == 502  # as without the wait
    late, dispatcher = relay_state(text_model, Catalog(1, (engine("a"),)))
    fleet_of(dispatcher).catalog = Catalog(2, ())
    late.next_attempt(error, dispatcher, late.deadline - 1.0)
    assert late.engine_wait.until == late.deadline
    with pytest.raises(EngineError):
        late.place(dispatcher, late.deadline)
    assert late.phase is Phase.TIMED_OUT and late.error_for(error).status == 504


def test_a_stream_goes_back_to_a_tried_engine_once_it_came_back(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines())
    ids = word_ids(text_model, "hello there")
    state.take(TokenDelta(ids), Queued())
    a, b = fleet_of(dispatcher).catalog.engines
    assert state.next_attempt(EngineError(ErrorKind.UNAVAILABLE, "lost"), dispatcher, 100.0) \
        is Decision.MIGRATE
    assert state.placement.engine is b and state.excluded == {"a"}  # a is still listed
    fleet_of(dispatcher).catalog = Catalog(2, (a,))  # b fails too; a is in the same stint
    state.next_attempt(EngineError(ErrorKind.UNAVAILABLE, "lost"), dispatcher, 101.0)
    assert state.phase is Phase.NO_ENGINE and state.excluded == {"a"}
    a_again = engine("a")  # a restarted: it serves again in a new stint
    fleet_of(dispatcher).catalog = Catalog(3, (a_again, b))
    placed = state.place(dispatcher, 102.0)
    assert placed is not None and placed.engine is a_again and state.phase is Phase.RELAYING
    assert state.excluded == {"b"} and state.engine_wait.until is None
    assert state.call.input_ids == PROMPT + ids  # the same continuation, on a new chance


def test_saturated_everywhere_is_a_429_at_once_not_a_wait(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines())
    state.next_attempt(EngineError(ErrorKind.OVERLOADED, "busy", engine="a"), dispatcher, 100.0)
    last = EngineError(ErrorKind.OVERLOADED, "busy", engine="b")
    with pytest.raises(EngineError) as raised:
        state.next_attempt(last, dispatcher, 100.0)
    assert raised.value is last and state.phase is Phase.FAILED
    assert state.error_for(last).status == 429


def logprobs_of(ids: tuple[int, ...], first: int) -> tuple[TokenLogprob, ...]:
    """Distinct logprobs per position (``first`` is the position of ``ids[0]``)."""
    return tuple(TokenLogprob(t, -(first + i + 1) / 8) for i, t in enumerate(ids))


def test_logprobs_go_out_with_their_text_once_across_a_migration(
    text_model: TextModel,
) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), logprobs=1, max_tokens=8)
    ids = word_ids(text_model, "hello there world at sea")
    head, tail = ids[:2], ids[2:]
    state.take(TokenDelta(head, logprobs=logprobs_of(head, 0)), Queued())
    assert [lp.token_id for lp in state.logprobs_out()] == list(head)
    error = EngineError(ErrorKind.UNAVAILABLE, "gone", engine="a")
    assert state.next_attempt(error, dispatcher, 100.0) is Decision.MIGRATE
    assert state.call.sampling.logprobs == 1  # asked again of the next engine
    # the new engine's logprobs start at its first new token: none repeated, none lost
    state.take(TokenDelta(tail, logprobs=logprobs_of(tail, len(head))), Queued(
        Finished(FinishReason.LENGTH, 4, len(ids))
    ))
    rest = state.logprobs_out()
    assert [lp.logprob for lp in rest] == [-(i + 1) / 8 for i in range(len(head), len(ids))]
    assert state.logprobs_out() == []


def test_logprobs_past_a_stop_string_are_not_sent(text_model: TextModel) -> None:
    state, _ = relay_state(text_model, two_engines(), logprobs=0, stop=(" world",))
    ids = word_ids(text_model, "hello there world at sea")
    text, _, finished = state.take(TokenDelta(ids, logprobs=logprobs_of(ids, 0)), Queued())
    assert finished and text == "hello there"
    out = state.logprobs_out()
    starts = [len(text_model.decode(ids[:i])) for i in range(len(ids))]
    assert len(out) == sum(1 for start in starts if start < len(text)) < len(ids)
    assert [lp.token_id for lp in out] == list(ids[: len(out)])


# -- constrained streams: a replay, or none ---------------------------------------------------

REGEX = Constraint(ConstraintKind.REGEX, "[a-z ]+", param="guided_regex")


def test_a_sampled_constrained_stream_is_not_migrated(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), constraint=REGEX)
    state.take(TokenDelta(word_ids(text_model, "hello there")), Queued())
    error = EngineError(ErrorKind.UNAVAILABLE, "gone", engine="a")
    with pytest.raises(EngineError, match="could not enforce its structured-output constraint"):
        state.next_attempt(error, dispatcher, 100.0)
    assert state.failover.refused_migration and state.failover.unmigratable == "constraint"


def test_a_deterministic_constrained_stream_is_replayed_and_its_repeat_dropped(
    text_model: TextModel,
) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), constraint=REGEX, temperature=0,
                                    logprobs=1, max_tokens=12)
    ids = word_ids(text_model, "hello there world at sea")
    head, tail = ids[:3], ids[3:]
    text, _, _ = state.take(TokenDelta(head, cached_tokens=3, logprobs=logprobs_of(head, 0)),
                            Queued())
    assert [lp.token_id for lp in state.logprobs_out()] == list(head)
    error = EngineError(ErrorKind.UNAVAILABLE, "gone", engine="a")
    assert state.next_attempt(error, dispatcher, 100.0) is Decision.MIGRATE
    # the client's own call again: its prompt, its whole budget, its constraint
    assert state.call.input_ids == PROMPT and state.call.request_id == "req~1"
    assert state.call.sampling.max_tokens == 12 and state.call.sampling.constraint == REGEX
    assert state.placement.engine.name == "b"
    # the replay repeats the head (in pieces, across batches) before anything new
    all_logprobs = logprobs_of(ids, 0)
    second, _, _ = state.take(TokenDelta(head[:2], cached_tokens=9, logprobs=all_logprobs[:2]),
                              Queued(TokenDelta(ids[2:4], logprobs=all_logprobs[2:4])))
    rest, _, finished = state.take(TokenDelta(ids[4:], logprobs=all_logprobs[4:]), Queued(
        Finished(FinishReason.STOP, 4, len(ids))))
    assert finished and text + second + rest == "hello there world at sea"
    assert state.processor.generated_ids == ids  # each token once
    assert [lp.token_id for lp in state.logprobs_out()] == list(tail)  # none repeated
    assert state.cached_tokens == 3 and not state.failover.refused_migration


def test_a_replay_that_differs_ends_the_stream_with_an_error(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), constraint=REGEX, temperature=0)
    ids = word_ids(text_model, "hello there world")
    state.take(TokenDelta(ids), Queued())
    assert state.next_attempt(EngineError(ErrorKind.UNAVAILABLE, "gone", engine="a"),
                              dispatcher, 100.0) is Decision.MIGRATE
    other = (*ids[:2], ids[2] + 1, *ids[3:])  # the same but for its third token
    assert state.take(TokenDelta(other), Queued()) == ("", 0, False)  # nothing streamed twice
    with pytest.raises(EngineError) as raised:
        state.wait(101.0)
    assert f"other tokens after 2 of the {len(ids)} already streamed" in str(raised.value)
    with pytest.raises(EngineError, match="replaying its structured-output constraint"):
        state.next_attempt(raised.value, dispatcher, 101.0)  # no further attempt
    assert state.failover.unmigratable == "replay_diverged" and state.failover.refused_migration


def test_a_replay_that_ends_before_repeating_everything_differs(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines(), constraint=REGEX, temperature=0)
    ids = word_ids(text_model, "hello there world")
    state.take(TokenDelta(ids), Queued())
    state.next_attempt(EngineError(ErrorKind.UNAVAILABLE, "gone", engine="a"), dispatcher, 100.0)
    assert state.take(TokenDelta(ids[:2]), Queued(Finished(FinishReason.STOP, 4, 2))) == (
        "", 0, False)
    with pytest.raises(EngineError, match=f"after 2 of the {len(ids)}"):
        state.wait(101.0)


# -- the reasoning budget ---------------------------------------------------------------------


def budgeted(text_model: TextModel, budget: int) -> tuple[RelayState, Dispatcher]:
    """A request whose reply is read by the qwen3 reasoning parser, with a thinking budget."""
    state, dispatcher = relay_state(text_model, two_engines(), max_tokens=40)
    state.parser = ChoiceParser(reasoning_parser="qwen3")
    state.thinking_budget = budget
    return state, dispatcher


def test_a_budget_cuts_its_batch_exactly_and_closes_an_open_block(text_model: TextModel) -> None:
    state, dispatcher = budgeted(text_model, 9)
    ids = word_ids(text_model, "<think>one two three four five six seven")
    assert len(ids) > 9
    text, tokens, finished = state.take(TokenDelta(ids[:4]), Queued(TokenDelta(ids[4:])))
    assert tokens == 9 and not finished and state.processor.generated_ids == ids[:9]
    assert state.held is not None and state.held.token_ids == ids[9:]
    state.parse(text, False)  # what the emitter does with every batch
    assert state.thinking_due() == "</think>" and state.held is None  # the rest is dropped
    closing = word_ids(text_model, "\n</think>\n\n")
    text, tokens, _ = state.close_thinking(closing)
    assert tokens == len(closing) and state.thinking_budget is None
    assert state.parse(text, False).reasoning == ""  # the block is closed for the parser
    state.resume(dispatcher)
    assert state.call.input_ids == PROMPT + ids[:9] + closing
    assert state.call.sampling.max_tokens == 40 - 9 - len(closing)
    assert state.call.request_id == "req~1" and state.resumed


def test_output_held_at_a_budget_with_no_block_open_goes_on_or_is_made_again(
    text_model: TextModel,
) -> None:
    state, dispatcher = budgeted(text_model, 2)
    ids = word_ids(text_model, "plain answer here, no thinking")
    text, _, _ = state.take(TokenDelta(ids), Queued())
    state.parse(text, False)
    assert state.thinking_due() is None and state.thinking_budget is None  # nothing to close
    assert state.held is not None and state.held.token_ids == ids[2:]  # taken next ...
    error = EngineError(ErrorKind.UNAVAILABLE, "gone")
    assert state.next_attempt(error, dispatcher, 100.0) is Decision.MIGRATE
    assert state.held is None  # ... unless its engine fails: the next one makes it again
    assert state.call.input_ids == PROMPT + ids[:2]
