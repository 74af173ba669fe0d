"""The approximate memory's bookkeeping, against a block-by-block reference (sans-IO)."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.routing.approx import ApproxPrefixIndex


class Reference:
    """The memory as one ordered-dict step per block: what the bulk steps must equal."""

    def __init__(self, ttl_s: float, max_blocks: int, capacity: int) -> None:
        self.ttl_s, self.max_blocks, self.capacity = ttl_s, max_blocks, capacity
        self.entries: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()
        self.lru: dict[str, collections.OrderedDict[int, None]] = {}

    def record(self, engine: str, hashes: list[int], now: float) -> None:
        for h in hashes:
            self.entries.setdefault(h, {})[engine] = now + self.ttl_s
            self.entries.move_to_end(h)
        while len(self.entries) > self.max_blocks:
            self.entries.popitem(last=False)
        if self.capacity:
            lru = self.lru.setdefault(engine, collections.OrderedDict())
            for h in reversed(hashes):
                lru[h] = None
                lru.move_to_end(h)
            while len(lru) > self.capacity:
                h = lru.popitem(last=False)[0]
                holders = self.entries.get(h)
                if holders is not None:
                    holders.pop(engine, None)
                    if not holders:
                        del self.entries[h]

    def forget(self, engine: str) -> None:
        self.lru.pop(engine, None)
        for holders in self.entries.values():
            holders.pop(engine, None)

    def lookup(self, hashes: list[int], now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for engine in {e for holders in self.entries.values() for e in holders}:
            depth = 0
            for h in hashes:
                if self.entries.get(h, {}).get(engine, -1.0) <= now:
                    break
                depth += 1
            if depth:
                out[engine] = depth
        return out


chains = st.lists(st.integers(0, 30), min_size=0, max_size=12)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from("abc"), chains, st.integers(0, 3)),
                      max_size=25),
       max_blocks=st.integers(1, 40), capacity=st.sampled_from([0, 3, 10]),
       seed=st.integers(0, 1000))
def test_bulk_record_and_lookup_equal_the_block_by_block_reference(
        steps: list[tuple[str, list[int], int]], max_blocks: int, capacity: int,
        seed: int) -> None:
    """Known and new blocks mixed, blocks several engines hold, repeated hashes, the cap,
    the LRU model and forgotten engines: same order, same holders and expiries, same lookups."""
    memory = ApproxPrefixIndex(ttl_s=2.0, max_blocks=max_blocks, capacity_blocks=capacity)
    reference = Reference(2.0, max_blocks, capacity)
    rng = random.Random(seed)
    now = 0.0
    for engine, hashes, advance in steps:
        now += advance
        if advance == 3 and not hashes:  # now and then an engine is forgotten
            memory.forget_engine(engine)
            reference.forget(engine)
        memory.record(engine, hashes, now)
        reference.record(engine, hashes, now)
        assert memory.blocks_oldest_first() == list(reference.entries.items())
        assert memory.lru_orders() == {
            e: list(lru) for e, lru in reference.lru.items()}
        probe = [*hashes[: rng.randint(0, len(hashes))], rng.randint(0, 30)]
        for at in (now, now + 1.5, now + 2.5):
            assert memory.lookup_at(probe, at) == reference.lookup(probe, at)


fresh_chains = st.lists(st.integers(0, 200), min_size=0, max_size=12, unique=True)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from("ab"), fresh_chains, st.integers(0, 3),
                                st.booleans(), st.integers(0, 12)), max_size=30),
       max_blocks=st.integers(1, 60), capacity=st.sampled_from([0, 4, 12, 100]),
       seed=st.integers(0, 1000))
def test_a_placement_extended_by_its_answer_equals_the_reference(
        steps: list[tuple[str, list[int], int, bool, int]], max_blocks: int, capacity: int,
        seed: int) -> None:
    """A prompt recorded again with its answer (``head``: the prompt's blocks) extends its
    placement where that is exact; any hint, right or wrong, leaves what the reference
    leaves (a shared root among the blocks too), and each placement's count of blocks it
    alone holds stays true."""
    memory = ApproxPrefixIndex(ttl_s=2.0, max_blocks=max_blocks, capacity_blocks=capacity)
    reference = Reference(2.0, max_blocks, capacity)
    rng = random.Random(seed)
    now = 0.0
    last: dict[str, list[int]] = {}
    for engine, more, advance, extend, hint in steps:
        now += advance
        if advance == 3 and not more and not extend:
            memory.forget_engine(engine)
            reference.forget(engine)
        prompt = last.get(engine, [])
        if not extend and hint % 2 and 999 not in more:  # a root every engine shares
            more = [999, *more]
        hashes = [*prompt, *more] if extend else more
        head = len(prompt) if extend else min(hint, len(hashes))
        memory.record(engine, hashes, now, head)
        reference.record(engine, hashes, now)
        last[engine] = hashes
        assert memory.blocks_oldest_first() == list(reference.entries.items())
        assert memory.lru_orders() == {
            e: list(lru) for e, lru in reference.lru.items()}
        alone = collections.Counter(id(held) for held in memory._blocks.values())
        for placed, _ in memory._ages.current():
            assert placed.sole == alone[id(placed)]
        probe = [*hashes[: rng.randint(0, len(hashes))], rng.randint(0, 200)]
        for at in (now, now + 1.5, now + 2.5):
            assert memory.lookup_at(probe, at) == reference.lookup(probe, at)


def play_against_the_reference(memory: ApproxPrefixIndex, reference: Reference,
                               rng: random.Random, steps: int, pool: int, sizes: tuple[int, int],
                               forget: float = 0.0) -> None:
    """Place ``steps`` prompts of ``sizes`` blocks drawn from ``pool`` on a shared root, each
    extended by its answer, now and then forgetting an engine (``forget``: the chance per
    step); every so often the memory equals the block-by-block reference."""
    now = 0.0
    for step in range(steps):
        now += rng.random()
        engine = rng.choice("abc")
        if rng.random() < forget:
            memory.forget_engine(engine)
            reference.forget(engine)
        prompt = [pool + 1, *rng.sample(range(pool), rng.randint(*sizes))]
        memory.record(engine, prompt, now)
        reference.record(engine, prompt, now)
        answered = [*prompt, pool + 2 + step]
        memory.record(engine, answered, now + 0.5, len(prompt))
        reference.record(engine, answered, now + 0.5)
        if step % 100 == 0 or step == steps - 1:
            assert memory.blocks_oldest_first() == list(reference.entries.items())
            assert memory.lru_orders() == {
                e: list(lru) for e, lru in reference.lru.items()}
            for at in (now, now + 40, now + 60):
                assert memory.lookup_at(answered, at) == reference.lookup(answered, at)


@pytest.mark.parametrize(("max_blocks", "capacity", "pool"), [
    (1 << 20, 40, 3000),  # the LRU models forget; the age order's lists are filtered
    (1 << 20, 0, 600),  # no LRU: the same blocks placed again and again, filtered
    (300, 60, 3000),  # the cap forgets what the LRU models still hold
    (1 << 20, 5000, 300),  # the LRU models never full: their lists are filtered
])
def test_a_long_run_with_filtered_orders_equals_the_reference(
        max_blocks: int, capacity: int, pool: int) -> None:
    """Thousands of placements, prompts sharing a root and extended by their answers, some
    engines forgotten: the orders' lists are filtered many times over, and the memory
    still equals the block-by-block reference."""
    rng = random.Random(max_blocks + capacity + pool)
    play_against_the_reference(
        ApproxPrefixIndex(ttl_s=50.0, max_blocks=max_blocks, capacity_blocks=capacity),
        Reference(50.0, max_blocks, capacity), rng, 3000, pool, (1, 14), forget=0.002)


@pytest.mark.parametrize(("max_blocks", "capacity"), [(1 << 20, 150), (1 << 20, 0), (400, 150)])
def test_long_prompts_placed_in_bulk_equal_the_reference(max_blocks: int, capacity: int) -> None:
    """Prompts of 16 to 40 blocks (placed in bulk steps, where short ones go block by block),
    sharing a root and other engines' blocks, extended by their answers: the memory equals
    the block-by-block reference."""
    rng = random.Random(max_blocks + capacity)
    play_against_the_reference(
        ApproxPrefixIndex(ttl_s=50.0, max_blocks=max_blocks, capacity_blocks=capacity),
        Reference(50.0, max_blocks, capacity), rng, 600, 999, (15, 39))
