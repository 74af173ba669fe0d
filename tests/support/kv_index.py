"""The KV index fed one event at a time: what a batch applied at once must equal."""

from __future__ import annotations

from collections.abc import Iterable

from direct_frontend.kv.events import BlockRemoved, BlockStored, KvEvent
from direct_frontend.kv.index import KvIndex


def one_by_one(index: KvIndex, events: Iterable[KvEvent], engine: str = "e") -> None:
    """Each event through the index's own store, remove or clear, then the sweep a batch
    ends with."""
    for event in events:
        if isinstance(event, BlockStored):
            index.store(engine, event)
        elif isinstance(event, BlockRemoved):
            index.remove(engine, event)
        else:
            index.clear_engine(engine)
    if index._prefixes.sweeping:
        index.sweep()


def both_ways(events: list[KvEvent], block_size: int, max_blocks: int | None = None
              ) -> tuple[KvIndex, KvIndex]:
    """Two fresh indexes, ``events`` applied to the first as a batch, to the second one by
    one."""
    sizes = {} if max_blocks is None else {"max_blocks": max_blocks}
    batched, single = KvIndex(block_size, **sizes), KvIndex(block_size, **sizes)
    batched.apply_events("e", events)
    one_by_one(single, events)
    return batched, single
