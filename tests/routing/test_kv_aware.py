"""KV-aware selection, approximate mode and the hit-rate check (sans-IO)."""

from __future__ import annotations

import array
import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.load import FleetError, parse_fleet
from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.events import BlockStored
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.keys import index_key
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.routing.approx import ApproxPrefixIndex
from direct_frontend.routing.cache_affinity import CacheAffinity
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.factory import make_policy
from direct_frontend.routing.hitrate import HitRateMonitor
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import RequestView, RoundRobin

BS = 4


GENERATION = {"a": 1, "b": 2, "c": 3}


def handle(name: str, in_flight: int = 0) -> EngineHandle:
    h = EngineHandle(name, "vllm", f"grpc://{name}:1", GENERATION[name], EngineRole.BOTH,
                     EngineInfo("demo"), 4096, None)
    h.load.in_flight = in_flight
    return h


class FakeIndex:
    """Keys like the real index: one per incarnation and rank (``g<incarnation>r<rank>``)."""

    def __init__(self, held: dict[str, list[int]]) -> None:
        self.held = {f"g{GENERATION[e]}r0": set(hs) for e, hs in held.items()}

    def lookup_hashes(self, hashes: list[int]) -> dict[str, int]:
        out = {}
        for engine, held in self.held.items():
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                out[engine] = n
        return out


def view(ids: list[int]) -> RequestView:
    return RequestView(tuple(ids), 16)


PROMPT = list(range(100, 132))  # 8 blocks of 4
HASHES = prefix_hashes(PROMPT, BS)


def test_routes_to_the_engine_holding_the_longest_prefix() -> None:
    index = FakeIndex({"b": HASHES[:6], "c": HASHES[:2]})
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2, 3}
    catalog = Catalog(1, (handle("a"), handle("b"), handle("c")))
    chosen = policy.choose(catalog, view(PROMPT))
    assert chosen is not None and chosen.engine.name == "b"
    assert chosen.predicted_cached_tokens == 6 * BS  # the 6 leading blocks b holds


def test_decode_load_outweighs_a_small_overlap() -> None:
    index = FakeIndex({"b": HASHES[:1]})
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b", in_flight=3)))
    chosen = policy.choose(catalog, view(PROMPT))
    assert chosen is not None and chosen.engine.name == "a"


def test_load_guard_stops_herding_on_a_hot_prefix() -> None:
    index = FakeIndex({"b": HASHES})
    knobs = KvAwareKnobs(block_size=BS, balance_abs_threshold=2, balance_rel_threshold=1.5,
                    overlap_weight=100)
    policy = KvAware(knobs, index)
    policy.uses_events = {1, 2, 3}
    catalog = Catalog(1, (handle("a", 0), handle("b", 12), handle("c", 1)))
    chosen = policy.choose(catalog, view(PROMPT))
    assert chosen is not None and chosen.engine.name == "a"
    assert chosen.spilled


def test_the_load_guard_spills_to_a_second_home_of_the_prefix_not_the_idlest_engine() -> None:
    index = FakeIndex({"b": HASHES, "c": HASHES[:6]})
    knobs = KvAwareKnobs(block_size=BS, balance_abs_threshold=2, balance_rel_threshold=1.5,
                         overlap_weight=100, in_flight_weight=0)
    policy = KvAware(knobs, index)
    policy.uses_events = {1, 2, 3}
    # b holds the prefix and is far above the mean (5); c most of it; a is idle and cold
    catalog = Catalog(1, (handle("a", 0), handle("b", 12), handle("c", 3)))
    chosen = policy.choose(catalog, view(PROMPT))
    assert chosen is not None and chosen.engine.name == "c" and chosen.spilled


def test_a_prefill_backlog_moves_a_hot_prefix_to_a_second_engine() -> None:
    def spread(knobs: KvAwareKnobs, queue: list[int]) -> tuple[str, bool]:
        policy = KvAware(knobs, FakeIndex({"b": HASHES}), clock=lambda: 0.0)
        policy.uses_events = {1, 2, 3}
        # b holds the prefix and has 3 requests above the mean (2): under the usual line
        catalog = Catalog(1, (handle("a", 1), handle("b", 5), handle("c", 0)))
        calm = policy.choose(catalog, view(PROMPT))
        assert calm is not None and calm.engine.name == "b" and not calm.spilled
        for n, blocks in enumerate(queue):  # other prompts b has still to prefill
            policy.queue.add("b", [900 + n], blocks, 0.0)
        busy = policy.choose(catalog, view(PROMPT))
        assert busy is not None
        return busy.engine.name, busy.spilled

    knobs = KvAwareKnobs(block_size=BS, overlap_weight=100)
    # the cost still prefers b (its queue weighs less than prefilling the prefix elsewhere);
    # a backlog of requests lowers the guard's line, which moves this one to the cheapest
    # engine under it
    assert spread(knobs, [40, 40, 40]) == ("c", True)
    assert spread(knobs, [130]) == ("b", False)  # one long prompt is no burst
    assert spread(dataclasses.replace(knobs, balance_backlog_blocks=0), [40, 40, 40]) == (
        "b", False)


def test_ties_go_to_the_less_loaded_engine_and_exclusions_hold() -> None:
    policy = KvAware(KvAwareKnobs(block_size=BS), FakeIndex({}))
    catalog = Catalog(1, (handle("a", 2), handle("b", 1)))
    chosen = policy.choose(catalog, view([1, 2, 3]))
    assert chosen is not None and chosen.engine.name == "b"
    assert policy.choose(catalog, view(PROMPT), {"a", "b"}) is None


def test_temperature_samples_but_prefers_cheap_engines() -> None:
    index = FakeIndex({"b": HASHES})
    policy = KvAware(KvAwareKnobs(block_size=BS, temperature=0.5), index, rng=random.Random(3))
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b")))
    picks = [policy.choose(catalog, view(PROMPT)) for _ in range(300)]
    b = sum(1 for p in picks if p is not None and p.engine.name == "b")
    assert 180 < b < 300


def test_approximate_mode_remembers_where_prefixes_went_and_forgets_after_ttl() -> None:
    now = [1000.0]
    policy = KvAware(KvAwareKnobs(block_size=BS, approx_ttl_s=10), clock=lambda: now[0])
    catalog = Catalog(1, (handle("a"), handle("b"), handle("c")))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None
    for _ in range(5):
        again = policy.choose(catalog, view([*PROMPT, 7, 7, 7, 7]))
        assert again is not None and again.engine is first.engine  # the shared prefix sticks
    engines = catalog.engines
    assert policy.overlaps(HASHES, now[0], engines) == {first.engine.name: len(HASHES)}
    now[0] += 11
    assert policy.overlaps(HASHES, now[0], engines) == {}


def test_approx_index_cap_and_forget() -> None:
    approx = ApproxPrefixIndex(ttl_s=100, max_blocks=5)
    approx.record("a", HASHES, now=0)
    assert len(approx) == 5
    assert approx.lookup_at(HASHES, now=1) == {}  # the first blocks were evicted
    approx.record("b", HASHES[:3], now=0)
    assert approx.lookup_at(HASHES, now=1) == {"b": 3}
    approx.forget_engine("b")
    assert approx.lookup_at(HASHES, now=1) == {}


def kv_aware_fleet(knobs: str) -> str:
    return (
        '[frontend]\nserved_model_name = "x"\ntokenizer = "t"\nallow_empty_fleet = true\n'
        f'[frontend.routing]\npolicy = "kv_aware"\n[frontend.routing.knobs]\n{knobs}\n'
    )


def test_knobs_from_the_fleet_file() -> None:
    fleet = parse_fleet(kv_aware_fleet("block_size = 32\ntemperature = 0.2"), Path("f"))
    policy = make_policy(fleet.frontend.routing)
    assert isinstance(policy, KvAware)
    assert policy.knobs.block_size == 32 and policy.knobs.temperature == 0.2
    assert policy.knobs == KvAwareKnobs(block_size=32, temperature=0.2)
    with pytest.raises(FleetError, match="unknown"):
        parse_fleet(kv_aware_fleet("colour = 1"), Path("f"))


def test_hit_rate_monitor_warns_when_prediction_and_engines_diverge() -> None:
    monitor = HitRateMonitor(window=50, min_requests=10)
    for _ in range(20):
        assert monitor.record(64, 60) is None
    divergence = None
    for _ in range(40):
        divergence = monitor.record(64, 0)
    assert divergence is not None and "lost KV events" in divergence.message
    assert monitor.predicted_total == 60 * 64


def test_ranks_of_one_engine_combine_and_other_incarnations_do_not_count() -> None:
    class Ranked:
        def lookup_hashes(self, hashes: list[int]) -> dict[str, int]:
            return {"g2r0": 2, "g2r1": 5, "g9r0": 8}  # g9: a retired incarnation of "b"

    policy = KvAware(KvAwareKnobs(block_size=BS), Ranked())
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b")))
    assert policy.overlaps(HASHES, 0.0, catalog.engines) == {"b": 5}


def test_without_events_a_request_in_flight_weighs_as_much_as_with_them() -> None:
    """The approximate memory's engines pay the same ``in_flight_weight`` (4) per request in
    flight: b, remembered holding the prompt, saves (1 + 2) × 8 = 24 blocks, so it wins with 5
    in flight (20) and loses with 7 (28)."""
    policy = KvAware(KvAwareKnobs(block_size=BS))
    first = policy.choose(Catalog(1, (handle("a"), handle("b"))), view(PROMPT), exclude={"a"})
    assert first is not None and first.engine.name == "b"
    if first.prefilled is not None:
        first.prefilled()
    for in_flight, winner in ((5, "b"), (7, "a")):
        catalog = Catalog(1, (handle("a"), handle("b", in_flight=in_flight)))
        chosen = policy.choose(catalog, view(PROMPT))
        assert chosen is not None and chosen.engine.name == winner, in_flight


def test_blocks_shared_by_requests_in_flight_count_once() -> None:
    h = handle("a")
    h.load.begin(32, HASHES)
    h.load.begin(32, list(HASHES))  # an equal sequence, not the same one
    h.load.begin(32, HASHES[:3])
    assert h.load.active_set() == set(HASHES)
    assert h.load.new_blocks(HASHES) == 0 and h.load.new_blocks([1, 2]) == 2
    h.load.end(32, list(HASHES))
    h.load.end(32, HASHES[:3])
    assert h.load.active_set() == set(HASHES)  # one request still holds them
    h.load.end(32, HASHES)
    assert h.load.active_set() == frozenset() and not h.load.holding


def test_a_busy_engine_holding_the_prefix_wins_until_its_load_outweighs_the_saving() -> None:
    """8 cached blocks save (1 + 2) × 8 = 24 blocks of work; each request in flight costs 4.

    The fake index tells no occupancy, so both engines count as full (eviction term whole).
    """
    index = FakeIndex({"b": HASHES})
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2}
    for in_flight, winner in ((5, "b"), (7, "a")):
        catalog = Catalog(in_flight, (handle("a"), handle("b", in_flight=in_flight)))
        chosen = policy.choose(catalog, view(PROMPT))
        assert chosen is not None and chosen.engine.name == winner, in_flight
        if chosen.prefilled is not None:
            chosen.prefilled()  # its prefill done: the next request finds no queue


def test_a_placement_carries_the_blocks_and_never_predicts_the_last_prompt_token() -> None:
    index = FakeIndex({"a": HASHES})  # all 8 blocks of the 32-token prompt
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1}
    placement = policy.choose(Catalog(1, (handle("a"),)), view(PROMPT))
    assert placement is not None and placement.blocks == tuple(HASHES)
    # engines recompute the last prompt token: at most the 7 full blocks before it
    assert placement.predicted_cached_tokens == 7 * BS
    assert not placement.spilled
    none = policy.choose(Catalog(1, (handle("b"),)), view(PROMPT))
    assert none is not None and none.predicted_cached_tokens == 0


def test_on_complete_remembers_the_answer_only_where_no_kv_events_flow() -> None:
    answer = [9] * (8 * BS)  # (a memory block of 8 engine blocks: the answer is one)
    whole = prefix_hashes([*PROMPT, *answer], BS)
    policy = KvAware(KvAwareKnobs(block_size=BS))
    policy.uses_events = {2}  # b publishes KV events, a does not
    a, b = handle("a"), handle("b")
    for engine in (a, b):
        placement = policy.choose(Catalog(1, (engine,)), view(PROMPT))
        assert placement is not None
        policy.on_complete(placement, PROMPT, answer)
    assert policy.overlaps(whole, policy.clock(), (a, b)) == {"a": len(whole)}


@pytest.mark.parametrize("prompt_len", [3, 4, 17, 32])
def test_the_answer_is_hashed_on_from_the_prompt_exactly(prompt_len: int) -> None:
    """Prompt and answer hash as if hashed whole: the placed prompt itself, an equal copy,
    ids that go on from it (a continuation placed with part of its answer), and ids that
    do not begin with it (or images) alike."""
    def whole(ids: tuple[int, ...], block_size: int,
              media: Sequence[tuple[str, int, int]] = ()) -> tuple[int, ...]:
        return tuple(prefix_hashes(ids, block_size, media=media))

    rng = random.Random(prompt_len)
    prompt = tuple(rng.randrange(1000) for _ in range(prompt_len))
    policy = KvAware(KvAwareKnobs(block_size=BS))
    placement = policy.choose(Catalog(1, (handle("a"),)), RequestView(prompt, 16))
    assert placement is not None and placement.prompt is prompt
    for answer in [(), (5,), tuple(range(9)), tuple(range(2 * BS + 3))]:
        ids = prompt + answer
        assert policy.answered_hashes(placement, prompt, answer) == whole(ids, BS)
        assert policy.answered_hashes(placement, list(prompt), list(answer)) == whole(
            ids, BS)
        assert policy.answered_hashes(placement, prompt[:-1], prompt[-1:] + answer) == (
            whole(ids, BS))
        other = (prompt[0] + 1, *prompt[1:])
        assert policy.answered_hashes(placement, other, answer) == whole(
            other + answer, BS)
    shorter = prompt[:-1]
    assert policy.answered_hashes(placement, shorter, ()) == whole(shorter, BS)
    continued = policy.choose(Catalog(1, (handle("a"),)), RequestView((*prompt, 1, 2, 3), 16))
    assert continued is not None
    for answer in [(1, 2, 3), (1, 2, 3, *range(2 * BS))]:
        assert policy.answered_hashes(continued, prompt, answer) == whole(
            prompt + answer, BS)
    media = (("img", 0, 2),)
    pictured = policy.choose(Catalog(1, (handle("a"),)), RequestView(prompt, 16, None, media))
    assert pictured is not None
    pictured_ids = (*prompt, 1, 2, 3, 4)
    assert policy.answered_hashes(pictured, prompt, (1, 2, 3, 4)) == whole(
        pictured_ids, BS, media=media)


def test_a_queued_prefill_counts_until_its_first_token_whatever_the_events_show() -> None:
    """Engines announce a prompt's blocks when they admit it, before its prefill ends."""
    index = FakeIndex({"a": HASHES[:2]})
    policy = KvAware(KvAwareKnobs(block_size=BS, memory_weight=0, in_flight_weight=0), index)
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b")))
    a = catalog.engines[0]
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None and first.engine is a and first.prefilled is not None
    assert policy.queue.depth("a", 0.0, policy._stored_at(a)) == 6  # its 6 uncached blocks
    assert policy.queue.depths("a", 0.0, policy._stored_at(a)) == (6, 6)
    index.held["g1r0"] = set(HASHES)  # the events show it stored: admitted, still prefilling
    # queued still, but about to hold nothing beyond what the index shows (counted once)
    assert policy.queue.depths("a", 0.0, policy._stored_at(a)) == (6, 0)
    assert policy.queue.pending("a", HASHES, policy.clock()) == 0  # the index says it from here on
    first.prefilled()  # its first token
    assert policy.queue.depth("a", 0.0, policy._stored_at(a)) == 0


def test_the_memory_of_what_was_sent_steers_but_never_predicts() -> None:
    index = FakeIndex({})
    policy = KvAware(KvAwareKnobs(block_size=BS, in_flight_weight=0), index)
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b")))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None
    policy.on_complete(first, PROMPT, ())  # done, but its events have not arrived yet
    again = policy.choose(catalog, view([*PROMPT, 7, 7, 7, 7]))
    assert again is not None and again.engine is first.engine
    assert again.predicted_cached_tokens == 0  # the events show nothing cached there


def test_cache_affinity_follows_the_longest_prefix_until_the_gate() -> None:
    index = FakeIndex({"b": HASHES})
    policy = CacheAffinity(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2}
    busy = Catalog(1, (handle("a"), handle("b", in_flight=60)))
    chosen = policy.choose(busy, view(PROMPT))
    assert chosen is not None and chosen.engine.name == "b" and not chosen.spilled
    herded = Catalog(2, (handle("a", in_flight=1), handle("b", in_flight=70)))
    chosen = policy.choose(herded, view(PROMPT))
    assert chosen is not None and chosen.engine.name == "a" and chosen.spilled


def test_the_approximate_memory_models_an_engines_lru_when_its_capacity_is_known() -> None:
    memory = ApproxPrefixIndex(ttl_s=60, max_blocks=1000, capacity_blocks=10)
    old = prefix_hashes(list(range(100, 132)), BS)  # 8 blocks
    memory.record("a", old, 0.0)
    shared = prefix_hashes(list(range(300, 312)), BS)  # 3 blocks: 11 > 10
    memory.record("a", shared, 1.0)
    # the oldest block beyond the capacity is forgotten: the old prompt's tail, not its root
    assert memory.lookup_at(old, 2.0) == {"a": 7}
    memory.record("a", old[:2], 3.0)  # its root sent again: the most recent now
    memory.record("a", prefix_hashes(list(range(500, 504)), BS), 3.0)
    # its middle is the least recently sent: it goes next; the shared prompt stays
    assert memory.lookup_at(shared, 4.0) == {"a": 3} and memory.lookup_at(old, 4.0) == {"a": 6}
    unbounded = ApproxPrefixIndex(ttl_s=60, max_blocks=1000)
    unbounded.record("a", old, 0.0)
    unbounded.record("a", shared, 1.0)
    assert unbounded.lookup_at(old, 2.0) == {"a": 8}


def test_without_events_the_prediction_follows_the_lru_model_and_the_home_steers() -> None:
    knobs = KvAwareKnobs(block_size=BS, approx_capacity_blocks=8, in_flight_weight=0)
    policy = KvAware(knobs)
    catalog = Catalog(1, (handle("a"), handle("b")))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None
    policy.on_complete(first, PROMPT, ())
    other = list(range(700, 732))  # 8 more blocks there: the model says the first prompt is gone
    elsewhere = {e.name for e in catalog.engines} - {first.engine.name}
    placed = policy.choose(catalog, view(other), exclude=elsewhere)
    assert placed is not None and placed.engine is first.engine
    policy.on_complete(placed, other, ())
    again = policy.choose(catalog, view(PROMPT))
    assert again is not None and again.engine is first.engine  # its home steers …
    assert again.predicted_cached_tokens == 0  # … but it is predicted evicted there


def stored(index: KvIndex, engine: str, tokens: list[int]) -> None:
    """``engine``'s KV events: it stored these tokens' blocks."""
    hashes = prefix_hashes(tokens, BS)
    index.apply_events(index_key(GENERATION[engine], 0), (BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None,
        token_ids=array.array("I", tokens[: len(hashes) * BS]), block_size=BS),))


def test_a_new_prefix_goes_where_the_cache_has_room_even_if_a_little_busier() -> None:
    """a is full (40 of 40 blocks): storing 8 there costs (1 + 3) × 8 = 32; b, at 8 of 40,
    costs (1 + 3 × 0.2) × 8 = 12.8, plus 4 requests in flight × 4 = 28.8: still cheaper."""
    index = KvIndex(BS)
    stored(index, "a", list(range(1000, 1160)))  # 40 blocks
    policy = KvAware(KvAwareKnobs(block_size=BS, approx_capacity_blocks=40,
                                  eviction_weight=3), index)
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b", in_flight=4)))
    chosen = policy.choose(catalog, view(PROMPT))
    assert chosen is not None and chosen.engine.name == "b"
    without = KvAware(KvAwareKnobs(block_size=BS, approx_capacity_blocks=40,
                                   eviction_weight=0), index)
    without.uses_events = {1, 2}
    chosen = without.choose(catalog, view(PROMPT))  # no eviction term: the idler engine
    assert chosen is not None and chosen.engine.name == "a"


def test_fullness_counts_the_events_and_the_queue_against_the_capacity_or_the_fullest() -> None:
    index = KvIndex(BS)
    stored(index, "a", list(range(1000, 1080)))  # 20 blocks
    stored(index, "b", list(range(2000, 2040)))  # 10 blocks
    policy = KvAware(KvAwareKnobs(block_size=BS), index)  # no capacity configured
    policy.uses_events = {1, 2}
    engines = (handle("a"), handle("b"), handle("c"))
    # against the fullest engine seen (20); c sends no events: unknown, full
    assert policy.fullness(engines, 8, {"a": 8}, (0, 0, 0)) == {"a": 1.0, "b": 0.9, "c": 1.0}
    # b's queued prefill (2 blocks) is about to be held there too
    assert policy.fullness(engines, 8, {}, (0, 2, 0))["b"] == 1.0
    sized = KvAware(KvAwareKnobs(block_size=BS, approx_capacity_blocks=40), index)
    sized.uses_events = {1, 2}
    # told the capacity, c is the approximate memory's LRU model of it: empty so far
    assert sized.fullness(engines, 8, {}, (0, 0, 0)) == {"a": 0.7, "b": 0.45, "c": 0.2}


def sized(name: str, capacity_tokens: int | None) -> EngineHandle:
    """An engine whose discovery reported a KV cache of ``capacity_tokens``."""
    h = handle(name)
    return EngineHandle(h.name, h.kind, h.url, h.incarnation, h.role,
                        EngineInfo("demo", kv_capacity_tokens=capacity_tokens), 4096, None)


def test_an_engines_capacity_is_the_fleet_files_else_what_discovery_reported() -> None:
    reported = sized("a", 40 * BS)
    assert KvAware(KvAwareKnobs(block_size=BS)).capacity_of(reported) == 40
    assert KvAware(KvAwareKnobs(block_size=BS)).capacity_of(sized("b", None)) == 0
    told = KvAware(KvAwareKnobs(block_size=BS, approx_capacity_blocks=16))
    assert told.capacity_of(reported) == 16  # the file wins
    # events, and caches of different sizes: each engine's fullness against its own
    index = KvIndex(BS)
    stored(index, "a", list(range(1000, 1080)))  # 20 blocks of a's 40
    stored(index, "b", list(range(2000, 2080)))  # 20 blocks of b's 80
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2}
    engines = (sized("a", 40 * BS), sized("b", 80 * BS))
    assert policy.fullness(engines, 8, {}, (0, 0)) == {"a": 0.7, "b": 0.35}
    chosen = policy.choose(Catalog(1, engines), view(PROMPT))
    assert chosen is not None and chosen.engine.name == "b"  # a new prefix: where there is room


def test_a_tie_between_full_caches_goes_to_the_larger_every_time() -> None:
    index = KvIndex(BS)
    stored(index, "a", list(range(1000, 1160)))  # a full: 40 blocks of 40
    stored(index, "b", list(range(2000, 2320)))  # b full: 80 blocks of 80
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2}
    engines = (sized("a", 40 * BS), sized("b", 80 * BS))
    assert policy.fullness(engines, 8, {}, (0, 0)) == {"a": 1.0, "b": 1.0}  # the same price
    for n in range(4):  # not round robin: new prefixes, each costing the same on both
        prompt = [3000 + 100 * n + k for k in range(32)]
        chosen = policy.choose(Catalog(1, engines), view(prompt), exclude=())
        assert chosen is not None and chosen.engine.name == "b"
        assert chosen.prefilled is not None
        chosen.prefilled()  # its prefill is done: b's queue is empty again
    # equal caches: round robin as before
    even = (sized("a", 40 * BS), sized("b", 40 * BS))
    names = set()
    for n in range(2):
        chosen = policy.choose(Catalog(1, even), view([5000 + 100 * n + k for k in range(32)]))
        assert chosen is not None and chosen.prefilled is not None
        chosen.prefilled()
        names.add(chosen.engine.name)
    assert names == {"a", "b"}


def test_a_requests_prefill_leaves_the_queue_at_its_first_token() -> None:
    policy = KvAware(KvAwareKnobs(block_size=BS))  # no events: nothing else would tell
    catalog = Catalog(1, (handle("a"), handle("b")))
    placed = policy.choose(catalog, view(PROMPT), exclude={"b"})
    assert placed is not None and placed.prefilled is not None
    now = policy.clock()
    assert policy.queue.depth("a", now, None) == len(HASHES)  # all 8 blocks to prefill
    placed.prefilled()
    assert policy.queue.depth("a", now, None) == 0  # decoding now: its prefill is done
    policy.on_complete(placed, PROMPT, ())  # and its end changes nothing more
    assert policy.queue.depth("a", now, None) == 0
    again = policy.choose(catalog, view(PROMPT), exclude={"b"})
    assert again is not None and again.prefilled is None  # all cached there: nothing queued


def test_without_events_a_reported_capacity_turns_the_lru_model_on() -> None:
    policy = KvAware(KvAwareKnobs(block_size=BS, in_flight_weight=0))
    catalog = Catalog(1, (sized("a", 8 * BS), sized("b", None)))
    first = policy.choose(catalog, view(PROMPT), exclude={"b"})
    assert first is not None and first.engine.name == "a"
    assert policy.approx.capacities == {"a": 8} and policy.approx.held("b") is None
    policy.on_complete(first, PROMPT, ())
    other = list(range(700, 732))  # 8 more blocks there: the model says PROMPT is gone from a
    placed = policy.choose(catalog, view(other), exclude={"b"})
    assert placed is not None
    policy.on_complete(placed, other, ())
    again = policy.choose(catalog, view(PROMPT), exclude={"b"})
    assert again is not None and again.predicted_cached_tokens == 0


def test_without_events_fullness_follows_the_lru_model_when_the_capacity_is_known() -> None:
    policy = KvAware(KvAwareKnobs(block_size=BS, approx_capacity_blocks=16))
    catalog = Catalog(1, (handle("a"), handle("b")))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None
    home = first.engine.name
    fullness = policy.fullness(catalog.engines, 8, {home: 8}, (0, 0))
    assert fullness == {home: 0.5, ({"a", "b"} - {home}).pop(): 0.5}
    assert KvAware(KvAwareKnobs(block_size=BS)).fullness(catalog.engines, 8, {}, (0, 0)) == {
        "a": 1.0, "b": 1.0}  # no capacity, no model: counted full


# -- data-parallel ranks: each has a cache of its own, and a request is pinned to one --


def ranked(name: str, ranks: tuple[int, ...] = (0, 1), in_flight: dict[int, int] | None = None,
           ) -> EngineHandle:
    h = handle(name)
    ranked_handle = EngineHandle(h.name, h.kind, h.url, h.incarnation, h.role, h.info,
                                 h.context_length, None, dp_ranks=ranks)
    for rank, n in (in_flight or {}).items():
        for _ in range(n):
            ranked_handle.load.begin(0, (), rank)
    return ranked_handle


def stored_on(index: KvIndex, engine: str, position: int, tokens: list[int]) -> None:
    """Rank ``position`` of ``engine`` (its KV-event endpoint in the fleet file) stored these."""
    hashes = prefix_hashes(tokens, BS)
    index.apply_events(index_key(GENERATION[engine], position), (BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None,
        token_ids=array.array("I", tokens[: len(hashes) * BS]), block_size=BS),))


def test_a_request_is_pinned_to_the_rank_holding_its_prefix_and_predicted_from_that_rank() -> None:
    index = KvIndex(BS)
    stored_on(index, "a", 0, PROMPT[:8])  # 2 blocks on rank 0
    stored_on(index, "a", 1, PROMPT[:24])  # 6 blocks on rank 1
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1}
    placement = policy.choose(Catalog(1, (ranked("a"),)), view(PROMPT))
    assert placement is not None and placement.dp_rank == 1
    assert placement.predicted_cached_tokens == 24
    # a servicer of one node's ranks (2 and 3): the second endpoint is rank 3
    placement = policy.choose(Catalog(1, (ranked("a", (2, 3)),)), view(PROMPT))
    assert placement is not None and placement.dp_rank == 3


def test_a_new_prefix_goes_to_the_idler_rank_and_a_held_one_stays_until_its_rank_is_busy() -> None:
    index = KvIndex(BS)
    policy = KvAware(KvAwareKnobs(block_size=BS, approx_capacity_blocks=1000), index)
    policy.uses_events = {1}
    placement = policy.choose(Catalog(1, (ranked("a", in_flight={0: 1}),)), view(PROMPT))
    assert placement is not None and placement.dp_rank == 1  # nothing cached: the idler
    assert placement.predicted_cached_tokens == 0
    stored_on(index, "a", 0, PROMPT)  # 8 blocks on rank 0; the last is always recomputed
    # rank 1 would prefill all 8 blocks, at (1 + 2 × 8/1000) each (≈ 8.1), against 4 per
    # request in flight on rank 0: two there still cost less, three do not
    busy = {0: 2}
    placement = policy.choose(Catalog(1, (ranked("a", in_flight=busy),)), view(PROMPT))
    assert placement is not None and placement.dp_rank == 0
    placement = policy.choose(Catalog(1, (ranked("a", in_flight={0: 3}),)), view(PROMPT))
    assert placement is not None and placement.dp_rank == 1


def test_ranks_are_not_pinned_with_one_rank_or_by_policies_that_read_no_cache() -> None:
    index = KvIndex(BS)
    stored_on(index, "a", 0, PROMPT)
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1}
    one = policy.choose(Catalog(1, (ranked("a", (0,)),)), view(PROMPT))
    assert one is not None and one.dp_rank is None and one.predicted_cached_tokens == 28
    balanced = RoundRobin().choose(Catalog(1, (ranked("a"),)), view(PROMPT))
    assert balanced is not None and balanced.dp_rank is None


def test_without_events_the_approximate_memory_pins_and_models_each_rank() -> None:
    """What we sent rank 1 is remembered as rank 1's: its follow-up goes there, predicted so."""
    # (a memory block of one engine block: the answer's one block is remembered)
    policy = KvAware(KvAwareKnobs(block_size=BS, approx_capacity_blocks=1000,
                                  approx_unit_blocks=1))
    catalog = Catalog(1, (ranked("a", in_flight={0: 1}),))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None and first.dp_rank == 1 and first.predicted_cached_tokens == 0
    policy.on_complete(first, PROMPT, (7, 7, 7, 7))
    again = policy.choose(Catalog(1, (ranked("a"),)), view([*PROMPT, 7, 7, 7, 7, 1]))
    assert again is not None and again.dp_rank == 1 and again.predicted_cached_tokens == 36
    other = policy.choose(Catalog(1, (ranked("a"),)), view(list(range(500, 532))))
    assert other is not None and other.dp_rank == 0  # rank 1's cache is the fuller one
    assert policy.approx.held("a#dp1") == 9 and policy.approx.held("a#dp0") == 8


def test_cache_affinity_pins_the_longest_prefix_rank_whatever_its_load() -> None:
    index = KvIndex(BS)
    stored_on(index, "a", 0, PROMPT)
    policy = CacheAffinity(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1}
    placement = policy.choose(Catalog(1, (ranked("a", in_flight={0: 30}),)), view(PROMPT))
    assert placement is not None and placement.dp_rank == 0


def test_our_requests_in_flight_count_per_rank_until_they_end() -> None:
    h = ranked("a", in_flight={1: 2})
    assert h.load.rank_in_flight == {1: 2} and h.load.in_flight == 2
    h.load.end(0, (), 1)
    h.load.end(0, ())
    assert h.load.rank_in_flight == {1: 1} and h.load.in_flight == 0


def test_a_ranks_other_requests_come_from_the_engines_report_until_the_next() -> None:
    h = ranked("a", in_flight={0: 1})
    h.load.engine_reported(5, {0: 3, 1: 2})  # ours: one on rank 0
    assert (h.load.rank_load(0), h.load.rank_load(1)) == (3, 2)
    h.load.end(0, (), 0)
    assert (h.load.rank_load(0), h.load.rank_load(1)) == (2, 2)  # the others', as reported
    index = KvIndex(BS)
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1}
    h.load.engine_reported(2, {0: 2})
    placement = policy.choose(Catalog(1, (h,)), view(PROMPT))
    assert placement is not None and placement.dp_rank == 1  # rank 0 has two of others'
    h.load.engine_reported(None)
    assert h.load.rank_others == {}


@pytest.mark.parametrize("replaced", ["life", "incarnation"])
def test_a_restarted_engine_is_forgotten_whole(replaced: str) -> None:
    """A new process on the same address holds none of what we sent the old one.

    The KV index dropped the old process's blocks; the memory of placements
    and the prefill queue must go too: the blocks the first request stored
    there, which the events have not shown yet (pending, at ``memory_weight``:
    all 8), would still credit the engine with the prefix, and the request
    would miss there while the other engine holds half of it.
    """
    index = FakeIndex({})
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2, 4}
    a, b = handle("a"), handle("b")
    first = policy.choose(Catalog(1, (a, b)), view(PROMPT))
    assert first is not None and first.prefilled is not None
    first.prefilled()
    home = first.engine
    other = b if home is a else a
    queued = policy.choose(Catalog(1, (a, b)), view(list(range(500, 532))), {other.name})
    assert queued is not None and queued.engine is home
    assert policy.queue.depth(home.name, policy.clock(), None) == 8
    # the home restarts; the other engine caches the first half of the prompt meanwhile
    index.held = {f"g{other.incarnation}r0": set(HASHES[:4])}
    if replaced == "life":
        home.life = 1
        now = home
    else:
        now = EngineHandle(home.name, "vllm", home.url, 4, EngineRole.BOTH,
                           EngineInfo("demo"), 4096, None)
    again = policy.choose(Catalog(2, (now, other)), view([*PROMPT, 7, 7, 7, 7]))
    assert again is not None and again.engine is other
    assert policy.queue.pending(home.name, HASHES, policy.clock()) == 0
    assert policy.queue.depth(home.name, policy.clock(), None) == 0
    assert home.name not in policy.approx.lookup_at(HASHES, policy.clock())


def test_an_outgoing_incarnation_still_serving_is_no_restart() -> None:
    """While a replacement joins, the old incarnation of the name serves on: nothing forgotten."""
    policy = KvAware(KvAwareKnobs(block_size=BS))
    old = handle("a")
    new = EngineHandle("a", "vllm", "grpc://a:2", 7, EngineRole.BOTH, EngineInfo("demo"),
                       4096, None)
    policy.choose(Catalog(1, (new,)), view(PROMPT))
    assert policy.approx.lookup_at(HASHES, policy.clock()) == {"a": len(HASHES)}
    policy.choose(Catalog(2, (old, new)), view([*PROMPT, 1]))
    assert policy.approx.lookup_at(HASHES, policy.clock()) == {"a": len(HASHES)}


def test_without_events_a_queued_prefill_counts_in_depth_but_not_as_pending() -> None:
    """Pending blocks steer only engines whose events flow: without them nothing tallies them
    (the approximate memory already says where the prompt went)."""
    policy = KvAware(KvAwareKnobs(block_size=BS))
    catalog = Catalog(1, (handle("a"), handle("b")))
    placed = policy.choose(catalog, view(PROMPT))
    assert placed is not None and placed.prefilled is not None
    home = placed.engine.name
    assert policy.queue.depth(home, policy.clock(), None) == len(HASHES)
    assert policy.queue.pending(home, HASHES, policy.clock()) == 0
    assert policy.approx.lookup_at(HASHES, policy.clock()) == {home: len(HASHES)}


def test_a_burst_of_one_new_prefix_queues_behind_its_first_request() -> None:
    """The events show nothing before a prefill: what is pending there steers the followers."""
    index = FakeIndex({})
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2, 3}
    catalog = Catalog(1, (handle("a"), handle("b"), handle("c")))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None
    for tail in range(3):
        follower = policy.choose(catalog, view([*PROMPT, tail]))
        assert follower is not None and follower.engine is first.engine
        assert follower.predicted_cached_tokens == 0  # pending steers, never predicts
    home = first.engine.name
    index.held = {f"g{first.engine.incarnation}r0": set(HASHES)}  # the events show it now
    assert policy.queue.depth(home, policy.clock(), policy._stored_at(first.engine)) > 0
    assert policy.queue.pending(home, HASHES, policy.clock()) == 0  # the index says it from here on


def test_a_prefix_the_events_showed_and_then_evicted_is_not_credited() -> None:
    """Where a prefix was sent long ago says nothing once the engine's events show it gone."""
    index = FakeIndex({})
    policy = KvAware(KvAwareKnobs(block_size=BS), index)
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b")))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None and first.prefilled is not None
    first.prefilled()
    home, other = first.engine, ({"a", "b"} - {first.engine.name}).pop()
    index.held = {f"g{home.incarnation}r0": set(HASHES)}
    policy.on_complete(first, PROMPT, ())
    assert policy.queue.depth(home.name, policy.clock(), policy._stored_at(home)) == 0
    # evicted there since; the other engine caches half the prompt meanwhile
    index.held = {f"g{GENERATION[other]}r0": set(HASHES[:4])}
    again = policy.choose(catalog, view([*PROMPT, 7, 7, 7, 7]))
    assert again is not None and again.engine.name == other


@pytest.mark.parametrize(("after_s", "steered"), [(0.05, True), (1.0, False)])
def test_a_prefilled_prompt_the_events_never_showed_stops_steering_soon(
        after_s: float, steered: bool) -> None:
    """Past its first token, only the events' way to the index can hide a prompt's blocks.

    The engine could not store the prompt (its cache full of running
    requests' blocks) or evicted it before the index was read: its events
    never show it. Within a lag of the events it still steers a follower
    there (pending, at ``memory_weight``); a second later the follower goes
    where the events show half of it.
    """
    now = [0.0]
    index = FakeIndex({})
    policy = KvAware(KvAwareKnobs(block_size=BS), index, clock=lambda: now[0])
    policy.uses_events = {1, 2}
    catalog = Catalog(1, (handle("a"), handle("b")))
    first = policy.choose(catalog, view(PROMPT))
    assert first is not None and first.prefilled is not None
    home = first.engine
    other = ({"a", "b"} - {home.name}).pop()
    now[0] = 0.2
    first.prefilled()  # its first token; the events never show its blocks
    index.held = {f"g{GENERATION[other]}r0": set(HASHES[:4])}
    now[0] += after_s
    follower = policy.choose(catalog, view([*PROMPT, 7, 7, 7, 7]))
    assert follower is not None
    assert (follower.engine is home) is steered
    assert follower.predicted_cached_tokens == (0 if steered else 4 * BS)
