"""The index's bulk store steps against block-by-block references (sans-IO)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.table import PrefixTable

stores = st.lists(st.lists(st.tuples(st.integers(0, 12), st.integers(100, 112)), max_size=8),
                  max_size=8)


@settings(max_examples=200, deadline=None)
@given(stores=stores)
def test_placing_stores_equals_placing_block_by_block(
        stores: list[list[tuple[int, int]]]) -> None:
    """New blocks, blocks stored again (a second copy), an engine hash that repeats within a
    store, one that maps to another prefix: the same entries, copies, conflicts and holds."""
    index = KvIndex(4)
    state = index._engine("e")
    blocks: dict[int, int] = {}
    copies: dict[int, int] = {}
    conflicts = 0
    holds: dict[int, int] = {}
    for store in stores:
        engine_hashes = [e for e, _ in store]
        ours = [h for _, h in store]
        index._place(state, engine_hashes, ours)
        for engine_hash, h in store:  # the reference: one block at a time
            old = blocks.get(engine_hash)
            if old is not None:
                copies[engine_hash] = copies.get(engine_hash, 1) + 1
                conflicts += old != h
                continue
            blocks[engine_hash] = h
            holds[h] = holds.get(h, 0) + 1
        assert state.blocks == blocks and state.copies == copies
        assert index._conflicts == conflicts and index._total == sum(holds.values())
        assert index._prefixes._table == dict.fromkeys(holds, state.bit)
        assert state.aliases == {h: n - 1 for h, n in holds.items() if n > 1}


@settings(max_examples=200, deadline=None)
@given(holds=st.lists(st.tuples(st.lists(st.integers(0, 10), max_size=8),
                                st.sampled_from([1, 2, 4])), max_size=10))
def test_holding_equals_holding_one_prefix_at_a_time(
        holds: list[tuple[list[int], int]]) -> None:
    """Distinct and repeated prefixes, held by one holder or several: the same masks and
    extra holds."""
    table = PrefixTable()
    aliases: dict[int, dict[int, int]] = {1: {}, 2: {}, 4: {}}
    masks: dict[int, int] = {}
    extra: dict[int, dict[int, int]] = {1: {}, 2: {}, 4: {}}
    for hashes, bit in holds:
        table.hold(hashes, bit, aliases[bit])
        for h in hashes:  # the reference
            mask = masks.get(h, 0)
            if mask & bit:
                extra[bit][h] = extra[bit].get(h, 0) + 1
            else:
                masks[h] = mask | bit
        assert table._table == masks and aliases == extra
