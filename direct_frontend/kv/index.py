"""The KV block index: which engine holds which prefix, by our own content hash (sans-IO).

Stored blocks are keyed by our prefix hash (kv/prefix.py), computed from their
token ids the same way as a request's, because engine block hashes differ
between engines, configurations and (before 2026) processes.

The engine's hash is only an id: per engine we map it to our prefix hash, to
place a stored block after its parent and to find what a removal frees.
Which engines hold a prefix is one shared table (kv/table.py) that a lookup
walks once whatever the number of engines.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import sys
from collections.abc import Iterable, Sequence
from typing import Final

from direct_frontend.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from direct_frontend.kv.filters import DEVICE_TIERS, removal_indexed, store_rejection
from direct_frontend.kv.prefix import namespace_seed, prefix_hashes, stored_hashes
from direct_frontend.kv.regroup import Regrouper, compatible
from direct_frontend.kv.runs import continues, merged
from direct_frontend.kv.table import HASH_BYTES, PrefixTable, due_for_rebuild, let_go_extra

__all__ = ["KvIndex", "KvIndexStats"]

_EAGER_CLEAR: Final = 4096  # clear smaller engines at once; retire bigger ones' slots
_SWEEP_BUDGET: Final = 2048  # retired entries swept per applied batch (~1 ms)
_PAGE_BYTES: Final = 160  # a remembered page of a finer-paged engine (kv/regroup.py), roughly


@dataclasses.dataclass(slots=True)
class _Engine:
    """One engine's (or rank's) entries: its hash → our prefix hash."""

    name: str
    bit: int
    slot: int
    blocks: dict[int, int] = dataclasses.field(default_factory=dict)
    copies: dict[int, int] = dataclasses.field(default_factory=dict)  # engine hash → copies > 1
    aliases: dict[int, int] = dataclasses.field(default_factory=dict)  # prefix → extra holders
    peak: int = 0  # len(blocks) when the dict was last rebuilt or grew


@dataclasses.dataclass(frozen=True, slots=True)
class KvIndexStats:
    """A snapshot for metrics. ``blocks`` counts (engine, engine hash) entries."""

    blocks: int
    prefixes: int
    engines: int
    bytes_estimate: int
    evictions: int
    blocks_by_engine: dict[str, int]
    skipped: dict[str, int]
    unknown_parent: int
    unknown_removals: int
    conflicts: int
    pending_sweep: int  # entries of cleared engines not yet swept from the table


class KvIndex:
    """Blocks per engine, keyed by our prefix hash; see the module docstring.

    ``block_size`` is the size lookups match in; an engine whose pages divide
    it or are a multiple of it (SGLang's default page is one token) is re-cut
    into such blocks (kv/regroup.py); stores of any other size are skipped. ``max_blocks`` caps
    the entries: past it the oldest-stored entries of the largest engines are
    evicted down to ``evict_to`` of the cap (a safety net against missed
    removals, not the normal way memory is freed). ``tiers`` are the mediums
    indexed, as one.
    """

    def __init__(
        self,
        block_size: int,
        *,
        max_blocks: int = 4_000_000,
        evict_to: float = 0.9,
        tiers: Iterable[str] = DEVICE_TIERS,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        if max_blocks < 1 or not 0.0 < evict_to <= 1.0:
            raise ValueError("max_blocks must be positive and evict_to within (0, 1]")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.evict_to = evict_to
        self.tiers = frozenset(tiers)
        self._prefixes = PrefixTable()
        self._engines: dict[str, _Engine] = {}
        self._total = 0
        self._evictions = 0
        self._skipped: dict[str, int] = {}
        self._unknown_parent = 0
        self._unknown_removals = 0
        self._conflicts = 0
        self._regroupers: dict[str, Regrouper] = {}

    # -- events ------------------------------------------------------------

    def apply(self, engine: str, batch: KvEventBatch) -> None:
        """Apply one batch's events in order."""
        self.apply_events(engine, batch.events)

    def apply_events(self, engine: str, events: Iterable[KvEvent]) -> None:
        """Apply events in order (a batch's, or a test's), then sweep a little.

        A run of stores each of the one before's child (SGLang's one per page)
        is stored as one where that ends the same (kv/runs.py); removals in a
        row (vLLM's one per block) are taken as one where that ends the same.
        """
        stores: list[BlockStored] = []
        removals: list[BlockRemoved] = []
        for event in events:
            if isinstance(event, BlockStored):
                if removals:
                    self._remove_run(engine, removals)
                    removals = []
                stores.append(event)
            elif isinstance(event, BlockRemoved):
                if stores:
                    self._store_chained(engine, stores)
                    stores = []
                removals.append(event)
            elif isinstance(event, AllBlocksCleared):
                self._flush(engine, stores, removals)
                stores, removals = [], []
                self.clear_engine(engine)
        self._flush(engine, stores, removals)
        if self._prefixes.sweeping:
            self.sweep()

    def _flush(self, engine: str, stores: list[BlockStored], removals: list[BlockRemoved]
               ) -> None:
        if stores:
            self._store_chained(engine, stores)
        if removals:
            self._remove_run(engine, removals)

    def _remove_run(self, engine: str, run: Sequence[BlockRemoved]) -> None:
        """Removals in a row as one, else one by one.

        Taken one by one, each frees its blocks in order, then offers the dicts
        a rebuild (:meth:`_compact`); as one, the blocks go in the same order,
        so only a rebuild could fall elsewhere: the run is one where none can
        happen on the way (nor is an engine's page re-cut in between).
        """
        state = self._engines.get(engine)
        if len(run) > 1 and state is not None and engine not in self._regroupers:
            tiers = self.tiers
            hashes = [h for event in run if removal_indexed(event, tiers)
                      for h in event.block_hashes]
            if not (self._prefixes.may_compact(len(hashes))
                    or due_for_rebuild(len(state.blocks) - len(hashes), state.peak)):
                gone = self._unstore(state, hashes)
                self._prefixes.unhold(gone, state.bit, state.aliases)
                self._total -= len(gone)
                return
        for event in run:
            self.remove(engine, event)

    def _store_run(self, engine: str, run: Sequence[BlockStored]) -> None:
        """Store ``run`` as one where :func:`merged` says that ends the same, else one by one.

        Pages of another size than ours never merge (the filters turn them
        down); they go to :meth:`_store_pages`.
        """
        if len(run) > 1:
            if run[0].block_size != self.block_size:
                self._store_pages(engine, run)
                return
            state = self._engines.get(engine)
            one = merged(run, {} if state is None else state.blocks,
                         self.max_blocks - self._total, self.block_size, self.tiers)
            if one is not None:
                self.store(engine, one)
                return
        for event in run:
            self.store(engine, event)

    def _store_pages(self, engine: str, run: Sequence[BlockStored]) -> None:
        """A chain of pages to re-cut: through the regrouper page by page, the blocks they
        complete stored after as runs.

        One by one, each page's completed blocks are stored before the next page
        is re-cut; the regrouper never reads the index, so storing them later, in
        the same order, ends the same. Pages the regrouper does not take go
        through :meth:`store`, in their place.
        """
        blocks: list[BlockStored] = []
        for event in run:
            regrouper = self._regroupers.get(engine)
            if (regrouper is not None and regrouper.page_size == event.block_size
                    and store_rejection(event, self.block_size, self.tiers) == "block_size"):
                blocks += regrouper.stored(event)
                continue
            self._store_chained(engine, blocks)
            blocks = []
            self.store(engine, event)
        self._store_chained(engine, blocks)

    def _store_chained(self, engine: str, stores: Sequence[BlockStored]) -> None:
        """Stores in order, each run of a store's children after it as one (:meth:`_store_run`)."""
        run: list[BlockStored] = []
        for event in stores:
            if run and not continues(run[-1], event):
                self._store_run(engine, run)
                run = []
            run.append(event)
        if run:
            self._store_run(engine, run)

    def store(self, engine: str, event: BlockStored) -> int:
        """Index a BlockStored after the docs/kv-events.md §10 filters; returns blocks added."""
        reason = store_rejection(event, self.block_size, self.tiers)
        if reason is not None:
            return self._store_unfit(engine, event, reason)
        state = self._engine(engine)
        parent = event.parent_block_hash
        seed = namespace_seed(event.lora_name) if parent is None else state.blocks.get(parent)
        if seed is None:
            # We missed the parent's store (or it was evicted): it cannot be placed.
            self._unknown_parent += 1
            return 0
        added = self._place(state, event.block_hashes, stored_hashes(event, self.block_size, seed))
        if self._total > self.max_blocks:
            self._evict()
        return added

    def _store_unfit(self, engine: str, event: BlockStored, reason: str) -> int:
        """A store the filters turned down: re-cut into our blocks if its pages fit, else skipped.

        One page size per engine: a store of another (SGLang's partial last
        page of a radix node) is not a full page and is skipped, never a reason
        to start over.
        """
        if reason == "block_size" and compatible(event.block_size, self.block_size):
            regrouper = self._regroupers.get(engine)
            if regrouper is None:
                regrouper = self._regroupers[engine] = Regrouper(event.block_size, self.block_size)
            if regrouper.page_size == event.block_size:
                return sum(self.store(engine, block) for block in regrouper.stored(event))
        self._skip(reason)
        return 0

    def _place(self, state: _Engine, engine_hashes: Sequence[int], ours: Sequence[int]) -> int:
        """Map each engine hash to our prefix hash on ``state``; returns the new entries."""
        blocks = state.blocks
        size = len(blocks)
        if (len(engine_hashes) == len(ours)
                and list(map(blocks.get, engine_hashes)).count(None) == len(engine_hashes)):
            # the usual store (blocks new to this engine): in bulk, in C
            blocks.update(zip(engine_hashes, ours, strict=True))
            if len(blocks) - size == len(ours):
                return self._placed(state, ours)
            for engine_hash in engine_hashes:  # one repeats: placed one by one, as a store goes
                blocks.pop(engine_hash, None)
        new = []
        for engine_hash, h in zip(engine_hashes, ours, strict=True):
            old = blocks.get(engine_hash)
            if old is not None:
                # A second physical copy (vLLM): count it, free on the last removal.
                state.copies[engine_hash] = state.copies.get(engine_hash, 1) + 1
                if old != h:
                    self._conflicts += 1
                continue
            blocks[engine_hash] = h
            new.append(h)
        return self._placed(state, new)

    def _placed(self, state: _Engine, new: Sequence[int]) -> int:
        """``new`` (our prefix hashes) placed on ``state``: held in the table and counted."""
        self._prefixes.hold(new, state.bit, state.aliases)
        self._total += len(new)
        if len(state.blocks) > state.peak:
            state.peak = len(state.blocks)
        return len(new)

    def remove(self, engine: str, event: BlockRemoved) -> int:
        """Forget removed blocks (one removal per physical copy); returns entries freed."""
        if not removal_indexed(event, self.tiers):
            return 0
        regrouper = self._regroupers.get(engine)
        if regrouper is not None:
            regrouped = regrouper.removed(event)
            if regrouped is None:
                return 0
            event = regrouped
        state = self._engines.get(engine)
        if state is None:
            self._unknown_removals += len(event.block_hashes)
            return 0
        gone = self._unstore(state, event.block_hashes)
        self._prefixes.unhold(gone, state.bit, state.aliases)
        self._total -= len(gone)
        self._compact(state)
        return len(gone)

    def _unstore(self, state: _Engine, engine_hashes: Iterable[int]) -> list[int]:
        """Drop one physical copy of each block from ``state``; our hashes of the entries gone."""
        blocks = state.blocks
        copies = state.copies
        gone = []
        for engine_hash in engine_hashes:
            h = blocks.get(engine_hash)
            if h is None:
                self._unknown_removals += 1
                continue
            if copies and let_go_extra(copies, engine_hash, 2):  # counts every copy
                continue
            del blocks[engine_hash]
            gone.append(h)
        return gone

    def clear_engine(self, engine: str) -> int:
        """Drop every entry of one engine (AllBlocksCleared, restart, lost history).

        O(1) for a big engine: its bit is retired at once (lookups stop seeing
        it) and the engine continues on a fresh bit; the old entries are swept
        from the shared table a bounded amount per applied batch (:meth:`sweep`),
        so a fence never stalls the event loop for the whole engine.
        """
        regrouper = self._regroupers.get(engine)
        if regrouper is not None:
            regrouper.clear()
        state = self._engines.get(engine)
        if state is None:
            return 0
        freed = len(state.blocks)
        self._total -= freed
        if freed > _EAGER_CLEAR:
            self._prefixes.retire(state.slot, state.blocks)  # reserved until swept
            del self._engines[engine]
            self._engine(engine)
            return freed
        self._prefixes.unhold(state.blocks.values(), state.bit)
        # New dicts, so the memory really goes back (clear() keeps the table size).
        state.blocks = {}
        state.copies = {}
        state.aliases = {}
        state.peak = 0
        self._compact(state)
        return freed

    def remove_engine(self, engine: str) -> None:
        """Forget an engine entirely (removed from the fleet); its slot is reused."""
        self._regroupers.pop(engine, None)
        if engine not in self._engines:
            return
        self.clear_engine(engine)
        self._prefixes.release(self._engines.pop(engine).slot)

    def sweep(self, budget: int = _SWEEP_BUDGET) -> int:
        """Sweep up to ``budget`` entries of cleared engines from the table; returns how many.

        :meth:`apply_events` calls it after every batch; call it yourself when
        the fleet is idle and ``stats().pending_sweep`` should reach 0 sooner.
        """
        return self._prefixes.sweep(budget)

    # -- snapshots (a late replica warms from a sibling's) -------------------

    def export_engine(self, engine: str) -> tuple[dict[int, int], dict[int, int]]:
        """Copies of one engine's entries: its hash → our prefix hash, and extra copies."""
        state = self._engines.get(engine)
        if state is None:
            return {}, {}
        return dict(state.blocks), dict(state.copies)

    def import_engine(
        self, engine: str, blocks: Iterable[tuple[int, int]], copies: Iterable[tuple[int, int]]
    ) -> int:
        """Replace one engine's entries with exported ones; returns the entries loaded.

        The engine's own hashes come along, so its later removals and stores
        (whose parents are engine hashes) apply as if we had seen every event.
        """
        self.clear_engine(engine)
        state = self._engine(engine)
        new = []
        for engine_hash, h in blocks:
            if engine_hash in state.blocks:
                continue
            state.blocks[engine_hash] = h
            new.append(h)
        self._prefixes.hold(new, state.bit, state.aliases)
        state.copies = {eh: n for eh, n in copies if eh in state.blocks and n > 1}
        state.peak = len(state.blocks)
        self._total += len(new)
        if self._total > self.max_blocks:
            self._evict()
        return len(new)

    # -- lookup ------------------------------------------------------------

    def request_hashes(
        self,
        token_ids: Sequence[int] | array.array[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """A request's prefix hashes (full blocks only); empty if a token id is not a u32."""
        try:
            return prefix_hashes(
                token_ids, self.block_size, lora_name=lora_name, cache_salt=cache_salt
            )
        except (OverflowError, TypeError):
            return []

    def lookup(
        self,
        token_ids: Sequence[int] | array.array[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, int]:
        """Leading blocks of the request each engine holds; engines with none are absent."""
        return self.lookup_hashes(
            self.request_hashes(token_ids, lora_name=lora_name, cache_salt=cache_salt)
        )

    def lookup_hashes(self, hashes: Sequence[int]) -> dict[str, int]:
        """:meth:`lookup` for precomputed :meth:`request_hashes`."""
        return self._prefixes.lookup(hashes)

    # -- observation -------------------------------------------------------

    def __len__(self) -> int:
        return self._total

    def engines(self) -> list[str]:
        """Engines with a slot (held entries, or did)."""
        return list(self._engines)

    def blocks_of(self, engine: str) -> int:
        """Entries one engine holds."""
        state = self._engines.get(engine)
        return 0 if state is None else len(state.blocks)

    def stats(self) -> KvIndexStats:
        """Counters and a memory estimate (dict tables plus the hash int objects)."""
        size = self._prefixes.bytes_estimate()
        for state in self._engines.values():
            size += sys.getsizeof(state.blocks) + len(state.blocks) * HASH_BYTES
            size += sys.getsizeof(state.copies) + sys.getsizeof(state.aliases)
        size += sum(len(regrouper) for regrouper in self._regroupers.values()) * _PAGE_BYTES
        return KvIndexStats(
            blocks=self._total,
            prefixes=len(self._prefixes),
            engines=len(self._engines),
            bytes_estimate=size,
            evictions=self._evictions,
            blocks_by_engine={name: len(s.blocks) for name, s in self._engines.items()},
            skipped=dict(self._skipped),
            unknown_parent=self._unknown_parent,
            unknown_removals=self._unknown_removals,
            conflicts=self._conflicts,
            pending_sweep=self._prefixes.pending_sweep(),
        )

    # -- internals ---------------------------------------------------------

    def _skip(self, reason: str) -> None:
        self._skipped[reason] = self._skipped.get(reason, 0) + 1

    def _engine(self, name: str) -> _Engine:
        state = self._engines.get(name)
        if state is None:
            slot = self._prefixes.claim(name)
            state = self._engines[name] = _Engine(name=name, bit=1 << slot, slot=slot)
        return state

    def _compact(self, state: _Engine) -> None:
        """Rebuild dicts that removals left mostly empty: CPython never shrinks them."""
        if due_for_rebuild(len(state.blocks), state.peak):
            state.blocks = dict(state.blocks)
            state.copies = dict(state.copies)
            state.aliases = dict(state.aliases)
            state.peak = len(state.blocks)
        self._prefixes.compact()

    def _evict(self) -> None:
        """Drop the oldest-stored entries, most from the largest engines, down to the target."""
        target = int(self.max_blocks * self.evict_to)
        while self._total > target:
            excess = self._total - target
            engines = sorted(self._engines.values(), key=lambda s: len(s.blocks), reverse=True)
            for state in engines:
                share = -(-excess * len(state.blocks) // self._total)  # ceil
                victims = list(itertools.islice(state.blocks, max(1, share)))
                for engine_hash in victims:
                    state.copies.pop(engine_hash, None)
                self._prefixes.unhold([state.blocks.pop(eh) for eh in victims], state.bit,
                                      state.aliases)
                self._total -= len(victims)
                self._evictions += len(victims)
                if self._total <= target:
                    return

