"""Each tenant's fair share of the admission slots, and the room it is owed (sans-IO).

A tenant's *share* is the slots times its weight over the summed weights of
the tenants active now (those that asked within :data:`ACTIVE_S`); it is
*owed* what it is short of its share. A tenant past its share leaves free
slots for each tenant owed some (pipeline/admission.py): as many as that
tenant's requests in flight vary by, the square root of how many it holds
(a tenant sending at random holds a count that varies so, as a Poisson
count does), at least one. A tenant's *usage* is the slots it held,
averaged over the last :data:`USAGE_S` (decaying): what preemption judges
(pipeline/preempt.py), since a tenant that sends at random holds more than
its share now and then while using far less. Times are passed in, so it
runs under any clock.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, KeysView

#: a tenant that asked this recently is active: its share is set aside for it
ACTIVE_S = 10.0
#: the time constant of a tenant's usage (the slots it held, averaged, decaying)
USAGE_S = 5.0


class Shares:
    """The active tenants, their weights summed, and the slots each holds."""

    def __init__(self, slots: int, weight: Callable[[str], float]) -> None:
        self.slots = slots
        self.weight = weight
        #: when each tenant last asked (those of the last ACTIVE_S only), the latest last
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._seen_weight = 0.0  # the active tenants' weights, summed
        self._held: dict[str, int] = {}
        self._usage: dict[str, tuple[float, float]] = {}  # (the average, when brought up)

    def held(self, flow: str) -> int:
        """The slots ``flow`` holds now (those counted here)."""
        return self._held.get(flow, 0)

    def saw(self, flow: str, now: float) -> None:
        """``flow`` asked at ``now``: it is active (the most recent last)."""
        if flow not in self._seen:
            self._seen_weight += self.weight(flow)
        self._seen[flow] = now
        self._seen.move_to_end(flow)

    def active(self, now: float) -> KeysView[str]:
        """The tenants that asked within :data:`ACTIVE_S` of ``now``."""
        seen = self._seen
        if seen and next(iter(seen.values())) < now - ACTIVE_S:  # one to forget at least
            self._forget_idle(now)
        return seen.keys()

    def share(self, flow: str) -> float:
        """``flow``'s share of the slots among the active tenants (call :meth:`active` first)."""
        total = self._seen_weight if flow in self._seen else self._seen_weight + self.weight(flow)
        return self.slots * self.weight(flow) / total

    def owed(self, flow: str) -> float:
        """How many slots ``flow`` is short of its share (0: none)."""
        return max(0.0, self.share(flow) - self._held.get(flow, 0))

    def room(self, flow: str) -> int:
        """What ``flow``'s count in flight varies by: the square root of what it holds,
        rounded down, at least one."""
        return max(1, math.isqrt(self._held.get(flow, 0)))

    def spare(self, flow: str) -> float:
        """The free slots a tenant past its share leaves ``flow``: what ``flow``'s count
        in flight varies by (the square root of it, rounded down, at least one), at most what
        it is owed."""
        return min(self.owed(flow), self.room(flow))

    def usage(self, flow: str, now: float) -> float:
        """The slots ``flow`` held, averaged over the last :data:`USAGE_S` up to ``now``."""
        return _decayed(self._held.get(flow, 0), self._usage.get(flow), now)

    def add(self, flow: str, count: int, now: float = 0.0) -> None:
        """``flow`` holds ``count`` more slots (fewer if negative) from ``now`` on."""
        before = self._held.get(flow, 0)
        kept = self._usage.get(flow)
        if kept is None:
            usage = 0.0
        else:  # _decayed's, inline: this runs twice per request
            average, since = kept
            usage = before + (average - before) * math.exp((since - now) / USAGE_S)
        held = before + count
        if held:
            self._held[flow] = held
        else:
            self._held.pop(flow, None)
        if held or usage > 0.01:
            self._usage[flow] = (usage, now)
        else:  # idle long enough: forgotten (the map stays the size of those that matter)
            self._usage.pop(flow, None)

    def _forget_idle(self, now: float) -> None:
        """Forget the tenants that asked nothing within :data:`ACTIVE_S` (oldest first: the
        map is in the order they last asked, so this stops at the first still active)."""
        since = now - ACTIVE_S
        while self._seen:
            flow, seen = next(iter(self._seen.items()))
            if seen >= since:
                return
            del self._seen[flow]
            self._seen_weight = (self._seen_weight - self.weight(flow)) if self._seen \
                else 0.0  # none left: no rounding carried over


def _decayed(held: int, average_since: tuple[float, float] | None, now: float) -> float:
    """The average of what was held, as of ``now``: the ``(average, since)`` kept, decayed
    towards ``held`` (held since then) over :data:`USAGE_S`; 0 with none kept."""
    if average_since is None:
        return 0.0
    average, since = average_since
    return held + (average - held) * math.exp((since - now) / USAGE_S)
