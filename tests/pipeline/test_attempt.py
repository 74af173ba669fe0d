"""A request's attempts with data only: the phase table, waits, moves, stalls, the next
attempt, replays, and waiting for an engine."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from direct_frontend.engines.neutral import (
    Constraint,
    ConstraintKind,
    Finished,
    FinishReason,
    TokenDelta,
)
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import FaultsConfig, FrontendConfig
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.types import CompletionRequest
from direct_frontend.pipeline.attempt import (
    TRANSITIONS,
    Attempt,
    IllegalTransition,
    Phase,
    check_transition,
)
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.engine_wait import EngineWait, first_placement
from direct_frontend.pipeline.failover import Decision
from direct_frontend.pipeline.preprocess import PreparedRequest, build_call
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.catalog import Catalog
from direct_frontend.routing.policies import RoundRobin
from tests.support.fleet import StaticFleet, engine

PROMPT = (11, 12, 13, 14)
OUTPUT = (21, 22, 23)  # tokens a request produced before its engine failed
DEFAULT_FAULTS = FaultsConfig()
STALL_S = DEFAULT_FAULTS.stall_timeout_s
WAIT_S = DEFAULT_FAULTS.wait_for_engine_s
TIMEOUT_S = 90.0
REGEX = Constraint(ConstraintKind.REGEX, "[a-z ]+", param="guided_regex")
S = Phase


def attempt_on(
    catalog: Catalog, *, max_tokens: int = 16, faults: FaultsConfig = DEFAULT_FAULTS,
    constraint: Constraint | None = None, temperature: float = 1.0,
) -> tuple[Attempt, Dispatcher]:
    """A request placed on the catalog's first engine at t=100, as the relay starts it."""
    frontend = FrontendConfig(served_model_name="demo", tokenizer=Path("demo-model"),
                              request_timeout_s=TIMEOUT_S, faults=faults)
    settings = Settings.first(frontend, RoundRobin(start=0))
    request = CompletionRequest(model="demo", prompt=PROMPT, max_tokens=max_tokens)
    prepared = PreparedRequest("completion", "req", request, PROMPT, "")
    dispatcher = Dispatcher(StaticFleet(catalog))
    placement = dispatcher.choose(settings.policy, PROMPT, max_tokens)
    call = build_call(prepared, max_tokens, stream=True)
    if constraint is not None:
        call = dataclasses.replace(call, sampling=dataclasses.replace(
            call.sampling, constraint=constraint, temperature=temperature))
    return Attempt(settings, prepared, placement, call, now=100.0), dispatcher


def two_engines() -> Catalog:
    return Catalog(1, (engine("a"), engine("b")))


def fleet_of(dispatcher: Dispatcher) -> StaticFleet:
    fleet = dispatcher.fleet
    assert isinstance(fleet, StaticFleet)
    return fleet


def lost(name: str | None = "a", kind: ErrorKind = ErrorKind.UNAVAILABLE) -> EngineError:
    return EngineError(kind, "lost", engine=name)


# -- the phase table ---------------------------------------------------------------------


def test_the_phase_table_checks_its_edges() -> None:
    for old, new in [(S.RELAYING, S.WAITING), (S.WAITING, S.MOVING), (S.MOVING, S.RELAYING),
                     (S.NO_ENGINE, S.RELAYING), (S.WAITING, S.TIMED_OUT),
                     (S.RELAYING, S.FINISHED), (S.FAILED, S.FAILED)]:
        check_transition(old, new)
    for old, new in [(S.FINISHED, S.RELAYING), (S.FAILED, S.NO_ENGINE),
                     (S.TIMED_OUT, S.RELAYING), (S.NO_ENGINE, S.FINISHED),
                     (S.WAITING, S.FINISHED), (S.NO_ENGINE, S.WAITING)]:
        with pytest.raises(IllegalTransition):
            check_transition(old, new)
    assert all(not TRANSITIONS[end] for end in (S.FINISHED, S.FAILED, S.TIMED_OUT))


Step = Callable[[Attempt, Dispatcher], object]


def _fail(error: EngineError, now: float = 100.0, generated: tuple[int, ...] = ()) -> Step:
    """The engine call ended in ``error``: the next attempt (a give-up is kept, not raised)."""
    def step(attempt: Attempt, dispatcher: Dispatcher) -> None:
        with contextlib.suppress(EngineError):
            attempt.next_attempt(error, dispatcher, now, generated, 16 - len(generated))
    return step


def _no_engines(attempt: Attempt, dispatcher: Dispatcher) -> None:
    fleet_of(dispatcher).catalog = Catalog(9, ())


def _place_at(now: float) -> Step:
    def step(attempt: Attempt, dispatcher: Dispatcher) -> None:
        with contextlib.suppress(EngineError):
            attempt.place(dispatcher, now, OUTPUT, 13)
    return step


def _interrupt_at(now: float) -> Step:
    def step(attempt: Attempt, dispatcher: Dispatcher) -> None:
        _fail(attempt.interrupted(now), now)(attempt, dispatcher)
    return step


def _back(attempt: Attempt, dispatcher: Dispatcher) -> None:
    fleet_of(dispatcher).catalog = Catalog(10, (engine("c"),))


def _wait(attempt: Attempt, dispatcher: Dispatcher) -> None:
    attempt.wait(100.0)


def _relaying(attempt: Attempt, dispatcher: Dispatcher) -> None:
    attempt.relaying()


def _move(attempt: Attempt, dispatcher: Dispatcher) -> None:
    attempt.move()


def _finished(attempt: Attempt, dispatcher: Dispatcher) -> None:
    attempt.finished()


DEADLINE = 100.0 + TIMEOUT_S
LATE = _fail(lost(), DEADLINE)  # a failure once the request's time is up, no engine serving

#: every way through the machine: each edge of the table is walked by one at least
SCENARIOS: dict[str, list[Step]] = {
    "streams to its end": [_wait, _relaying, _wait, _relaying, _finished],
    "a move raced the last batch": [_wait, _relaying, _move, _finished],
    "retried before output": [_fail(lost()), _wait, _relaying, _finished],
    "migrated after a stall": [_wait, _interrupt_at(110.0), _relaying, _finished],
    "moved off a draining engine": [_wait, _move, _interrupt_at(101.0), _finished],
    "moved at the next safe point": [_move, _no_engines, _interrupt_at(101.0), _back,
                                     _place_at(102.0)],
    "timed out waiting": [_wait, _interrupt_at(DEADLINE)],
    "no engine while relaying": [_no_engines, _fail(lost()), _place_at(101.0),
                                 _place_at(100.0 + WAIT_S)],
    "no engine after a stall": [_wait, _no_engines, _interrupt_at(110.0), _back,
                                _place_at(111.0), _wait, _relaying, _finished],
    "none again at the deadline": [_no_engines, _fail(lost()), _place_at(DEADLINE)],
    "late while relaying": [_no_engines, LATE],
    "late while moving": [_move, _no_engines, _fail(lost(kind=ErrorKind.DRAINING), DEADLINE)],
    "late after a stall": [_wait, _no_engines, _fail(lost(kind=ErrorKind.TIMEOUT), DEADLINE)],
    "gave up while relaying": [_fail(lost(kind=ErrorKind.BAD_REQUEST))],
    "gave up while waiting": [_wait, _fail(lost(kind=ErrorKind.BAD_REQUEST))],
    "gave up while moving": [_move, _fail(lost(kind=ErrorKind.BAD_REQUEST))],
}


def test_every_way_through_walks_only_the_tables_edges_and_all_of_them() -> None:
    walked: set[tuple[Phase, Phase]] = set()
    for name, steps in SCENARIOS.items():
        attempt, dispatcher = attempt_on(two_engines())
        phases = [attempt.phase]
        for step in steps:
            step(attempt, dispatcher)
            phases.append(attempt.phase)
        edges = {(old, new) for old, new in itertools.pairwise(phases) if old is not new}
        assert all(new in TRANSITIONS[old] for old, new in edges), (name, phases)
        walked |= edges
    table = {(old, new) for old, news in TRANSITIONS.items() for new in news if new is not old}
    assert table - walked == set()  # no edge the relay never takes


def test_a_finished_output_takes_no_further_attempt() -> None:
    attempt, dispatcher = attempt_on(two_engines())
    attempt.finished()
    with pytest.raises(IllegalTransition):
        attempt.next_attempt(lost(), dispatcher, 100.0, (), 16)


# -- one engine call ---------------------------------------------------------------------


def test_an_error_kept_from_a_batch_is_raised_at_the_next_wait() -> None:
    attempt, _ = attempt_on(two_engines())
    attempt.pending_error = broken = lost()
    with pytest.raises(EngineError) as raised:
        attempt.wait(1.0)
    assert raised.value is broken and attempt.pending_error is None
    assert attempt.phase is Phase.RELAYING


def test_the_stall_watch_never_outlasts_the_request() -> None:
    attempt, _ = attempt_on(two_engines())
    assert attempt.wait(110.0) == 110.0 + STALL_S and attempt.phase is Phase.WAITING
    assert attempt.wait(attempt.deadline - 1.0) == attempt.deadline


# -- leaving an engine -------------------------------------------------------------------


def test_a_move_cuts_a_wait_short_but_never_a_write() -> None:
    waiting, _ = attempt_on(two_engines())
    waiting.wait(0.0)
    assert waiting.move() and waiting.phase is Phase.MOVING
    writing, _ = attempt_on(two_engines())
    assert not writing.move() and writing.phase is Phase.MOVING  # leaves at the next wait
    draining = writing.interrupted(now=1.0)
    assert draining.kind is ErrorKind.DRAINING and draining.engine == "a"
    done, _ = attempt_on(two_engines())
    done.finished()
    assert not done.move() and done.phase is Phase.FINISHED  # the output is complete anyway


def test_a_silent_engine_stalls_and_a_late_request_times_out() -> None:
    stalled, _ = attempt_on(two_engines())
    stalled.wait(0.0)
    error = stalled.interrupted(now=STALL_S)
    assert error.kind is ErrorKind.TIMEOUT and stalled.phase is Phase.WAITING
    late, dispatcher = attempt_on(two_engines())
    late.wait(late.deadline - 1.0)
    error = late.interrupted(now=late.deadline)
    assert error.kind is ErrorKind.CANCELLED and late.phase is Phase.TIMED_OUT
    with pytest.raises(EngineError):
        late.next_attempt(error, dispatcher, 100.0, (), 16)  # no retry once the time is up
    assert late.phase is Phase.TIMED_OUT
    refusal = late.error_for(error)
    assert refusal.status == 504 and f"within {TIMEOUT_S:g} s" in refusal.message


# -- the next attempt --------------------------------------------------------------------


def test_a_failure_before_output_retries_the_same_call_elsewhere() -> None:
    attempt, dispatcher = attempt_on(two_engines())
    assert attempt.next_attempt(lost(), dispatcher, 100.0, (), 16) is Decision.RETRY
    assert attempt.placement.engine.name == "b" and attempt.phase is Phase.RELAYING
    assert attempt.call.input_ids == PROMPT and attempt.call.request_id == "req~1"
    assert attempt.call.sampling.max_tokens == 16 and not attempt.continued


def test_a_failure_after_output_migrates_with_the_tokens_produced() -> None:
    attempt, dispatcher = attempt_on(two_engines())
    error = EngineError(ErrorKind.TIMEOUT, "the stream stalled")  # no engine named: this one
    assert attempt.next_attempt(error, dispatcher, 100.0, OUTPUT, 13) is Decision.MIGRATE
    assert attempt.failed is not None and attempt.failed.engine == "a"
    assert attempt.failover.tried == {"a"}
    assert attempt.call.input_ids == PROMPT + OUTPUT
    assert attempt.call.sampling.max_tokens == 13
    assert attempt.continued  # the engine's prompt is no longer the client's


def test_the_retry_budget_is_bounded() -> None:
    catalog = Catalog(1, tuple(engine(name) for name in "abcd"))
    attempt, dispatcher = attempt_on(catalog, faults=FaultsConfig(max_retries=1))
    attempt.next_attempt(lost("a", ErrorKind.OVERLOADED), dispatcher, 100.0, (), 16)
    last = lost("b", ErrorKind.OVERLOADED)
    with pytest.raises(EngineError) as raised:
        attempt.next_attempt(last, dispatcher, 100.0, (), 16)
    assert raised.value is last and attempt.phase is Phase.FAILED
    assert attempt.error_for(last).status == 429  # every engine tried was saturated


def test_no_engine_left_waits_for_one_and_too_short_a_context_gives_up() -> None:
    alone, dispatcher = attempt_on(Catalog(1, (engine("a"),)))
    error = lost()
    assert alone.next_attempt(error, dispatcher, 100.0, (), 16) is Decision.RETRY
    assert alone.phase is Phase.NO_ENGINE and alone.engine_wait.until == 100.0 + WAIT_S
    impatient, dispatcher = attempt_on(Catalog(1, (engine("a"),)),
                                       faults=FaultsConfig(wait_for_engine_s=0))
    with pytest.raises(EngineError) as raised:
        impatient.next_attempt(error, dispatcher, 100.0, (), 16)
    assert raised.value is error and impatient.phase is Phase.FAILED
    short = Catalog(1, (engine("a"), engine("b", context_length=len(PROMPT) + 4)))
    attempt, dispatcher = attempt_on(short)
    with pytest.raises(EngineError) as cannot:
        attempt.next_attempt(lost(None), dispatcher, 100.0, (), 16)
    assert "cannot resume on b: context too short" in cannot.value.message
    assert attempt.placement.engine.name == "a" and attempt.phase is Phase.FAILED


def test_saturated_everywhere_is_a_429_at_once_not_a_wait() -> None:
    attempt, dispatcher = attempt_on(two_engines())
    attempt.next_attempt(lost("a", ErrorKind.OVERLOADED), dispatcher, 100.0, (), 16)
    last = lost("b", ErrorKind.OVERLOADED)
    with pytest.raises(EngineError) as raised:
        attempt.next_attempt(last, dispatcher, 100.0, (), 16)
    assert raised.value is last and attempt.phase is Phase.FAILED
    assert attempt.error_for(last).status == 429


def test_an_engine_that_cannot_compile_the_constraint_is_the_clients_400() -> None:
    attempt, dispatcher = attempt_on(two_engines(), constraint=REGEX)
    refused = EngineError(ErrorKind.BAD_REQUEST, "invalid regex: unbalanced (", engine="a")
    with pytest.raises(EngineError):
        attempt.next_attempt(refused, dispatcher, 100.0, (), 16)
    told = attempt.error_for(refused)
    assert told.status == 400 and told.param == "guided_regex"
    assert "could not take 'guided_regex'" in told.message


# -- waiting for an engine ---------------------------------------------------------------


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


def test_a_retry_waits_for_an_engine_then_gives_up_with_the_last_failure() -> None:
    attempt, dispatcher = attempt_on(Catalog(1, (engine("a"),)))
    error = lost()
    fleet_of(dispatcher).catalog = Catalog(2, ())  # the fault took it out
    attempt.next_attempt(error, dispatcher, 100.0, (), 16)
    assert attempt.phase is Phase.NO_ENGINE
    assert attempt.place(dispatcher, 101.0, (), 16) is None
    assert attempt.phase is Phase.NO_ENGINE
    with pytest.raises(EngineError) as raised:
        attempt.place(dispatcher, 100.0 + WAIT_S, (), 16)
    assert raised.value is error and attempt.phase is Phase.FAILED
    assert attempt.error_for(error).status == 502  # as without the wait
    late, dispatcher = attempt_on(Catalog(1, (engine("a"),)))
    fleet_of(dispatcher).catalog = Catalog(2, ())
    late.next_attempt(error, dispatcher, late.deadline - 1.0, (), 16)
    assert late.engine_wait.until == late.deadline
    with pytest.raises(EngineError):
        late.place(dispatcher, late.deadline, (), 16)
    assert late.phase is Phase.TIMED_OUT and late.error_for(error).status == 504


def test_a_stream_goes_back_to_a_tried_engine_once_it_came_back() -> None:
    attempt, dispatcher = attempt_on(two_engines())
    a, b = fleet_of(dispatcher).catalog.engines
    assert attempt.next_attempt(lost(None), dispatcher, 100.0, OUTPUT, 13) is Decision.MIGRATE
    assert attempt.placement.engine is b and attempt.excluded == {"a"}  # a is still listed
    fleet_of(dispatcher).catalog = Catalog(2, (a,))  # b fails too; a is in the same stint
    attempt.next_attempt(lost(None), dispatcher, 101.0, OUTPUT, 13)
    assert attempt.phase is Phase.NO_ENGINE and attempt.excluded == {"a"}
    a_again = engine("a")  # a restarted: it serves again in a new stint
    fleet_of(dispatcher).catalog = Catalog(3, (a_again, b))
    placed = attempt.place(dispatcher, 102.0, OUTPUT, 13)
    assert placed is not None and placed.engine is a_again and attempt.phase is Phase.RELAYING
    assert attempt.excluded == {"b"} and attempt.engine_wait.until is None
    assert attempt.call.input_ids == PROMPT + OUTPUT  # the same continuation, on a new chance


# -- constrained streams: a replay, or none ----------------------------------------------


def test_a_sampled_constrained_stream_is_not_migrated() -> None:
    attempt, dispatcher = attempt_on(two_engines(), constraint=REGEX)
    with pytest.raises(EngineError, match="could not enforce its structured-output constraint"):
        attempt.next_attempt(lost(), dispatcher, 100.0, OUTPUT, 13)
    assert attempt.failover.refused_migration and attempt.failover.unmigratable == "constraint"


def test_a_deterministic_constrained_stream_is_replayed_and_its_repeat_checked() -> None:
    attempt, dispatcher = attempt_on(two_engines(), constraint=REGEX, temperature=0,
                                     max_tokens=12)
    assert attempt.next_attempt(lost(), dispatcher, 100.0, OUTPUT, 9) is Decision.MIGRATE
    # the client's own call again: its prompt, its whole budget, its constraint
    assert attempt.call.input_ids == PROMPT and attempt.call.request_id == "req~1"
    assert attempt.call.sampling.max_tokens == 12 and attempt.call.sampling.constraint == REGEX
    assert attempt.placement.engine.name == "b" and attempt.replaying == OUTPUT
    # the repeat comes in pieces: each dropped, and what follows it kept
    assert attempt.replayed(TokenDelta(OUTPUT[:2]), 3) == TokenDelta(())
    rest = attempt.replayed(TokenDelta((OUTPUT[2], 24, 25)), 3)
    assert rest == TokenDelta((24, 25)) and attempt.replaying == ()
    assert attempt.replayed(TokenDelta((26,)), 5) == TokenDelta((26,))  # past it: as it is
    assert attempt.pending_error is None and not attempt.failover.refused_migration


def test_a_replay_that_differs_or_ends_early_is_kept_as_an_error() -> None:
    differs, dispatcher = attempt_on(two_engines(), constraint=REGEX, temperature=0)
    differs.next_attempt(lost(), dispatcher, 100.0, OUTPUT, 13)
    assert differs.replayed(TokenDelta((OUTPUT[0], OUTPUT[1], 99)), 3) is None
    assert differs.pending_error is not None
    assert "other tokens after 2 of the 3 already streamed" in str(differs.pending_error)
    assert differs.failover.unmigratable == "replay_diverged"
    with pytest.raises(EngineError, match="replaying its structured-output constraint"):
        differs.next_attempt(differs.pending_error, dispatcher, 101.0, OUTPUT, 13)
    early, dispatcher = attempt_on(two_engines(), constraint=REGEX, temperature=0)
    early.next_attempt(lost(), dispatcher, 100.0, OUTPUT, 13)
    assert early.replayed(Finished(FinishReason.STOP, 4, 2, token_ids=OUTPUT[:2]), 3) is None
    assert "after 2 of the 3" in str(early.pending_error)
