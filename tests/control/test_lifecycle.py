"""The lifecycle rules with data only: the state table, probe counting and backoff, hand-over."""

from __future__ import annotations

import pytest

from direct_frontend.control.lifecycle import (
    FIRST_RETRY_S,
    MAX_RETRY_S,
    TRANSITIONS,
    EngineState,
    IllegalTransition,
    ProbeOutcome,
    ProbeTracker,
    check_transition,
    may_leave,
    retry_delay,
)

S = EngineState
OK, GONE, BAD = ProbeOutcome.HEALTHY, ProbeOutcome.UNREACHABLE, ProbeOutcome.FAILED


def test_lifecycle_edges() -> None:
    for old, new in [(S.JOINING, S.SERVING), (S.SERVING, S.UNHEALTHY), (S.UNHEALTHY, S.SERVING),
                     (S.SERVING, S.DRAINING), (S.REFUSED, S.DRAINING), (S.DRAINING, S.GONE),
                     (S.JOINING, S.REFUSED), (S.SERVING, S.JOINING), (S.JOINING, S.GONE)]:
        check_transition(old, new)
    for old, new in [(S.DRAINING, S.SERVING), (S.GONE, S.JOINING), (S.DRAINING, S.UNHEALTHY),
                     (S.GONE, S.DRAINING)]:
        with pytest.raises(IllegalTransition):
            check_transition(old, new)
    assert TRANSITIONS[S.GONE] == frozenset()


def serving(failure_threshold: int = 3, success_threshold: int = 2) -> ProbeTracker:
    tracker = ProbeTracker(failure_threshold, success_threshold)
    tracker.joined()
    return tracker


# -- probes -------------------------------------------------------------------------------


def test_retry_delay_starts_fast_doubles_and_stops_at_the_cap_or_the_interval() -> None:
    assert [retry_delay(n, 5.0) for n in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert [retry_delay(n, 0.1) for n in range(3)] == [0.05, 0.1, 0.1]
    assert retry_delay(10_000, 5.0) == MAX_RETRY_S  # no overflow, however long it is down
    assert retry_delay(0, 0.01) == 0.01  # never slower than the probe interval


def test_while_no_engine_serves_there_is_no_backoff() -> None:
    assert [retry_delay(n, 5.0, hurry=True) for n in (0, 3, 100)] == [FIRST_RETRY_S] * 3
    assert retry_delay(0, 0.01, hurry=True) == 0.01
    tracker = serving()
    tracker.fault(GONE)
    for _ in range(6):
        tracker.record(GONE)
    assert tracker.next_delay(5.0) == MAX_RETRY_S
    assert tracker.next_delay(5.0, hurry=True) == FIRST_RETRY_S
    assert tracker.next_delay(5.0) == MAX_RETRY_S  # hurrying counts nothing
    misbehaved = serving()
    misbehaved.fault(BAD)
    misbehaved.record(OK)
    assert misbehaved.next_delay(5.0, hurry=True) == 5.0  # the flap guard holds regardless
    assert serving().next_delay(5.0, hurry=True) == 5.0  # serving engines: the interval


def test_a_serving_engine_leaves_after_failure_threshold_failed_probes_in_a_row() -> None:
    tracker = serving()
    assert tracker.next_delay(5.0) == 5.0
    assert tracker.record(GONE) is None and tracker.record(BAD) is None
    assert tracker.record(OK) is None  # a good probe resets the count
    assert tracker.record(GONE) is None and tracker.record(GONE) is None
    assert tracker.record(GONE) is S.UNHEALTHY
    assert tracker.state is S.UNHEALTHY
    assert tracker.record(GONE) is None  # already out: no second transition


def test_an_engine_that_is_out_is_probed_fast_and_backs_off_only_while_it_fails() -> None:
    tracker = serving()
    for _ in range(3):
        tracker.record(GONE)
    delays = []
    for _ in range(7):
        delays.append(tracker.next_delay(5.0))
        tracker.record(GONE)
    assert delays == [FIRST_RETRY_S, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert sum(delays[:4]) < 1  # four probes in its first second down, not one in five


def test_an_unreachable_engine_comes_back_on_its_first_good_probe() -> None:
    """A lost connection means the process went away: what answers next is a fresh start."""
    tracker = serving()
    assert tracker.fault(GONE) is S.UNHEALTHY
    assert tracker.next_delay(5.0) == FIRST_RETRY_S
    assert tracker.record(GONE) is None  # still down
    assert tracker.needed == 1
    assert tracker.record(OK) is S.SERVING  # the child re-discovers it, then ...
    assert tracker.state is S.UNHEALTHY  # ... only joined() puts it back
    assert tracker.joined() is S.SERVING
    assert tracker.next_delay(5.0) == 5.0


def test_an_engine_that_misbehaved_needs_success_threshold_probes_an_interval_apart() -> None:
    """Up but failing (unhealthy answer, timeout, stall): it must not flap at probe speed."""
    tracker = serving(success_threshold=3)
    assert tracker.fault(BAD) is S.UNHEALTHY
    assert tracker.needed == 3
    assert tracker.next_delay(5.0) == FIRST_RETRY_S  # looked at fast while it fails ...
    assert tracker.record(OK) is None
    assert tracker.next_delay(5.0) == 5.0  # ... trusted only slowly once it answers
    assert tracker.record(OK) is None
    assert tracker.record(OK) is S.SERVING


def test_the_latest_failure_says_how_an_engine_comes_back() -> None:
    restarting = serving()
    restarting.fault(GONE)
    restarting.record(BAD)  # the new process is up but not healthy yet
    assert restarting.needed == 2 and restarting.record(OK) is None
    assert restarting.record(OK) is S.SERVING

    crashed = serving()
    crashed.fault(BAD)
    crashed.record(GONE)  # then the process went away: its successor starts fresh
    assert crashed.needed == 1 and crashed.record(OK) is S.SERVING


def test_a_failed_rediscovery_is_a_failed_try_and_the_backoff_goes_on() -> None:
    tracker = serving()
    tracker.fault(GONE)
    tracker.record(GONE)
    tracker.record(GONE)
    assert tracker.next_delay(5.0) == 0.2
    assert tracker.record(OK) is S.SERVING
    tracker.record(GONE)  # discovery failed: the child reports it as a failed try
    assert tracker.state is S.UNHEALTHY and tracker.next_delay(5.0) == 0.4


def test_a_fault_on_an_engine_already_out_changes_nothing_but_the_way_back() -> None:
    tracker = serving()
    tracker.fault(GONE)
    assert tracker.fault(BAD) is None and tracker.needed == 2


def test_retune_keeps_the_counts() -> None:
    tracker = serving(failure_threshold=3)
    tracker.record(GONE)
    tracker.record(GONE)
    tracker.retune(failure_threshold=2, success_threshold=4)
    assert tracker.record(GONE) is S.UNHEALTHY
    tracker.record(BAD)
    assert tracker.needed == 4


# -- hand-over ----------------------------------------------------------------------------


def leaves(*successors: EngineState, serving: bool = True, port_wanted: bool = False,
           others_serving: bool = False, others_coming: bool = False) -> bool:
    return may_leave(successors, serving=serving, port_wanted=port_wanted,
                     others_serving=others_serving, others_coming=others_coming)


def test_an_outgoing_incarnation_serves_until_every_successor_has_joined() -> None:
    assert not leaves(S.JOINING)
    assert not leaves(S.SERVING, S.JOINING, others_serving=True)
    assert leaves(S.SERVING)
    assert leaves(S.SERVING, S.SERVING)
    assert leaves(S.REFUSED)  # a refused successor will not serve: no point waiting
    assert leaves(S.UNHEALTHY)  # it joined, then failed: out of our hands
    assert leaves()  # nothing to wait for (removed, and the edit added nothing)
    assert leaves(S.JOINING, serving=False)  # unhealthy, refused, joining: nothing to hand over


def test_an_outgoing_simulator_whose_port_is_wanted_leaves_as_soon_as_it_can() -> None:
    # the successor can only start once this incarnation has left its port
    assert leaves(S.JOINING, port_wanted=True, others_serving=True)
    assert leaves(S.JOINING, port_wanted=True)  # nobody else could serve meanwhile anyway
    # ... but not while it is the last engine serving and another is about to serve
    assert not leaves(S.JOINING, port_wanted=True, others_coming=True)
    assert leaves(S.JOINING, port_wanted=True, others_serving=True, others_coming=True)
