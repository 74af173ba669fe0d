"""Removals in a row applied as one leave the index as one by one would (sans-IO)."""

from __future__ import annotations

import array

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.table import COMPACT_MIN
from tests.support.kv_index import both_ways, one_by_one

BS = 2


def state(index: KvIndex) -> object:
    """Entries, copies, extra holds, the shared table, counters and the memory estimate
    (which sees when a dict was rebuilt)."""
    engines = {name: (s.blocks, s.copies, s.aliases, s.peak) for name, s in index._engines.items()}
    return (engines, index._prefixes._table, index._prefixes._peak, index.stats())


def store(first: int, n: int, token: int = 1) -> BlockStored:
    return BlockStored(tuple(range(first, first + n)), None,
                       array.array("I", [token] * (n * BS)), BS)


removal = st.builds(
    lambda hashes, medium, group: BlockRemoved(tuple(hashes), medium, group),
    st.lists(st.integers(1, 14), min_size=1, max_size=3),
    st.sampled_from([None, None, "GPU", "CPU"]), st.sampled_from([None, None, 0, 1]))
step = st.one_of(
    removal, removal, removal,
    st.builds(store, st.integers(1, 12), st.integers(1, 3), st.integers(0, 2)),
    st.just(AllBlocksCleared()))


@settings(max_examples=300, deadline=None)
@given(events=st.lists(step, max_size=30))
def test_a_run_of_removals_equals_removing_each(events: list[KvEvent]) -> None:
    """Single- and multi-block removals of known, unknown and twice-stored blocks, of
    other tiers and groups, between stores and clears: the index ends the same."""
    batched, single = both_ways(events, BS)
    assert state(batched) == state(single)


def test_a_run_that_shrinks_the_dicts_rebuilds_them_where_one_by_one_would() -> None:
    """vLLM's one removal event per block, past the point where the engine's dict and the
    shared table are rebuilt (CPython never shrinks them): rebuilt at the same removal."""
    n = COMPACT_MIN * 2
    events: list[KvEvent] = [store(1, n)]
    events += [BlockRemoved((h,), "GPU") for h in range(1, n + 1 - COMPACT_MIN // 4)]
    batched, single = both_ways(events, BS)
    assert state(batched) == state(single)
    assert batched._engines["e"].peak < n  # the test went past a rebuild


def test_a_run_that_shrinks_one_engines_dict_alone_rebuilds_it_where_one_by_one_would(
) -> None:
    """Another engine keeps the shared table full, so only this engine's own dict comes
    due for a rebuild on the way: the run is still taken one by one there."""
    n = COMPACT_MIN * 2
    events: list[KvEvent] = [store(1, n)]
    events += [BlockRemoved((h,), "GPU") for h in range(1, n + 1 - COMPACT_MIN // 4)]
    batched, single = KvIndex(BS), KvIndex(BS)
    for index in (batched, single):
        index.apply_events("x", [store(1, n, token=2)])  # other prefixes, in the shared table
    batched.apply_events("e", events)
    one_by_one(single, events)
    assert state(batched) == state(single)
    assert batched._engines["e"].peak < n  # the engine's dict was rebuilt on the way


def test_a_run_of_removals_that_cannot_shrink_the_dicts_is_taken_as_one() -> None:
    """The usual run (a few of many blocks) frees each block it names, once."""
    index = KvIndex(BS)
    index.apply_events("e", [store(1, 8), store(1, 2)])  # blocks 1, 2: a second copy
    index.apply_events("e", [BlockRemoved((h,)) for h in (1, 2, 3, 3, 99)])
    blocks, copies = index.export_engine("e")
    assert sorted(blocks) == [1, 2, *range(4, 9)] and copies == {}
    assert index.stats().unknown_removals == 2  # the second 3, and 99
