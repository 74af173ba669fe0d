"""Routing policies over catalog snapshots (sans-IO)."""

from __future__ import annotations

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.schema import KvAwareKnobs, RoutingConfig
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.factory import make_policy
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import LeastLoaded, RequestView, RoundRobin

VIEW = RequestView((1, 2, 3), 16)


def handle(name: str, in_flight: int = 0) -> EngineHandle:
    h = EngineHandle(name, "sglang", f"grpc://{name}:1", 1, EngineRole.BOTH,
                     EngineInfo("demo"), 4096, None)
    h.load.in_flight = in_flight
    return h


def test_round_robin_cycles_and_skips_excluded() -> None:
    catalog = Catalog(1, (handle("a"), handle("b"), handle("c")))
    policy = RoundRobin(start=0)
    picks = [policy.choose(catalog, VIEW) for _ in range(6)]
    assert [p.engine.name for p in picks if p] == ["a", "b", "c", "a", "b", "c"]
    assert (chosen := policy.choose(catalog, VIEW, {"a"})) is not None
    assert chosen.engine.name == "b"
    assert policy.choose(catalog, VIEW, {"a", "b", "c"}) is None
    assert policy.choose(Catalog(), VIEW) is None


def test_least_loaded_prefers_idle_engines_and_spreads_ties() -> None:
    catalog = Catalog(1, (handle("a", 3), handle("b", 1), handle("c", 1)))
    policy = LeastLoaded()
    names = {p.engine.name for p in (policy.choose(catalog, VIEW) for _ in range(4)) if p}
    assert names == {"b", "c"}
    only = policy.choose(catalog, VIEW, {"b", "c"})
    assert only is not None and only.engine.name == "a"


def test_other_clients_requests_count_as_the_engine_last_reported_them() -> None:
    a, b = handle("a", 2), handle("b", 1)
    b.load.peer_in_flight = 1
    # a reports 7 (5 of them another router's), b reports 2 (ours and our sibling's)
    a.load.engine_reported(7)
    b.load.engine_reported(2)
    assert (a.load.foreign_in_flight, b.load.foreign_in_flight) == (5, 0)
    assert (a.load.fleet_in_flight, b.load.fleet_in_flight) == (7, 2)
    chosen = LeastLoaded().choose(Catalog(1, (a, b)), VIEW)
    assert chosen is not None and chosen.engine.name == "b"
    b.load.engine_reported(0)  # it finished ours before we did: never below our own count
    assert b.load.foreign_in_flight == 0 and b.load.fleet_in_flight == 2
    a.load.engine_reported(None)  # it could not say: ours alone, not a stale figure
    assert a.load.fleet_in_flight == 2


def test_a_siblings_request_the_engine_reported_before_we_heard_of_it_counts_once() -> None:
    e = handle("e", 1)
    e.load.peer_in_flight = 1
    e.load.engine_reported(6)  # ours 1, a sibling's 1, so 4 others'…
    assert e.load.foreign_in_flight == 4
    e.load.peers_say(3)  # … of which 2 were the sibling's, not yet heard of
    assert (e.load.foreign_in_flight, e.load.fleet_in_flight) == (2, 6)
    e.load.peers_say(0)  # the sibling's ended: the others' 2 stay until the next report
    assert (e.load.foreign_in_flight, e.load.fleet_in_flight) == (2, 3)
    e.load.engine_reported(3)  # ours 1 and the others' 2
    assert (e.load.foreign_in_flight, e.load.fleet_in_flight) == (2, 3)


def test_fresh_policies_start_their_turns_at_random() -> None:
    """Replicas placing at once must not all break their first ties alike (issue 14)."""
    catalog = Catalog(1, (handle("a"), handle("b"), handle("c")))
    for make in (RoundRobin, LeastLoaded,
                 lambda: KvAware(KvAwareKnobs(block_size=4))):
        firsts = set()
        for _ in range(60):  # an engine never first by chance: 3 × (2/3)**60
            placement = make().choose(catalog, VIEW)
            assert placement is not None
            firsts.add(placement.engine.name)
        assert firsts == {"a", "b", "c"}


def test_load_accounting_is_symmetric() -> None:
    h = handle("a")
    h.load.begin(100)
    h.load.begin(50)
    h.load.end(100)
    assert (h.load.in_flight, h.load.prompt_tokens_in_flight, h.load.requests_total) == (1, 50, 2)


def test_make_policy_names() -> None:
    assert make_policy(RoutingConfig(policy="round_robin")).name == "round_robin"
    assert make_policy(RoutingConfig(policy="least_loaded")).name == "least_loaded"
    assert make_policy(RoutingConfig(policy="kv_aware")).name == "kv_aware"


def test_prefill_or_decode_only_engines_never_take_whole_requests() -> None:
    prefill = handle("p")
    prefill.role = EngineRole.PREFILL
    decode = handle("d")
    decode.role = EngineRole.DECODE
    catalog = Catalog(1, (prefill, decode, handle("a")))
    for policy in (RoundRobin(), LeastLoaded()):
        picks = {p.engine.name for p in (policy.choose(catalog, VIEW) for _ in range(5)) if p}
        assert picks == {"a"}
    assert RoundRobin().choose(Catalog(1, (prefill, decode)), VIEW) is None


def test_placements_without_predictions_are_made_once_per_engine_and_catalog_version() -> None:
    a, b = handle("a"), handle("b")
    policy = RoundRobin(start=0)
    first = [policy.choose(Catalog(1, (a, b)), VIEW) for _ in range(4)]
    assert [p.engine.name for p in first if p] == ["a", "b", "a", "b"]
    assert first[0] is first[2] and first[1] is first[3]  # a lookup, not an allocation
    placement = first[0]
    assert placement is not None
    assert (placement.blocks, placement.predicted_cached_tokens, placement.spilled) == (
        (), None, False
    )
    again = policy.choose(Catalog(2, (a, b)), VIEW)  # a new catalog: fresh placements
    assert again is not None and again.engine is a and again is not placement
    least = LeastLoaded()
    assert least.choose(Catalog(1, (a,)), VIEW) is least.choose(Catalog(1, (a,)), VIEW)
