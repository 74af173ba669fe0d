"""The ``cache_affinity`` policy: the longest cached prefix, balanced only when badly off (sans-IO).

It keeps ``kv_aware``'s overlap sources, fencing and rank pinning and replaces
only the choice, so the two compare on the same memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from direct_frontend.routing.catalog import EngineHandle
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import RequestView

__all__ = ["CacheAffinity"]


class CacheAffinity(KvAware):
    """``cache_affinity``: the longest cached prefix, balance only when it is badly off.

    The baseline the ``kv_aware`` defaults are measured against
    (``scripts/routing_sim.py``): the engine holding the longest
    cached prefix of the request (ties → fewer requests in flight); only when
    the busiest candidate has more than 64 requests above the idlest *and*
    1.5× its count does a request go to the least-loaded engine. It weighs no
    load below that gate, so it herds; kept as a selectable policy to compare with.
    """

    name = "cache_affinity"
    memory = False
    GATE_ABS = 64
    GATE_REL = 1.5

    def rank_cost(self, miss: int, fullness: float, busy: int) -> float:
        """The longest cached prefix on the engine's ranks too (ties: fewer in flight)."""
        return float(miss)

    def select(
        self,
        candidates: Sequence[EngineHandle],
        request: RequestView,
        hashes: Sequence[int],
        overlaps: dict[str, int],
    ) -> tuple[EngineHandle, bool]:
        loads = [e.load.fleet_in_flight for e in candidates]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self.GATE_ABS and busiest > self.GATE_REL * idlest:
            return candidates[loads.index(idlest)], True
        return self._pick(candidates, [-overlaps.get(e.name, 0) for e in candidates]), False
