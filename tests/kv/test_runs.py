"""Chained per-page stores applied as one leave the index as one by one would (sans-IO)."""

from __future__ import annotations

import array
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from direct_frontend.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from direct_frontend.kv.index import KvIndex
from tests.support.kv_index import both_ways

BS = 4

# (kind, engine hash, parent choice, token, extra keys, medium)
steps = st.lists(st.tuples(st.sampled_from(["store"] * 8 + ["remove", "clear", "empty"]),
                           st.integers(1, 12),
                           st.sampled_from(["chain"] * 8 + ["none", "other"]),
                           st.integers(0, 3),
                           st.sampled_from([None] * 8 + [(None,), (["x"],)]),
                           st.sampled_from([None] * 8 + ["GPU", "CPU"])),
                 max_size=40)


def events_of(raw: list[tuple[str, int, str, int, Any, str | None]]) -> list[KvEvent]:
    """Mostly chains of one-page stores (SGLang's), with repeats, unknown and missing
    parents, extra keys, another tier, removals, clears and stores of no blocks (offload
    placeholders) between."""
    out: list[KvEvent] = []
    last: int | None = None
    for kind, h, parent, token, extra, medium in raw:
        if kind == "remove":
            out.append(BlockRemoved((h,)))
        elif kind == "clear":
            out.append(AllBlocksCleared())
        elif kind == "empty":
            out.append(BlockStored((), last, array.array("I"), 0))
        else:
            up = last if parent == "chain" else None if parent == "none" else h + 20
            out.append(BlockStored((h,), up, array.array("I", [token] * BS), BS,
                                   extra_keys=extra, medium=medium))
            last = h
    return out


def state(index: KvIndex) -> object:
    engines = {name: (s.blocks, s.copies, s.aliases) for name, s in index._engines.items()}
    return (engines, index._prefixes._table, index.stats(), index._conflicts)


@settings(max_examples=300, deadline=None)
@given(raw=steps, room=st.sampled_from([3, 6, 1000]))
@example(raw=[("store", 5, "none", 1, None, None), ("store", 1, "none", 0, None, None),
              ("store", 5, "chain", 2, None, None), ("store", 6, "chain", 3, None, None)],
         room=1000)  # a run through a block stored before under another prefix
@example(raw=[("store", 1, "none", 0, None, None), ("empty", 0, "chain", 0, None, None),
              ("store", 2, "chain", 1, None, None)],
         room=1000)  # a store of no blocks inside a batch: nothing to continue
@example(raw=[("store", h, "chain", h % 4, None, None) for h in range(1, 6)],
         room=3)  # a run longer than the room left: evicted from between its stores
def test_applying_a_batch_equals_storing_each_event(
        raw: list[tuple[str, int, str, int, Any, str | None]], room: int) -> None:
    """Entries, copies, extra holds, the shared table, counters and skips: all equal,
    also when the index is near its cap."""
    batched, single = both_ways(events_of(raw), BS, room)
    assert state(batched) == state(single)
