"""Engine lifecycle states and the probe-threshold rule (sans-IO).

joining → serving ⇄ unhealthy → draining → gone; ``refused`` is an engine
that answers but serves another model (or lies outside what the fleet
allows); it is re-checked, never selected.
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
