"""What sibling replicas report, as the policies read it (sans-IO)."""

from __future__ import annotations

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.schema import RoutingConfig
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.factory import make_policy
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.peers import (
    PeerLoads,
    PlacementShare,
    apply_peer_loads,
    local_loads,
)
from direct_frontend.routing.policies import LeastLoaded, RequestView

VIEW = RequestView((1, 2, 3), 16)


def handle(name: str, incarnation: int = 1) -> EngineHandle:
    return EngineHandle(name, "sglang", f"grpc://{name}:1", incarnation, EngineRole.BOTH,
                        EngineInfo("demo"), 4096, None)


def test_peer_reports_sum_by_engine_and_expire() -> None:
    peers = PeerLoads(timeout_s=3.0)
    assert peers.update("r1", 1, {"a": (2, frozenset({1, 2})), "b": (1, frozenset({4}))}, 0.0)
    assert peers.update("r2", 1, {"a": (1, frozenset({2, 3}))}, now=1.0)
    assert not peers.update("r1", 1, {"a": (9, frozenset())}, now=1.5)  # reordered: older
    # a prefix two replicas both have in flight holds its blocks once
    assert peers.totals() == {"a": (3, frozenset({1, 2, 3})), "b": (1, frozenset({4}))}
    assert peers.expire(now=3.5) == ["r1"]
    assert peers.totals() == {"a": (1, frozenset({2, 3}))}
    peers.leave("r2")
    assert peers.totals() == {} and len(peers) == 0


def test_peer_load_steers_least_loaded_as_one_router() -> None:
    a, b = handle("a"), handle("b")
    catalog = Catalog(1, (a, b))
    apply_peer_loads(catalog.engines, {"a": (2, frozenset())})
    assert (a.load.peer_in_flight, b.load.peer_in_flight) == (2, 0)
    picks = [LeastLoaded().choose(catalog, VIEW) for _ in range(2)]
    assert {p.engine.name for p in picks if p} == {"b"}
    apply_peer_loads(catalog.engines, {})
    assert a.load.peer_in_flight == 0


def test_a_siblings_requests_in_flight_weigh_in_the_kv_aware_cost() -> None:
    # the cost counts the fleet's requests in flight (ours and siblings'), not their blocks
    a, b = handle("a"), handle("b")
    catalog = Catalog(1, (a, b))
    policy = make_policy(RoutingConfig(policy="kv_aware"))
    apply_peer_loads(catalog.engines, {"b": (1, frozenset(range(1000, 1050)))})
    assert b.load.peer_blocks == 50
    request = RequestView(tuple(range(64)), 8)
    for _ in range(3):
        placement = policy.choose(catalog, request)
        assert placement is not None and placement.engine.name == "a"
    # the same prompt in flight on b from a sibling: its blocks are no extra load there
    hashes = frozenset(policy.hashes(request.input_ids))  # type: ignore[attr-defined]
    apply_peer_loads(catalog.engines, {"b": (1, hashes)})
    assert b.load.new_blocks(sorted(hashes)) == 0 and a.load.new_blocks(sorted(hashes)) == 4


def test_local_loads_sum_an_engines_incarnations() -> None:
    old, new = handle("a", 1), handle("a", 2)
    old.load.begin(10, [1, 2])
    new.load.begin(10, [3])
    assert local_loads([old, new]) == {"a": (2, frozenset({1, 2, 3}))}


def test_placements_go_out_and_peers_come_in_without_echo() -> None:
    share = PlacementShare(max_pending=2)
    approx = share.new_index(ttl_s=60, max_blocks=100)
    approx.record("a", [11, 12], now=0.0)
    share.from_peer("b", [21, 22], now=0.0)
    assert share.take() == [("a", (11, 12))]  # the peer's placement is not sent back
    assert approx.lookup_at([21, 22], now=1.0) == {"b": 2}
    for i in range(3):
        approx.record("a", [i], now=0.0)
    assert len(share.take()) == 2 and share.dropped == 1


def test_a_failed_send_is_put_back_before_newer_placements_and_the_oldest_drop_first() -> None:
    share = PlacementShare(max_pending=3)
    approx = share.new_index(ttl_s=60, max_blocks=100)
    approx.record("a", [1], now=0.0)
    approx.record("a", [2], now=0.0)
    failed = share.take()
    approx.record("a", [3], now=0.0)
    share.put_back(failed)
    assert share.take() == [("a", (1,)), ("a", (2,)), ("a", (3,))]
    for block in range(10, 14):
        approx.record("a", [block], now=0.0)
    assert share.take() == [("a", (11,)), ("a", (12,)), ("a", (13,))]  # the newest word kept
    assert share.dropped == 1


def test_every_live_policy_index_hears_a_peer() -> None:
    share = PlacementShare()
    one = share.new_index(ttl_s=60, max_blocks=100)
    two = share.new_index(ttl_s=60, max_blocks=100)  # a second model's policy
    share.from_peer("b", [5, 6], now=0.0)
    assert one.lookup_at([5, 6], now=1.0) == two.lookup_at([5, 6], now=1.0) == {"b": 2}


def test_a_kv_aware_policy_made_with_the_share_sends_its_placements_and_hears_its_peers() -> None:
    share = PlacementShare()
    policy = make_policy(RoutingConfig(policy="kv_aware", cold_prefix_home=True),
                         live={1, 2}, placements=share, diverged={2})
    assert isinstance(policy, KvAware) and policy.affinity is not None
    assert policy.uses_events == {1, 2} and policy.diverged == {2}
    policy.approx.record("a", [11, 12], now=0.0)
    share.from_peer("b", [21], now=0.0)
    assert share.take() == [("a", (11, 12))]
    assert policy.approx.lookup_at([21], now=1.0) == {"b": 1}
