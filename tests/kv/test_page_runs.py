"""Chains of pages of another size than ours, applied as a batch, end as one by one (sans-IO).

SGLang's default page is one token: a prompt is a chain of one-page stores the
index re-cuts into its blocks (kv/regroup.py) and stores as runs.
"""

from __future__ import annotations

import array

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from direct_frontend.kv.index import KvIndex
from tests.support.kv_index import both_ways

BS = 4

# (kind, engine hash, parent choice, token, page size, medium)
steps = st.lists(st.tuples(st.sampled_from(["store"] * 10 + ["remove", "clear"]),
                           st.integers(1, 30),
                           st.sampled_from(["chain"] * 10 + ["none", "other"]),
                           st.integers(0, 2),
                           st.sampled_from([1] * 8 + [2, 8, BS, 3]),
                           st.sampled_from([None] * 10 + ["CPU"])),
                 max_size=60)


def events_of(raw: list[tuple[str, int, str, int, int, str | None]]) -> list[KvEvent]:
    """Mostly chains of one-token pages, with repeats, gaps, pages of other sizes (ours,
    coarser, one that fits no block), another tier, removals and clears between."""
    out: list[KvEvent] = []
    last: int | None = None
    for kind, h, parent, token, size, medium in raw:
        if kind == "remove":
            out.append(BlockRemoved((h,)))
        elif kind == "clear":
            out.append(AllBlocksCleared())
        else:
            up = last if parent == "chain" else None if parent == "none" else h + 40
            out.append(BlockStored((h,), up, array.array("I", [token] * size), size,
                                   medium=medium))
            last = h
    return out


def state(index: KvIndex) -> object:
    engines = {name: (s.blocks, s.copies, s.aliases) for name, s in index._engines.items()}
    pages = {name: (dict(r._pages), r.unplaced) for name, r in index._regroupers.items()}
    return engines, pages, index._prefixes._table, index.stats(), index._conflicts


@settings(max_examples=300, deadline=None)
@given(raw=steps, room=st.sampled_from([2, 5, 1000]))
def test_applying_a_batch_of_pages_equals_storing_each_page(
        raw: list[tuple[str, int, str, int, int, str | None]], room: int) -> None:
    """Entries, the regrouper's pages, the shared table, counters and skips: all equal,
    also when the index is near its cap."""
    batched, single = both_ways(events_of(raw), BS, room)
    assert state(batched) == state(single)


def test_a_prompt_of_one_token_pages_is_indexed_in_our_blocks() -> None:
    """A chain of 4 * 5 + 2 pages: five blocks found, the last two pages wait for more."""
    tokens = list(range(22))
    events = [BlockStored((100 + i,), None if i == 0 else 99 + i, array.array("I", [t]), 1)
              for i, t in enumerate(tokens)]
    index = KvIndex(BS)
    index.apply_events("e", events)
    assert index.lookup(tokens) == {"e": 5}
    assert len(index._regroupers["e"]) == 22
