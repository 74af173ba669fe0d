"""Engine lifecycle states, their legal transitions, and the probe rules (sans-IO).

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


#: The slowest an unhealthy engine is probed, as a multiple of the probe interval.
MAX_BACKOFF_FACTOR = 8


class ProbeTracker:
    """Counts consecutive probe results and says when the state must change.

    ``failure_threshold`` failures in a row take a serving engine out;
    ``success_threshold`` successes in a row bring an unhealthy one back. A
    fault seen on a request (``fault``) takes it out at once.
    """

    def __init__(self, failure_threshold: int, success_threshold: int) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.state = EngineState.JOINING
        self._failures = 0
        self._successes = 0

    def joined(self) -> EngineState:
        self.state = EngineState.SERVING
        self._failures = self._successes = 0
        return self.state

    def record(self, ok: bool) -> EngineState | None:
        """Feed one probe result; return the new state if it changed."""
        if ok:
            self._failures = 0
            self._successes += 1
            if self.state is EngineState.UNHEALTHY and self._successes >= self.success_threshold:
                self.state = EngineState.SERVING
                return self.state
        else:
            self._successes = 0
            self._failures += 1
            if self.state is EngineState.SERVING and self._failures >= self.failure_threshold:
                self.state = EngineState.UNHEALTHY
                return self.state
        return None

    def fault(self) -> EngineState | None:
        """A transport fault on a live request: out of rotation now, probes bring it back."""
        self._successes = 0
        if self.state is EngineState.SERVING:
            self.state = EngineState.UNHEALTHY
            return self.state
        return None

    def next_delay(self, interval_s: float) -> float:
        """Seconds until the next probe: the interval, doubled per failure while unhealthy.

        An engine that stays down is probed less and less often (up to
        ``MAX_BACKOFF_FACTOR`` × the interval); the first success goes back to
        the interval so recovery takes ``success_threshold`` intervals, not more.
        """
        if self.state is not EngineState.UNHEALTHY or self._failures == 0:
            return interval_s
        beyond = max(0, self._failures - self.failure_threshold)
        return interval_s * float(min(2**beyond, MAX_BACKOFF_FACTOR))

    def retune(self, failure_threshold: int, success_threshold: int) -> None:
        """New thresholds from a reloaded fleet file; the counts so far are kept."""
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
