"""The approximate memory at units over one block, routed as kv_aware routes (a
lookup, the placement's record, its answer's record), against the block-by-block reference
fed the memory's keys (sans-IO)."""

from __future__ import annotations

import itertools
import random

import pytest

from direct_frontend.routing.approx import ApproxPrefixIndex, memory_keys
from tests.routing.test_approx import Reference, lru_orders, oldest_first


def scaled(found: dict[str, int], unit: int, whole: int) -> dict[str, int]:
    return {e: min(d * unit, whole) for e, d in found.items()}


@pytest.mark.parametrize("unit", [2, 4])
@pytest.mark.parametrize(("max_blocks", "capacity"), [(1 << 20, 0), (1 << 20, 30), (60, 20)])
def test_routed_turns_at_a_unit_equal_the_reference_of_their_keys(
        unit: int, max_blocks: int, capacity: int) -> None:
    for seed in range(20):
        rng = random.Random(seed * 7 + unit)
        memory = ApproxPrefixIndex(50.0, max_blocks * unit, capacity_blocks=capacity * unit,
                                   unit=unit)
        reference = Reference(50.0, max_blocks, capacity)
        fresh = itertools.count(1000)
        talks: list[tuple[int, ...]] = [() for _ in range(3)]
        now = 0.0
        for step in range(150):
            now += rng.random() * 3
            engine = rng.choice("ab")
            t = rng.randrange(3)
            if rng.random() < 0.03:
                memory.forget_engine(engine)
                reference.forget(engine)
            prompt = (*talks[t], *(next(fresh) for _ in range(rng.randint(0, 3 * unit))))
            if not prompt:
                continue
            keys = list(memory_keys(prompt, unit))
            assert memory.lookup_at(prompt, now) == scaled(
                reference.lookup(keys, now), unit, len(prompt)), (seed, step)
            memory.record(engine, prompt, now)
            reference.record(engine, keys, now)
            more = tuple(next(fresh) for _ in range(rng.choice([0, 1, 2, 3, 5, 9])))
            memory.record_answer(engine, prompt, more, now)
            reference.record(engine, list(memory_keys((*prompt, *more), unit)), now)
            talks[t] = rng.choice([(*prompt, *more), (*prompt, *more), prompt,
                                   prompt[: len(prompt) // 2]])
            assert oldest_first(memory) == list(reference.entries.items()), (seed, step)
            assert lru_orders(memory) == {e: list(lru) for e, lru in reference.lru.items()}
            for probe in (*talks, (*prompt, *more)):
                if probe:
                    assert memory.lookup_at(probe, now) == scaled(
                        reference.lookup(list(memory_keys(probe, unit)), now), unit,
                        len(probe)), (seed, step, probe)


@pytest.mark.parametrize("replicas", [False, True])
def test_no_placement_keeps_its_engine_block_hashes_once_its_answer_is_recorded(
        replicas: bool) -> None:
    """``Placed.origin`` serves one thing: the answer's record (``record_answer``) of the
    prompt it was routed with. Once that answer is recorded no placement should hold the
    engine-block hashes (``unit`` times its keys): they are outside ``approx_max_blocks``."""
    unit = 4
    memory = ApproxPrefixIndex(50.0, 1 << 20, capacity_blocks=0, unit=unit,
                               on_record=(lambda engine, hashes: None) if replicas else None)
    fresh = itertools.count(1000)
    talk: tuple[int, ...] = ()
    for turn in range(5):
        prompt = (*talk, *(next(fresh) for _ in range(100)))
        memory.lookup_at(prompt, float(turn))
        memory.record("a", prompt, float(turn))
        more = tuple(next(fresh) for _ in range(10))
        memory.record_answer("a", prompt, more, float(turn))
        talk = (*prompt, *more)
        kept = [len(p.origin) for p in set(memory._blocks.values())  # type: ignore[union-attr]
                if getattr(p, "origin", None) is not None]
        assert kept == [], (turn, kept)
