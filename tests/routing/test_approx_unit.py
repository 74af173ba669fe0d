"""The approximate memory at a unit of several engine blocks: conversions at its boundary."""

from __future__ import annotations

import itertools
import random

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.routing.approx import ApproxPrefixIndex, memory_keys
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import RequestView
from tests.routing.test_approx import lru_orders, oldest_first

BS = 4
PROMPT = list(range(100, 140))  # 10 blocks of 4
HASHES = prefix_hashes(PROMPT, BS)


def test_memory_keys_are_every_unit_th_hash_or_a_short_prompts_last() -> None:
    assert memory_keys(HASHES, 4) == [HASHES[3], HASHES[7]]
    assert memory_keys(HASHES[:8], 4) == [HASHES[3], HASHES[7]]
    assert memory_keys(HASHES[:3], 4) == [HASHES[2]]  # shorter than one memory block
    assert memory_keys(HASHES, 1) == HASHES
    assert memory_keys([], 4) == []


def test_lookups_answer_in_engine_blocks_to_the_unit() -> None:
    memory = ApproxPrefixIndex(60, 1000, unit=4)
    memory.record("a", HASHES, now=0)
    assert memory.lookup_at(HASHES, 1) == {"a": 8}  # to the unit: the last 2 are not kept
    assert len(memory) == 2
    other = prefix_hashes([*PROMPT[:36], 1, 2, 3, 4, 5, 6, 7, 8], BS)  # 9 blocks shared of 11
    assert memory.lookup_at(other, 1) == {"a": 8}  # to the unit: 2 memory blocks
    assert memory.lookup_at(HASHES[:3], 1) == {}  # a partial block matches only itself
    memory.record("b", HASHES[:3], now=0)
    assert memory.lookup_at(HASHES[:3], 1) == {"b": 3}  # a short prompt is remembered


def test_capacity_cap_and_held_counts_are_engine_blocks() -> None:
    memory = ApproxPrefixIndex(60, 1000, capacity_blocks=8, unit=4)
    memory.record("a", HASHES[:12], now=0)
    # 2 memory blocks fit; the root is touched last, so the prefix's first 8 blocks stay
    assert memory.held("a") == 8
    assert memory.lookup_at(HASHES, 1) == {"a": 8}
    capped = ApproxPrefixIndex(60, 8, unit=4)  # the cap: 8 engine blocks, 2 memory blocks
    capped.record("a", HASHES, now=0)
    assert len(capped) == 2


def handle(name: str, incarnation: int) -> EngineHandle:
    info = EngineInfo("demo", role=EngineRole.BOTH, kv_capacity_tokens=4096)
    return EngineHandle(name, "vllm", f"grpc://{name}:1", incarnation, EngineRole.BOTH, info,
                        4096, None)


def test_kv_aware_predicts_the_cached_tokens_in_engine_blocks() -> None:
    policy = KvAware(KvAwareKnobs(block_size=BS, approx_unit_blocks=4, in_flight_weight=0))
    catalog = Catalog(1, (handle("a", 1), handle("b", 2)))

    def place(ids: list[int], cached: int) -> str:
        placed = policy.choose(catalog, RequestView(tuple(ids), 8))
        assert placed is not None and placed.predicted_cached_tokens == cached
        assert len(placed.blocks) == len(ids) // BS  # the engine's own block hashes
        if placed.prefilled is not None:
            placed.prefilled()  # (its prefill done: no queue there)
        return placed.engine.name

    first = place(PROMPT, 0)
    # 4096 tokens of cache: 1024 blocks of 4, 256 memory blocks; 2 held: 8 engine blocks
    assert policy.approx.held(first) == 8
    assert place([*PROMPT, 1], 32) == first  # to the unit: 2 memory blocks of 4
    short = place(PROMPT[:12], 0)  # 3 blocks, less than a unit: its own key, not a prefix
    assert place([*PROMPT[:12], 1], 12) == short  # a short prompt is remembered whole


def test_an_answer_recorded_on_its_prompts_hashes_leaves_what_the_whole_leaves() -> None:
    """A prompt's placement extended by its answer's hashes alone (``record_answer``) leaves
    the memory as recording the joined whole with the prompt as its head does, at units of
    1 to 4 blocks, prompts and answers of any length against the unit, conversations
    building on their last turn, an answer to a prompt whose placement moved on, and
    capacities that evict."""
    for unit, capacity in itertools.product((1, 2, 4), (0, 24, 400)):
        rng = random.Random(unit * 1000 + capacity)
        whole = ApproxPrefixIndex(60, 500, capacity_blocks=capacity, unit=unit)
        split = ApproxPrefixIndex(60, 500, capacity_blocks=capacity, unit=unit)
        talks: list[list[int]] = [[] for _ in range(3)]
        now = 0.0
        for _ in range(150):
            now += 0.5
            engine = rng.choice("ab")
            talk = rng.randrange(3)
            ids = [*talks[talk], *(rng.randrange(10_000) for _ in range(rng.randint(0, 30)))]
            prompt = tuple(prefix_hashes(ids, BS))
            answer = [rng.randrange(10_000) for _ in range(rng.randint(0, 12))]
            answered = tuple(prefix_hashes([*ids, *answer], BS))
            more = answered[len(prompt):]
            for memory in (whole, split):
                memory.record(engine, prompt, now)
            if rng.random() < 0.2:  # another placement of the prompt on the other engine first
                other = "b" if engine == "a" else "a"
                for memory in (whole, split):
                    memory.record(other, prompt, now)
            whole.record(engine, answered, now, len(prompt))
            if prompt:
                split.record_answer(engine, prompt, more, now)
            else:
                split.record(engine, answered, now)
            # the next turn sends the answer again, or not (an agent's tool result follows the
            # prompt), or goes on from within the prompt
            talks[talk] = rng.choice([[*ids, *answer], [*ids, *answer], ids, ids[: len(ids) // 2]])
            assert oldest_first(split) == oldest_first(whole)
            assert lru_orders(split) == lru_orders(whole)
            assert {e: split.held(e) for e in "ab"} == {e: whole.held(e) for e in "ab"}
            assert split.lookup_at(answered, now) == whole.lookup_at(answered, now)
