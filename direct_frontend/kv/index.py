"""The KV block index: which engine holds which prefix, by our own content hash (sans-IO).

Stored blocks are keyed by our prefix hash (kv/prefix.py), computed from their
token ids the same way as a request's, because engine block hashes differ
between engines, configurations and (before 2026) processes.

The engine's hash is only an id: per engine we map it to our prefix hash, to
place a stored block after its parent and to find what a removal frees.
Lookup walks the request's prefix hashes through one shared table whose values
are bitmasks of the engines holding that prefix, so it costs one dict probe per
matched block whatever the number of engines.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence
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

__all__ = ["KvIndex", "KvIndexStats"]

_INT_BYTES: Final = sys.getsizeof(1 << 63)  # a hash as a Python int
_COMPACT_MIN: Final = 4096  # smaller dicts are not worth rebuilding
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


@dataclasses.dataclass(slots=True)
class _Grave:
    """A cleared engine's old slot: its bit is dead, its table entries still to sweep."""

    slot: int
    bit: int
    blocks: dict[int, int]
    hashes: Iterator[int]
    left: int


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
        self._table: dict[int, int] = {}
        self._table_peak = 0
        self._engines: dict[str, _Engine] = {}
        self._slots: list[_Engine | None] = []  # by bit; a retired state keeps its slot
        self._live = 0  # the bits of live engines: retired bits never match
        self._graveyard: collections.deque[_Grave] = collections.deque()
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
        """Apply events in order (a batch's, or a test's), then sweep a little."""
        for event in events:
            if isinstance(event, BlockStored):
                self.store(engine, event)
            elif isinstance(event, BlockRemoved):
                self.remove(engine, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear_engine(engine)
        if self._graveyard:
            self.sweep()

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
        if len(self._table) > self._table_peak:
            self._table_peak = len(self._table)
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
        added = 0
        for engine_hash, h in zip(engine_hashes, ours, strict=True):
            old = blocks.get(engine_hash)
            if old is not None:
                # A second physical copy (vLLM): count it, free on the last removal.
                state.copies[engine_hash] = state.copies.get(engine_hash, 1) + 1
                if old != h:
                    self._conflicts += 1
                continue
            blocks[engine_hash] = h
            self._hold(state, h)
            added += 1
        self._total += added
        if len(blocks) > state.peak:
            state.peak = len(blocks)
        return added

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
        _unhold(self._table, gone, state.bit, state.aliases)
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
            if copies and _let_go_extra(copies, engine_hash, 2):  # counts every copy
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
            self._live &= ~state.bit  # the old slot stays reserved until swept
            blocks = state.blocks
            self._graveyard.append(
                _Grave(state.slot, state.bit, blocks, iter(blocks.values()), freed)
            )
            del self._engines[engine]
            self._engine(engine)
            return freed
        _unhold(self._table, state.blocks.values(), state.bit)
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
        state = self._engines.pop(engine)
        self._live &= ~state.bit
        self._slots[state.slot] = None

    def sweep(self, budget: int = _SWEEP_BUDGET) -> int:
        """Sweep up to ``budget`` entries of cleared engines from the table; returns how many.

        :meth:`apply_events` calls it after every batch; call it yourself when
        the fleet is idle and ``stats().pending_sweep`` should reach 0 sooner.
        """
        done = 0
        while self._graveyard and done < budget:
            grave = self._graveyard[0]
            swept = list(itertools.islice(grave.hashes, budget - done))
            _unhold(self._table, swept, grave.bit)  # (the table: a compaction may renew it)
            n = len(swept)
            grave.left -= n
            done += n
            if grave.left <= 0 or n == 0:
                self._graveyard.popleft()
                self._slots[grave.slot] = None
                self._compact_table()
        return done

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
        added = 0
        for engine_hash, h in blocks:
            if engine_hash in state.blocks:
                continue
            state.blocks[engine_hash] = h
            self._hold(state, h)
            added += 1
        state.copies = {eh: n for eh, n in copies if eh in state.blocks and n > 1}
        state.peak = len(state.blocks)
        self._total += added
        self._table_peak = max(self._table_peak, len(self._table))
        if self._total > self.max_blocks:
            self._evict()
        return added

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
        if not hashes:
            return {}
        table = self._table
        alive = table.get(hashes[0], 0) & self._live
        if not alive:
            return {}
        result: dict[str, int] = {}
        depth = 1
        for h in itertools.islice(hashes, 1, None):
            held = table.get(h, 0) & alive
            if held != alive:
                self._record(result, alive & ~held, depth)
                alive = held
                if not alive:
                    return result
            depth += 1
        self._record(result, alive, depth)
        return result

    def _record(self, result: dict[str, int], mask: int, depth: int) -> None:
        slots = self._slots
        while mask:
            low = mask & -mask
            state = slots[low.bit_length() - 1]
            if state is not None:
                result[state.name] = depth
            mask ^= low

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
        size = sys.getsizeof(self._table) + len(self._table) * _INT_BYTES
        for state in self._engines.values():
            size += sys.getsizeof(state.blocks) + len(state.blocks) * _INT_BYTES
            size += sys.getsizeof(state.copies) + sys.getsizeof(state.aliases)
        for grave in self._graveyard:
            size += sys.getsizeof(grave.blocks) + len(grave.blocks) * _INT_BYTES
        size += sum(len(regrouper) for regrouper in self._regroupers.values()) * _PAGE_BYTES
        return KvIndexStats(
            blocks=self._total,
            prefixes=len(self._table),
            engines=len(self._engines),
            bytes_estimate=size,
            evictions=self._evictions,
            blocks_by_engine={name: len(s.blocks) for name, s in self._engines.items()},
            skipped=dict(self._skipped),
            unknown_parent=self._unknown_parent,
            unknown_removals=self._unknown_removals,
            conflicts=self._conflicts,
            pending_sweep=sum(grave.left for grave in self._graveyard),
        )

    # -- internals ---------------------------------------------------------

    def _skip(self, reason: str) -> None:
        self._skipped[reason] = self._skipped.get(reason, 0) + 1

    def _engine(self, name: str) -> _Engine:
        state = self._engines.get(name)
        if state is None:
            try:
                slot = self._slots.index(None)
            except ValueError:
                slot = len(self._slots)
                self._slots.append(None)
            state = _Engine(name=name, bit=1 << slot, slot=slot)
            self._slots[slot] = state
            self._engines[name] = state
            self._live |= state.bit
        return state

    def _hold(self, state: _Engine, h: int) -> None:
        """``state`` holds prefix ``h`` (once more, if another of its blocks has it already)."""
        table = self._table
        mask = table.get(h, 0)
        if mask & state.bit:
            state.aliases[h] = state.aliases.get(h, 0) + 1
        else:
            table[h] = mask | state.bit

    def _compact(self, state: _Engine) -> None:
        """Rebuild dicts that removals left mostly empty: CPython never shrinks them."""
        if state.peak > _COMPACT_MIN and len(state.blocks) < state.peak // 4:
            state.blocks = dict(state.blocks)
            state.copies = dict(state.copies)
            state.aliases = dict(state.aliases)
            state.peak = len(state.blocks)
        self._compact_table()

    def _compact_table(self) -> None:
        if self._table_peak > _COMPACT_MIN and len(self._table) < self._table_peak // 4:
            self._table = dict(self._table)
            self._table_peak = len(self._table)

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
                _unhold(self._table, [state.blocks.pop(eh) for eh in victims], state.bit,
                        state.aliases)
                self._total -= len(victims)
                self._evictions += len(victims)
                if self._total <= target:
                    return


def _unhold(table: dict[int, int], hashes: Iterable[int], bit: int,
            aliases: dict[int, int] | None = None) -> None:
    """The holder of ``bit`` lets go of each of ``hashes`` once; a prefix nobody holds goes.

    ``aliases``: the holder's extra holds of a prefix (two of its blocks with
    one prefix hash), let go of before its bit.
    """
    keep = ~bit
    for h in hashes:
        if aliases and _let_go_extra(aliases, h, 1):  # counts the extra holds
            continue
        mask = table.get(h)
        if mask is None:
            continue
        mask &= keep
        if mask:
            table[h] = mask
        else:
            del table[h]


def _let_go_extra(counts: dict[int, int], key: int, last: int) -> bool:
    """Let go of one extra hold of ``key`` if ``counts`` has one; its entry goes at ``last``."""
    n = counts.get(key)
    if n is None:
        return False
    if n <= last:
        del counts[key]
    else:
        counts[key] = n - 1
    return True
