"""The relay's decisions, with data only: batches, waits, moves, stalls, the next attempt."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from direct_frontend.engines.neutral import EngineEvent, Finished, FinishReason, TokenDelta
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import FaultsConfig, FrontendConfig
from direct_frontend.openai.types import CompletionRequest
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.failover import Decision
from direct_frontend.pipeline.postprocess import OutputProcessor
from direct_frontend.pipeline.preprocess import PreparedRequest, build_call
from direct_frontend.pipeline.relay import Phase, RelayState
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.catalog import Catalog
from direct_frontend.routing.policies import RoundRobin
from direct_frontend.text.model_dir import TextModel
from tests.support.fleet import StaticFleet, engine

PROMPT = (11, 12, 13, 14)
DEFAULT_FAULTS = FaultsConfig()
STALL_S = DEFAULT_FAULTS.stall_timeout_s
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
) -> tuple[RelayState, Dispatcher]:
    """A request placed on the catalog's first engine, as the relay starts it."""
    frontend = FrontendConfig(served_model_name="demo", tokenizer=Path("demo-model"),
                              request_timeout_s=TIMEOUT_S, faults=faults)
    settings = Settings.first(frontend, RoundRobin())
    request = CompletionRequest(model="demo", prompt=PROMPT, max_tokens=max_tokens, stop=stop)
    prepared = PreparedRequest("completion", "req", request, PROMPT, "")
    dispatcher = Dispatcher(StaticFleet(catalog))
    placement = dispatcher.choose(settings.policy, PROMPT, max_tokens)
    processor = OutputProcessor(text_model.new_detokenizer(), stop, max_tokens)
    call = build_call(prepared, max_tokens, stream=True)
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
        late.next_attempt(error, dispatcher)  # no retry once the time is up
    assert late.phase is Phase.TIMED_OUT
    refusal = late.error_for(error)
    assert refusal.status == 504 and f"within {TIMEOUT_S:g} s" in refusal.message


# -- the next attempt ----------------------------------------------------------------------


def test_a_failure_before_output_retries_the_same_call_elsewhere(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines())
    error = EngineError(ErrorKind.UNAVAILABLE, "refused", engine="a")
    assert state.next_attempt(error, dispatcher) is Decision.RETRY
    assert state.placement.engine.name == "b" and state.phase is Phase.RELAYING
    assert state.call.input_ids == PROMPT and state.call.request_id == "req~1"
    assert state.call.sampling.max_tokens == 16


def test_a_failure_after_output_migrates_with_the_tokens_produced(text_model: TextModel) -> None:
    state, dispatcher = relay_state(text_model, two_engines())
    ids = word_ids(text_model, "hello there")
    state.take(TokenDelta(ids, cached_tokens=3), Queued())
    error = EngineError(ErrorKind.TIMEOUT, "the stream stalled")  # no engine named: this one
    assert state.next_attempt(error, dispatcher) is Decision.MIGRATE
    assert error.engine == "a" and state.failover.tried == {"a"}
    assert state.call.input_ids == PROMPT + ids
    assert state.call.sampling.max_tokens == 16 - len(ids)
    # the client's cached tokens are its own prompt's, not the continuation's
    state.take(TokenDelta(word_ids(text_model, " world"), cached_tokens=9), Queued())
    assert state.cached_tokens == 3


def test_the_retry_budget_is_bounded(text_model: TextModel) -> None:
    catalog = Catalog(1, tuple(engine(name) for name in "abcd"))
    state, dispatcher = relay_state(text_model, catalog, faults=FaultsConfig(max_retries=1))
    state.next_attempt(EngineError(ErrorKind.OVERLOADED, "busy", engine="a"), dispatcher)
    last = EngineError(ErrorKind.OVERLOADED, "busy", engine="b")
    with pytest.raises(EngineError) as raised:
        state.next_attempt(last, dispatcher)
    assert raised.value is last and state.phase is Phase.FAILED
    assert state.error_for(last).status == 429  # every engine tried was saturated


def test_no_engine_left_or_too_short_a_context_gives_up(text_model: TextModel) -> None:
    alone, dispatcher = relay_state(text_model, Catalog(1, (engine("a"),)))
    error = EngineError(ErrorKind.UNAVAILABLE, "refused", engine="a")
    with pytest.raises(EngineError) as raised:
        alone.next_attempt(error, dispatcher)
    assert raised.value is error and alone.phase is Phase.FAILED
    short = Catalog(1, (engine("a"), engine("b", context_length=len(PROMPT) + 4)))
    state, dispatcher = relay_state(text_model, short)
    with pytest.raises(EngineError) as cannot:
        state.next_attempt(EngineError(ErrorKind.UNAVAILABLE, "refused"), dispatcher)
    assert "cannot resume on b: context too short" in cannot.value.message
    assert state.placement.engine.name == "a" and state.phase is Phase.FAILED

