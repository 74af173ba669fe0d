"""The approximate memory's bookkeeping, against a block-by-block reference (sans-IO)."""

from __future__ import annotations

import collections
import itertools
import math
import random
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.routing.approx import ApproxPrefixIndex
from direct_frontend.routing.placed import FEW, Placed, claim, placements


def oldest_first(memory: ApproxPrefixIndex) -> list[tuple[int, dict[str, float]]]:
    """Each block, oldest first, with its holders as {engine: expiry} (forgotten engines
    left out): a walk of the age order's placements, each keeping the blocks still its."""
    blocks = memory._blocks
    return [(h, {p.engine: p.expiry for p in placements(blocks[h]) if p.expiry > -math.inf})
            for placed, listed in memory._ages.current()
            for h in memory._age_still(list(listed), placed)]


def lru_orders(memory: ApproxPrefixIndex) -> dict[str, list[int]]:
    """Each LRU model's blocks, least recently touched first (a walk of its placements)."""
    return {e: [h for placed, listed in lru.book.current() for h in lru.still(list(listed), placed)]
            for e, lru in memory._lrus.items()}


def assert_orphans_held(memory: ApproxPrefixIndex) -> None:
    """Each orphan is claimed only by engines whose LRU model still holds it."""
    orders = {e: set(order) for e, order in lru_orders(memory).items()}
    for h, orphan in memory._orphans.items():
        assert all(h in orders.get(p.engine, ()) for p in placements(orphan))


def live_placements(memory: ApproxPrefixIndex) -> Iterator[Placed]:
    """Each placement the memory still reaches: its blocks', its orphans', its books'."""
    seen: dict[int, Placed] = {}
    for holders in [*memory._blocks.values(), *memory._orphans.values()]:
        seen.update((id(p), p) for p in placements(holders))
    for book in [memory._ages, *(lru.book for lru in memory._lrus.values())]:
        seen.update((id(p), p) for p, _, _ in book.entries)
    return iter(seen.values())


class Reference:
    """The memory as one ordered-dict step per block: what the bulk steps must equal."""

    def __init__(self, ttl_s: float, max_blocks: int, capacity: int) -> None:
        self.ttl_s, self.max_blocks, self.capacity = ttl_s, max_blocks, capacity
        self.capacities: dict[str, int] = {}
        self.entries: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()
        self.lru: dict[str, collections.OrderedDict[int, None]] = {}

    def record(self, engine: str, hashes: list[int], now: float) -> None:
        for h in hashes:
            self.entries.setdefault(h, {})[engine] = now + self.ttl_s
            self.entries.move_to_end(h)
        while len(self.entries) > self.max_blocks:
            self.entries.popitem(last=False)
        capacity = self.capacities.get(engine) or self.capacity
        if not capacity:  # (an engine whose size is unknown again: its LRU model let go of)
            self.lru.pop(engine, None)
        else:
            lru = self.lru.setdefault(engine, collections.OrderedDict())
            for h in reversed(hashes):
                lru[h] = None
                lru.move_to_end(h)
            while len(lru) > capacity:
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


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from("abc"), chains, st.integers(0, 3),
                                st.sampled_from([None, None, None, 0, 2, 5, 40]),
                                st.booleans()), max_size=25),
       max_blocks=st.integers(1, 40), capacity=st.sampled_from([0, 3, 10]),
       seed=st.integers(0, 1000))
def test_bulk_record_and_lookup_equal_the_block_by_block_reference(
        steps: list[tuple[str, list[int], int, int | None, bool]], max_blocks: int,
        capacity: int, seed: int) -> None:
    """Known and new blocks mixed, blocks several engines hold, repeated hashes, the cap,
    the LRU model, an engine's own capacity set, shrunk or unknown again (an empty record
    too), a peer's placements and forgotten engines: same order, same holders and expiries,
    same LRU orders and counts, same lookups."""
    memory = ApproxPrefixIndex(ttl_s=2.0, max_blocks=max_blocks, capacity_blocks=capacity)
    reference = Reference(2.0, max_blocks, capacity)
    rng = random.Random(seed)
    now = 0.0
    for engine, hashes, advance, size, peer in steps:
        now += advance
        if advance == 3 and not hashes:  # now and then an engine is forgotten
            memory.forget_engine(engine)
            reference.forget(engine)
        if size is not None:  # its own size as discovery tells it (0: unknown again)
            memory.capacities[engine] = reference.capacities[engine] = size
        (memory.record_peer if peer else memory.record)(engine, hashes, now)
        reference.record(engine, hashes, now)
        assert oldest_first(memory) == list(reference.entries.items())
        assert lru_orders(memory) == {e: list(lru) for e, lru in reference.lru.items()}
        assert_orphans_held(memory)
        for e in "abc":
            size = reference.capacities.get(e) or capacity
            assert memory.held(e) == (len(reference.lru.get(e, ())) if size else None)
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
        assert oldest_first(memory) == list(reference.entries.items())
        assert lru_orders(memory) == {
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
            assert oldest_first(memory) == list(reference.entries.items())
            assert lru_orders(memory) == {
                e: list(lru) for e, lru in reference.lru.items()}
            assert {e: memory.held(e) for e in reference.lru} == {
                e: len(lru) for e, lru in reference.lru.items()}
            assert_orphans_held(memory)
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


@pytest.mark.parametrize(("max_blocks", "capacity"), [
    (1 << 20, 120), (150, 120), (1 << 20, 0), (60, 30), (150, 80)])
def test_conversations_and_prompts_on_shared_heads_equal_the_reference(
        max_blocks: int, capacity: int) -> None:
    """Conversations growing turn by turn (their blocks known up to a tail of new ones) and
    new prompts after a head of one or three shared blocks, some repeating blocks, on three
    engines, each extended by its answer and placed in bulk, the LRU models letting go across
    placements, the cap leaving orphans, now and then an engine forgotten: the memory equals
    the block-by-block reference at every step."""
    rng = random.Random(max_blocks + capacity)
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=max_blocks, capacity_blocks=capacity)
    reference = Reference(50.0, max_blocks, capacity)
    fresh = itertools.count(1000)
    heads = [[next(fresh) for _ in range(n)] for n in (1, 3)]
    talks = [[next(fresh) for _ in range(16)] for _ in range(4)]
    now = 0.0
    for _ in range(120):
        now += rng.random()
        engine = rng.choice("abc")
        talk = rng.randrange(len(talks))
        kind = rng.random()
        if kind < 0.02:
            memory.forget_engine(engine)
            reference.forget(engine)
        if kind < 0.5:
            talks[talk] += [next(fresh) for _ in range(rng.randint(0, 12))]
            prompt = list(talks[talk])
        elif kind < 0.9:
            prompt = [*rng.choice(heads), *(next(fresh) for _ in range(rng.randint(14, 40)))]
        else:  # some blocks repeated
            prompt = [*talks[talk], *talks[talk][:rng.randint(1, 5)], next(fresh)]
        memory.record(engine, prompt, now)
        reference.record(engine, prompt, now)
        answered = [*prompt, next(fresh)]
        memory.record(engine, answered, now, len(prompt))
        reference.record(engine, answered, now)
        if prompt[0] == talks[talk][0]:
            talks[talk] = answered
        assert oldest_first(memory) == list(reference.entries.items())
        assert lru_orders(memory) == {e: list(lru) for e, lru in reference.lru.items()}
        assert {e: memory.held(e) for e in reference.lru} == {
            e: len(lru) for e, lru in reference.lru.items()}
        assert_orphans_held(memory)
        for probe in (answered, talks[0], [*heads[1], 5]):
            assert memory.lookup_at(probe, now) == reference.lookup(probe, now)


@pytest.mark.parametrize("seed", [9, 92, 5])
def test_random_traces_of_long_placements_equal_the_reference(seed: int) -> None:
    """Random traces of placements up to ~80 blocks (prompts after a shared head, growing
    conversations, answers extending the last placement, repeated blocks, forgotten engines)
    under a random capacity and cap: every lookup equals the block-by-block reference's."""
    rng = random.Random(seed)
    capacity, max_blocks = rng.choice([0, 30, 80, 200]), rng.choice([60, 150, 10_000])
    memory = ApproxPrefixIndex(ttl_s=5.0, max_blocks=max_blocks, capacity_blocks=capacity)
    reference = Reference(5.0, max_blocks, capacity)
    talks = [[rng.getrandbits(64) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    heads = [[rng.getrandbits(64) for _ in range(rng.randint(1, 3))] for _ in range(2)]
    now = 0.0
    last: dict[str, list[int]] = {}
    for _ in range(300):
        now += rng.random() * 0.2
        engine, kind, head = rng.choice("abc"), rng.random(), 0
        if kind < 0.35:
            hashes = rng.choice(heads) + [rng.getrandbits(64) for _ in range(rng.randint(0, 40))]
        elif kind < 0.6:
            at = rng.randrange(len(talks))
            talks[at] = talks[at] + [rng.getrandbits(64) for _ in range(rng.randint(0, 20))]
            hashes = list(talks[at])
        elif kind < 0.8 and last:
            engine, before = rng.choice(list(last.items()))
            hashes = before + [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
            head = len(before)
        elif kind < 0.85:
            memory.forget_engine(engine)
            reference.forget(engine)
            continue
        else:
            talk = rng.choice(talks)
            hashes = talk + talk[:rng.randint(0, 5)] + [
                rng.getrandbits(64) for _ in range(rng.randint(0, 30))]
        memory.record(engine, hashes, now, head)
        reference.record(engine, hashes, now)
        last[engine] = hashes
        for probe in [*talks, *heads, hashes, hashes[:len(hashes) // 2]]:
            assert memory.lookup_at(probe, now) == reference.lookup(probe, now)


def test_the_cap_leaves_orphans_an_lru_model_lets_go_of_in_bulk() -> None:
    """The cap below what the LRU models hold: blocks it forgets stay in the models
    (orphans) until they fall out of them, then are let go of as a whole placement's, and
    placed again they count in the model anew."""
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=40, capacity_blocks=60)
    reference = Reference(50.0, 40, 60)
    prompts = [list(range(n * 20, n * 20 + 20)) for n in range(8)]
    steps = [("a", prompt) for prompt in prompts] + [("a", prompts[0]), ("a", prompts[1]),
                                                     ("b", prompts[2])]
    for now, (engine, prompt) in enumerate(steps):
        memory.record(engine, prompt, now)
        reference.record(engine, prompt, now)
        assert oldest_first(memory) == list(reference.entries.items())
        assert lru_orders(memory) == {e: list(lru) for e, lru in reference.lru.items()}
        assert memory.held(engine) == len(reference.lru[engine])
        assert_orphans_held(memory)
    assert memory._orphans


def test_an_extension_over_a_block_its_engine_holds_as_an_orphan() -> None:
    """A prompt's first block is forgotten by the cap while its engine's LRU model still holds
    it, then placed by other engines (a new Joint; the prompt's other blocks are Joints too):
    the prompt recorded again extends its placement, and the block counts in the model once,
    as the reference says."""
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=20, capacity_blocks=12)
    reference = Reference(50.0, 20, 12)
    long = [37, 9, 18, 4, 27, 12, 10, 20, 1, 3, 22, 13, 6, 23, 11, 26, 8, 21, 17, 24, 0]
    steps = [("b", [37, 22, 23], 0), ("c", long, 0), ("c", [37], 0), ("d", [37], 0),
             ("b", [37, 22, 23], 3)]
    for now, (engine, hashes, head) in enumerate(steps):
        memory.record(engine, hashes, now, head)
        reference.record(engine, hashes, now)
        assert oldest_first(memory) == list(reference.entries.items())
        assert lru_orders(memory) == {e: list(lru) for e, lru in reference.lru.items()}
        assert {e: memory.held(e) for e in "bcd"} == {
            e: len(reference.lru.get(e, ())) for e in "bcd"}
        if now == 0:
            first = memory._blocks[37]
    assert claim(memory._blocks[37], "b") is first  # (extended, not placed anew)


def test_an_empty_record_settles_a_shrunk_capacity() -> None:
    """An engine's size shrinks between placements: its next record, empty or not, forgets
    its least recently sent blocks down to the new size."""
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=100, capacity_blocks=0)
    memory.capacities["a"] = 10
    memory.record("a", [1, 2, 3, 4], 0.0)
    memory.capacities["a"] = 3
    memory.record("a", [], 1.0)
    assert memory.held("a") == 3
    assert memory.lookup_at([1, 2, 3, 4], 1.0) == {"a": 3}


@pytest.mark.parametrize("size", [3, FEW + 5])
@pytest.mark.parametrize("capacity", [0, 100])
def test_an_answer_extends_its_prompts_placement(size: int, capacity: int) -> None:
    """A prompt recorded, then its prompt + answer with the prompt's blocks as ``head``: the
    one placement is extended (every block points at it), not a second one made."""
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=1000, capacity_blocks=capacity)
    prompt = list(range(size))
    memory.record("a", prompt, 0.0)
    placed = memory._blocks[0]
    memory.record("a", [*prompt, 500, 501], 1.0, len(prompt))
    assert all(memory._blocks[h] is placed for h in [*prompt, 500, 501])
    assert placed.expiry == 51.0
    assert memory.held("a") == (size + 2 if capacity else None)


@pytest.mark.parametrize("size", [8, 10, 11])
def test_an_answer_extends_its_prompts_placement_in_units(size: int) -> None:
    """With units of 4 blocks, a prompt whose blocks are no multiple of 4 is extended too:
    its placement holds one key per whole unit, which the answer's record goes on from."""
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=1000, capacity_blocks=400, unit=4)
    prompt = list(range(size))
    memory.record("a", prompt, 0.0)
    placed = memory._blocks[3]
    whole = [*prompt, *range(500, 506)]
    memory.record("a", whole, 1.0, len(prompt))
    assert all(memory._blocks[h] is placed for h in whole[3::4])
    assert placed.expiry == 51.0
    assert memory.lookup_at(whole, 2.0) == {"a": len(whole) // 4 * 4}


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``ApproxPrefixIndex``'s method ``name`` (it still runs)."""
    calls: list[int] = []
    method: Callable[..., None] = getattr(ApproxPrefixIndex, name)

    def counted(self: ApproxPrefixIndex, *args: object) -> None:
        calls.append(1)
        method(self, *args)

    monkeypatch.setattr(ApproxPrefixIndex, name, counted)
    return calls


def test_a_short_placement_is_made_block_by_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FEW distinct blocks, none an orphan, a placement takes the block-by-block
    step; FEW blocks, a repeated block or an orphan among them take the bulk steps."""
    calls = spy(monkeypatch, "_place_short")
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=20, capacity_blocks=100)
    memory.record("a", list(range(FEW - 1)), 0.0)
    memory.record("b", list(range(5)), 0.0)  # (some another engine holds: Joints)
    assert len(calls) == 2
    memory.record("a", list(range(100, 100 + FEW)), 1.0)
    memory.record("a", [200, 201, 200], 1.0)
    assert len(calls) == 2
    assert memory._orphans  # (the cap forgot blocks the LRU model still holds)
    memory.record("b", [next(iter(memory._orphans)), 300], 2.0)
    assert len(calls) == 2
    memory.record("b", [301, 302], 2.0)
    assert len(calls) == 3


@pytest.mark.parametrize("engines", ["a", "ab"])
def test_turns_whose_answer_is_not_sent_back_keep_no_whole_conversations(engines: str) -> None:
    """Conversations whose next turn leaves out the last answer (a reasoning model's), on one
    engine or turn by turn on two: each turn's placement lives on through its answer's
    blocks, but keeps no copy of the whole conversation; the blocks placements keep as
    placed stay within a small multiple of the blocks remembered, and each turn's answer
    still extends its prompt's placement."""
    memory = ApproxPrefixIndex(ttl_s=1e9, max_blocks=1 << 20)
    ids = iter(range(1, 1 << 30))
    now = 0.0
    for _ in range(5):
        prompt = [next(ids) for _ in range(50)]
        for turn in range(60):
            now += 1
            prompt = [*prompt, *(next(ids) for _ in range(10))]
            engine = engines[turn % len(engines)]
            memory.record(engine, prompt, now)
            placed = memory._blocks[prompt[-1]]
            answer = [next(ids) for _ in range(10)]
            memory.record(engine, [*prompt, *answer], now, len(prompt))
            assert memory._blocks[answer[-1]] is placed
    kept = sum(len(p.prompt) for p in live_placements(memory))
    assert kept <= 2 * len(memory)


def test_a_conversations_next_turn_extends_its_last_placement_and_equals_the_reference() -> None:
    """A turn that begins with the last turn's prompt and answer, on the same engine, extends
    that placement (one record moved to the newest end, the new blocks after it); another
    engine's placement of it, or one that diverges inside it, is placed anew. Either way
    the memory equals the block-by-block reference, and a lookup of the turn finds the
    blocks the placement holds alone in one step as the reference finds them."""
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=1 << 20, capacity_blocks=200)
    reference = Reference(50.0, 1 << 20, 200)
    fresh = itertools.count(1000)
    talk = [next(fresh) for _ in range(20)]
    now = 0.0
    for turn, engine in enumerate("aaabab"):
        now += 1.0
        prompt = [*talk, *(next(fresh) for _ in range(6))]
        before = claim(memory._blocks.get(talk[0]), engine)
        for probe in (prompt, talk, [*talk[:5], 7]):
            assert memory.lookup_at(probe, now) == reference.lookup(probe, now)
        memory.record(engine, prompt, now)
        reference.record(engine, prompt, now)
        after = claim(memory._blocks.get(prompt[-1]), engine)
        assert (after is before) == (turn in (1, 2)), turn
        answered = [*prompt, next(fresh)]
        memory.record(engine, answered, now, len(prompt))
        reference.record(engine, answered, now)
        talk = answered if turn != 3 else [*answered[:10], next(fresh)]  # (diverges in it)
        assert oldest_first(memory) == list(reference.entries.items())
        assert lru_orders(memory) == {e: list(lru) for e, lru in reference.lru.items()}


@pytest.mark.parametrize(("max_blocks", "capacity"), [
    (1 << 20, 120), (1 << 20, 0), (150, 120), (60, 30), (1 << 20, 25)])
def test_answers_recorded_on_their_prompts_equal_the_reference(
        max_blocks: int, capacity: int) -> None:
    """Prompts recorded, then their answers on their hashes (``record_answer``: a placement
    of the answer's blocks of their own, after the prompt's), next turns sending the answer
    again or not (an agent's tool result follows the prompt) or going on from within the
    prompt, on three engines, some prompts placed on another engine before their answer,
    engines forgotten now and then, the LRU models and the cap letting go: the memory
    equals the block-by-block reference at every step, and each placement's count of the
    blocks it alone holds stays true."""
    rng = random.Random(max_blocks + capacity)
    memory = ApproxPrefixIndex(ttl_s=50.0, max_blocks=max_blocks, capacity_blocks=capacity)
    reference = Reference(50.0, max_blocks, capacity)
    fresh = itertools.count(1000)
    talks: list[list[int]] = [[next(fresh) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    now = 0.0
    for _ in range(200):
        now += rng.random()
        engine = rng.choice("abc")
        talk = rng.randrange(len(talks))
        if rng.random() < 0.02:
            memory.forget_engine(engine)
            reference.forget(engine)
        prompt = tuple([*talks[talk], *(next(fresh) for _ in range(rng.randint(0, 8)))])
        # (looked up first, as a routed prompt is: its record trusts what the lookup matched)
        assert memory.lookup_at(prompt, now) == reference.lookup(list(prompt), now)
        memory.record(engine, prompt, now)
        reference.record(engine, list(prompt), now)
        if rng.random() < 0.15:  # the same prompt on another engine before the answer
            other = rng.choice([e for e in "abc" if e != engine])
            memory.record(other, prompt, now)
            reference.record(other, list(prompt), now)
        more = tuple(next(fresh) for _ in range(rng.choice([0, 1, 1, 2, 3, 20])))
        if prompt:
            memory.record_answer(engine, prompt, more, now)
        else:
            memory.record(engine, more, now)
        reference.record(engine, [*prompt, *more], now)
        talks[talk] = rng.choice([[*prompt, *more], [*prompt, *more], list(prompt),
                                  list(prompt[: len(prompt) // 2])])
        assert oldest_first(memory) == list(reference.entries.items())
        assert lru_orders(memory) == {e: list(lru) for e, lru in reference.lru.items()}
        assert {e: memory.held(e) for e in reference.lru} == {
            e: len(lru) for e, lru in reference.lru.items()}
        alone = collections.Counter(id(held) for held in memory._blocks.values())
        for placed in live_placements(memory):
            assert placed.sole == alone[id(placed)]
        assert_orphans_held(memory)
        for probe in (*talks, [*prompt, *more]):
            assert memory.lookup_at(probe, now) == reference.lookup(probe, now)
