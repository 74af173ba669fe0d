"""Build the routing policy the fleet file names (``[frontend.routing]``)."""

from __future__ import annotations

from collections.abc import Collection

from direct_frontend.fleet.schema import RoutingConfig
from direct_frontend.routing.affinity import Affine, SessionAffinity
from direct_frontend.routing.cache_affinity import CacheAffinity
from direct_frontend.routing.kv_aware import KvAware, OverlapSource
from direct_frontend.routing.peers import PlacementShare
from direct_frontend.routing.policies import LeastLoaded, Policy, RoundRobin


def make_policy(
    routing: RoutingConfig,
    exact: OverlapSource | None = None,
    live: Collection[int] = (),
    placements: PlacementShare | None = None,
    diverged: Collection[int] = (),
) -> Policy:
    """The policy object; ``exact``/``live`` are the KV-event index and the incarnations it covers.

    ``placements`` (replicas) shares a ``kv_aware`` policy's approximate placements;
    ``diverged``: of the incarnations, the ones the hit-rate check found drifting
    (routed approximately). A ``session_key`` adds session affinity (routing/affinity.py).

    The knobs were checked when the fleet file was loaded.
    """
    if routing.policy in ("round_robin", "least_loaded"):
        bare: Policy = RoundRobin() if routing.policy == "round_robin" else LeastLoaded()
        return Affine(bare) if routing.session_key else bare
    knobs = routing.kv_aware
    kind = CacheAffinity if routing.policy == "cache_affinity" else KvAware
    approx = None if placements is None else placements.new_index(
        knobs.approx_ttl_s, knobs.approx_max_blocks, knobs.approx_capacity_blocks,
        knobs.approx_unit_blocks)
    affinity = None
    if routing.session_key or routing.cold_prefix_home:
        affinity = SessionAffinity(routing.session_weight, sessions=bool(routing.session_key),
                                   cold_prefixes=routing.cold_prefix_home)
    return kind(knobs, exact, approx, uses_events=live, diverged=diverged, affinity=affinity)
