"""Build the routing policy the fleet file names (``[frontend.routing]``)."""

from __future__ import annotations

from collections.abc import Collection

from direct_frontend.fleet.schema import RoutingConfig
from direct_frontend.routing.kv_aware import KvAware, KvKnobs, OverlapSource
from direct_frontend.routing.policies import LeastLoaded, Policy, RoundRobin


def make_policy(
    routing: RoutingConfig,
    exact: OverlapSource | None = None,
    live: Collection[int] = (),
) -> Policy:
    """The policy object; ``exact``/``live`` are the KV-event index and the incarnations it covers.

    Raises ``ValueError`` for knobs the policy does not know.
    """
    if routing.policy == "round_robin":
        return RoundRobin()
    if routing.policy == "least_loaded":
        return LeastLoaded()
    policy = KvAware(KvKnobs.from_mapping(routing.knobs), exact)
    policy.uses_events = live
    return policy
