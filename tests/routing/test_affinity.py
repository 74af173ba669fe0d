"""Session affinity: rendezvous hashing over engine names, and its term of the cost (sans-IO)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.load import FleetError, parse_fleet
from direct_frontend.fleet.schema import KvAwareKnobs, SessionSource
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.routing.affinity import Affine, SessionAffinity, preferred, routing_key
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.factory import make_policy
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import LeastLoaded, RequestView, RoundRobin

KEYS = [f"session-{i}" for i in range(400)]
BS = 4


def handle(name: str, incarnation: int = 1, in_flight: int = 0) -> EngineHandle:
    h = EngineHandle(name, "vllm", f"grpc://{name}:1", incarnation, EngineRole.BOTH,
                     EngineInfo("demo"), 4096, None)
    h.load.in_flight = in_flight
    return h


def homes(keys: list[str], names: list[str]) -> dict[str, str]:
    engines = [handle(n) for n in names]
    out = {}
    for key in keys:
        home = preferred(key, engines)
        assert home is not None
        out[key] = home.name
    return out


def test_keys_spread_over_the_engines() -> None:
    counts = collections.Counter(homes(KEYS, ["a", "b", "c", "d"]).values())
    assert set(counts) == {"a", "b", "c", "d"}
    assert min(counts.values()) > len(KEYS) / 4 * 0.6


def test_an_engine_joining_takes_keys_only_for_itself() -> None:
    before = homes(KEYS, ["a", "b", "c"])
    after = homes(KEYS, ["a", "b", "c", "d"])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved, "the new engine won some keys"
    assert all(after[k] == "d" for k in moved)
    assert len(moved) < len(KEYS) / 2


def test_an_engine_leaving_moves_only_its_own_keys() -> None:
    before = homes(KEYS, ["a", "b", "c", "d"])
    after = homes(KEYS, ["a", "b", "d"])
    for key in KEYS:
        if before[key] != "c":
            assert after[key] == before[key]
        else:
            assert after[key] != "c"


def test_names_not_incarnations_or_order_decide() -> None:
    first = [handle("a", 1), handle("b", 2), handle("c", 3)]
    other = [handle("c", 9), handle("a", 7), handle("b", 8)]  # another replica's view
    for key in KEYS[:50]:
        one, two = preferred(key, first), preferred(key, other)
        assert one is not None and two is not None and one.name == two.name


def test_another_process_with_another_hash_seed_agrees() -> None:
    script = (
        "from direct_frontend.routing.affinity import score\n"
        "print([score(f'session-{i}', n) for i in range(20) for n in 'abcd'])\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout
    from direct_frontend.routing.affinity import score

    assert out.strip() == str([score(f"session-{i}", n) for i in range(20) for n in "abcd"])


def _sources(*texts: str) -> tuple[SessionSource, ...]:
    parsed = tuple(SessionSource.parse(text) for text in texts)
    assert None not in parsed
    return tuple(source for source in parsed if source is not None)


def test_routing_key_first_source_found_wins() -> None:
    headers = [(b"content-type", b"application/json"), (b"x-session-id", b"  s-42 ")]
    sources = _sources("header:X-Session-Id", "user")
    assert routing_key(sources, headers, "alice") == "s-42"
    assert routing_key(sources, [], "alice") == "alice"
    assert routing_key(_sources("user", "header:x-session-id"), headers, "alice") == "alice"
    assert routing_key(sources, [(b"x-session-id", b"  ")], None) is None
    assert routing_key((), headers, "alice") is None
    assert routing_key(_sources("user"), [], "x" * 1000) == "x" * 256
    cached = _sources("prompt_cache_key", "user")
    assert routing_key(cached, [], "alice", "thread-7") == "thread-7"
    assert routing_key(cached, [], "alice", None) == "alice"
    assert routing_key(_sources("prompt_cache_key"), headers, "alice") is None


def view(ids: list[int], key: str | None) -> RequestView:
    return RequestView(tuple(ids), 16, key)


PROMPT = list(range(100, 132))  # 8 blocks of 4


def keyed_kv_aware(weight: float) -> KvAware:
    return KvAware(KvAwareKnobs(block_size=BS), affinity=SessionAffinity(weight))


def test_kv_aware_sends_a_cold_session_to_its_home_on_every_replica() -> None:
    names = ["a", "b", "c", "d"]
    for key in KEYS[:40]:
        home = homes([key], names)[key]
        # two replicas, each with its own policy and catalog, no shared state
        for incarnation in (1, 5):
            catalog = Catalog(1, tuple(handle(n, incarnation + i) for i, n in enumerate(names)))
            placed = keyed_kv_aware(8).choose(catalog, view(PROMPT, key))
            assert placed is not None and placed.engine.name == home


class Holding:
    """A KV-event index in which one engine holds the whole prompt."""

    def __init__(self, incarnation: int, blocks: int) -> None:
        self.key, self.blocks = f"g{incarnation}r0", blocks

    def lookup_hashes(self, hashes: list[int]) -> dict[str, int]:
        return {self.key: min(self.blocks, len(hashes))}


def test_a_large_kv_overlap_outweighs_the_session_home() -> None:
    names = ["a", "b", "c"]
    key = next(k for k in KEYS if homes([k], names)[k] == "a")
    catalog = Catalog(1, tuple(handle(n, i + 1) for i, n in enumerate(names)))
    hashes = prefix_hashes(PROMPT, BS)
    for blocks, expected in ((len(hashes), "b"), (1, "a")):
        # b holds it; one cached block saves (1 + 2) blocks (the index tells no occupancy:
        # full) < 6
        policy = KvAware(KvAwareKnobs(block_size=BS), Holding(2, blocks), uses_events={1, 2, 3},
                         affinity=SessionAffinity(6))
        placed = policy.choose(catalog, view(PROMPT, key))
        assert placed is not None and placed.engine.name == expected, blocks


def test_an_unkeyed_request_is_placed_as_before() -> None:
    catalog = Catalog(1, (handle("a", in_flight=3), handle("b")))
    placed = keyed_kv_aware(100).choose(catalog, view(PROMPT, None))
    assert placed is not None and placed.engine.name == "b"


@pytest.mark.parametrize("inner", [RoundRobin, LeastLoaded])
def test_other_policies_send_a_keyed_request_home_and_skip_excluded(inner: type) -> None:
    names = ["a", "b", "c"]
    catalog = Catalog(1, tuple(handle(n, i + 1) for i, n in enumerate(names)))
    policy = Affine(inner())
    key = KEYS[7]
    home = homes([key], names)[key]
    for _ in range(5):
        placed = policy.choose(catalog, view(PROMPT, key))
        assert placed is not None and placed.engine.name == home
    retry = policy.choose(catalog, view(PROMPT, key), {home})
    assert retry is not None and retry.engine.name == homes([key], [n for n in names
                                                                    if n != home])[key]
    spread = {p.engine.name for p in (policy.choose(catalog, view(PROMPT, None))
                                      for _ in range(3)) if p is not None}
    assert spread == set(names)


def fleet(routing: str) -> str:
    return ('[frontend]\nserved_model_name = "x"\ntokenizer = "t"\nallow_empty_fleet = true\n'
            f"[frontend.routing]\n{routing}\n")


def test_fleet_file_session_key_builds_the_affinity() -> None:
    config = parse_fleet(fleet('policy = "kv_aware"\nsession_key = ["header:x-session-id"]\n'
                               "session_weight = 3"), Path("f.toml"))
    routing = config.frontend.routing
    assert routing.session_key == (SessionSource("header:x-session-id", None, "x-session-id"),)
    policy = make_policy(routing)
    assert isinstance(policy, KvAware) and policy.affinity is not None
    assert policy.affinity.weight == 3
    bare = make_policy(parse_fleet(fleet('session_key = ["user"]'), Path("f.toml"))
                       .frontend.routing)
    assert isinstance(bare, Affine) and bare.name == "round_robin"
    assert isinstance(make_policy(parse_fleet(fleet(""), Path("f.toml")).frontend.routing),
                      RoundRobin)


def test_fleet_file_refuses_an_unknown_session_key_source() -> None:
    with pytest.raises(FleetError) as caught:
        parse_fleet(fleet('session_key = ["cookie:sid", "header:"]'), Path("f.toml"))
    text = str(caught.value)
    assert "'cookie:sid' is neither 'user', 'prompt_cache_key' nor 'header:<name>'" in text
    assert "'header:' is neither" in text


def test_a_cold_prefix_goes_to_the_same_engine_on_every_replica() -> None:
    """Two replicas placing one new prefix at once, before either hears of the other."""
    names = ["a", "b", "c", "d"]
    for start in range(0, 400, 50):
        prompt = list(range(start, start + 32))
        chosen = set()
        for incarnation in (1, 5):
            policy = KvAware(KvAwareKnobs(block_size=BS),
                             affinity=SessionAffinity(8, sessions=False, cold_prefixes=True))
            catalog = Catalog(1, tuple(handle(n, incarnation + i) for i, n in enumerate(names)))
            placed = policy.choose(catalog, view(prompt, "ignored: sessions are off"))
            assert placed is not None
            chosen.add(placed.engine.name)
        assert len(chosen) == 1, start


def test_a_known_prefix_is_not_sent_to_its_cold_home() -> None:
    # (a memory block of one engine block: a longer prompt matches a 3-block prefix)
    policy = KvAware(KvAwareKnobs(block_size=BS, approx_unit_blocks=1),
                     affinity=SessionAffinity(8, sessions=False, cold_prefixes=True))
    catalog = Catalog(1, (handle("a", 1), handle("b", 2), handle("c", 3)))
    hashes = prefix_hashes(PROMPT, BS)
    home = preferred(f"prefix:{hashes[0]:x}", catalog.engines)
    assert home is not None
    holder = next(e.name for e in catalog.engines if e is not home)
    policy.approx.record(holder, hashes[:3], now=policy.clock())  # 3 blocks: less than 8
    placed = policy.choose(catalog, view(PROMPT, None))
    assert placed is not None and placed.engine.name == holder
