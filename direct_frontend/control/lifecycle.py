"""Engine lifecycle states, their legal transitions, the probe and hand-over rules (sans-IO).

::

    joining ──► serving ◄──► unhealthy
       │  ▲        │             │
       ▼  │        ▼             ▼
      refused ──► draining ──► gone

``refused`` is an engine that answers but serves another model (or lies
outside what the fleet allows); it is re-checked, never selected. Any live
state may start draining (the engine left the fleet file or was replaced);
``draining`` only ends in ``gone``, and ``gone`` is final. Keeping the table
here, not in the child's task, lets a test walk every edge without sockets.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class EngineState(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    UNHEALTHY = "unhealthy"
    REFUSED = "refused"
    DRAINING = "draining"
    GONE = "gone"


_LIVE = frozenset({
    EngineState.JOINING, EngineState.SERVING, EngineState.UNHEALTHY, EngineState.REFUSED,
})

#: Every legal transition. Live → joining is a crash restart or an engine that went away
#: while joining; live → gone is a cancelled incarnation (daemon shutdown).
TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    **{state: _LIVE | {EngineState.DRAINING, EngineState.GONE} for state in _LIVE},
    EngineState.DRAINING: frozenset({EngineState.GONE}),
    EngineState.GONE: frozenset(),
}


class IllegalTransition(Exception):
    """A bug: the control plane tried a transition the lifecycle does not have."""


def check_transition(old: EngineState, new: EngineState) -> None:
    """Raise :class:`IllegalTransition` unless ``old → new`` is an edge (or a no-op)."""
    if new is not old and new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old.value} → {new.value}")


def is_retired(state: EngineState) -> bool:
    """Draining or gone: probe results and faults no longer change anything."""
    return state in (EngineState.DRAINING, EngineState.GONE)


class ProbeOutcome(enum.Enum):
    """What one probe (or a request's fault) says about an engine."""

    HEALTHY = "healthy"
    #: the connection failed (refused, reset, closed, or gRPC UNAVAILABLE): the process is
    #: gone or restarting, and whatever answers next is a fresh start, re-discovered
    UNREACHABLE = "unreachable"
    #: it misbehaved while up: answered "not healthy", timed out, stalled or broke the contract
    FAILED = "failed"


#: The first probe after a failure, and after each further failure twice as long …
FIRST_RETRY_S = 0.05
#: … up to this (or the probe interval, when shorter). Probing an engine that is down costs a
#: failed connect; probing it rarely costs every second it serves again unseen.
MAX_RETRY_S = 0.5


def retry_delay(failures: int, interval_s: float, *, hurry: bool = False) -> float:
    """Seconds before trying an engine again after ``failures`` failed tries since it went out.

    ``hurry``: no engine of the fleet serves, so every moment one could be
    serving counts and backing off saves nothing worth it: always the first delay.
    """
    if hurry:
        return min(FIRST_RETRY_S, interval_s)
    return min(FIRST_RETRY_S * 2.0 ** min(failures, 16), MAX_RETRY_S, interval_s)


class ProbeTracker:
    """Counts consecutive probe results and says when the state must change.

    ``failure_threshold`` failed probes in a row take a serving engine out; a
    fault seen on a request (:meth:`fault`) takes it out at once. An engine
    that is out is probed fast (:func:`retry_delay`), and how it comes back
    depends on why it went out, as its latest failure says: after
    :attr:`ProbeOutcome.UNREACHABLE` one good probe brings it back (the child
    re-discovers it first: a restarted engine serves within a fraction of a
    second); after :attr:`ProbeOutcome.FAILED` it must pass
    ``success_threshold`` probes in a row, a probe interval apart, so an
    engine that misbehaves while up cannot flap in and out at probe speed.
    """

    def __init__(self, failure_threshold: int, success_threshold: int) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.state = EngineState.JOINING
        self._failures = 0  # in a row
        self._successes = 0  # in a row
        self._failures_out = 0  # failed probes since it went out (the retry backoff)
        self._misbehaved = False  # the latest failure was FAILED, not UNREACHABLE

    def joined(self) -> EngineState:
        """Discovery and a good probe passed: serving, every count from zero."""
        self.state = EngineState.SERVING
        self._failures = self._successes = self._failures_out = 0
        self._misbehaved = False
        return self.state

    def rejoining(self) -> EngineState:
        """The engine's task died and runs again: joining, the counts as they were."""
        self.state = EngineState.JOINING
        return self.state

    @property
    def needed(self) -> int:
        """Good probes in a row that bring an engine that is out back."""
        return self.success_threshold if self._misbehaved else 1

    def record(self, outcome: ProbeOutcome) -> EngineState | None:
        """Feed one probe result; return the state the engine must move to, if any.

        ``SERVING`` means "re-discover it and call :meth:`joined`"; until then
        the tracker keeps it out.
        """
        if outcome is ProbeOutcome.HEALTHY:
            self._failures = 0
            self._successes += 1
            if self.state is EngineState.UNHEALTHY and self._successes >= self.needed:
                return EngineState.SERVING
            return None
        self._successes = 0
        self._failures += 1
        self._misbehaved = outcome is ProbeOutcome.FAILED
        if self.state is EngineState.UNHEALTHY:
            self._failures_out += 1
        elif self.state is EngineState.SERVING and self._failures >= self.failure_threshold:
            return self._take_out()
        return None

    def fault(self, outcome: ProbeOutcome) -> EngineState | None:
        """A request saw this engine fail: out of rotation now, probes bring it back."""
        self._successes = 0
        self._misbehaved = outcome is ProbeOutcome.FAILED
        if self.state is EngineState.SERVING:
            return self._take_out()
        return None

    def _take_out(self) -> EngineState:
        self.state = EngineState.UNHEALTHY
        self._failures_out = 0
        return self.state

    def next_delay(self, interval_s: float, *, hurry: bool = False) -> float:
        """Seconds until the next probe.

        Serving: the interval. Out and failing: :func:`retry_delay`, from
        ``FIRST_RETRY_S`` up to ``MAX_RETRY_S`` (``hurry``: no engine serves,
        no backoff). Out, answering, but not yet trusted (it misbehaved): the
        interval between the good probes it needs, hurry or not.
        """
        if self.state is not EngineState.UNHEALTHY:
            return interval_s
        if self._successes:
            return interval_s
        return retry_delay(self._failures_out, interval_s, hurry=hurry)

    def retune(self, failure_threshold: int, success_threshold: int) -> None:
        """New thresholds from a reloaded fleet file; the counts so far are kept."""
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold


def may_leave(
    successors: Iterable[EngineState],
    *,
    serving: bool,
    port_wanted: bool,
    others_serving: bool,
    others_coming: bool,
) -> bool:
    """Whether an incarnation an edit replaced or removed may stop taking requests now.

    Make before break: one that serves keeps serving until every engine it waits for
    (``successors``: its own successor, or the engines the same edit added)
    has joined, i.e. is no longer ``joining`` (serving, or refused, or already
    out again); the supervisor bounds the wait. An embedded simulator's port
    holds one simulator, so when a successor waits for the port this
    incarnation holds (``port_wanted``), waiting only delays it: it leaves as
    soon as another engine serves, or at once when no other engine is on its
    way (``others_coming``) to serve in the meantime. One that does not serve
    has nothing to hand over.
    """
    if not serving or all(state is not EngineState.JOINING for state in successors):
        return True
    return port_wanted and (others_serving or not others_coming)
