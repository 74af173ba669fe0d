"""A block-granular prefix cache for the simulated engines (no I/O).

It makes ``cached_tokens`` real and prefill time proportional to the uncached
tokens, and produces the KV events a stock engine would publish:

- a prompt's full blocks are looked up from block 0; the leading run found is
  the hit (capped so at least one prompt token is computed, as vLLM and SGLang
  do); the rest are stored and announced;
- blocks that fill during decode are stored and announced as they fill;
- blocks held by running requests are pinned; finished requests' blocks stay
  cached and are evicted least-recently-used first (a request's tail before its
  head, as vLLM frees them), each eviction announced as a removal.

Block hashes are chained the way each engine kind chains them, and are only ids
for the router: ``sglang`` is SGLang 0.5.23's exact scheme (SHA-256 over the
previous digest and the page's LE u32 tokens, the first 8 bytes as a signed
int64, docs/kv-events.md §7.2); ``vllm`` is vLLM-like (SHA-256 chained from a fixed
root, published as the digest's low 64 bits, unsigned, or as the raw digest).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

from direct_frontend.simulator.multimodal import MediaKey, block_extra_keys

__all__ = [
    "CacheCleared",
    "CacheEvent",
    "HashStyle",
    "KvAllocation",
    "RemovedBlocks",
    "SimPrefixCache",
    "StoredRun",
]

HashStyle = Literal["vllm", "vllm-bytes", "sglang"]

_MASK64 = (1 << 64) - 1
_VLLM_ROOT = hashlib.sha256(b"vllm-none-hash").digest()


@dataclasses.dataclass(frozen=True, slots=True)
class StoredRun:
    """Consecutive new blocks: their wire hashes, the parent's (None at block 0), tokens."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    #: per block, the images' (hash, offset) pairs that key it (None: a text block)
    extra_keys: list[list[tuple[str, int]] | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """Evicted blocks' wire hashes."""

    block_hashes: list[int | bytes]


@dataclasses.dataclass(frozen=True, slots=True)
class CacheCleared:
    """The whole cache was dropped."""


CacheEvent: TypeAlias = StoredRun | RemovedBlocks | CacheCleared
EventSink = Callable[[list[CacheEvent]], object]


def _wire(style: HashStyle, digest: bytes) -> int | bytes:
    if style == "sglang":
        return int.from_bytes(digest[:8], "big", signed=True)
    if style == "vllm-bytes":
        return digest
    return int.from_bytes(digest, "big") & _MASK64


@dataclasses.dataclass(slots=True)
class _Block:
    wire: int | bytes
    refs: int = 0


@dataclasses.dataclass(eq=False, slots=True)
class KvAllocation:
    """One running request's view of the cache: its pinned blocks and its tokens."""

    epoch: int
    tokens: list[int]
    pinned: list[bytes]  # digests of the blocks this request holds, in prefix order
    last_digest: bytes | None  # the last full block's digest (cached or not)
    cached_tokens: int
    open: bool = True  # False once a block could not be cached: later ones cannot chain


class SimPrefixCache:
    """The prefix cache of one simulated engine; see the module docstring.

    ``sink`` receives each step's events (removals first, then stores), the
    way an engine publishes one batch per scheduler step.
    """

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        style: HashStyle,
        *,
        enabled: bool = True,
        sink: EventSink | None = None,
    ) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.style: HashStyle = style
        self.enabled = enabled
        self.sink = sink
        self.hits = 0  # blocks served from the cache
        self.evictions = 0
        self._blocks: dict[bytes, _Block] = {}
        self._free: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # LRU first
        self._epoch = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def digest(self, parent: bytes | None, tokens: Sequence[int],
               extra: Sequence[tuple[str, int]] | None = None) -> bytes:
        """The chained digest of one block (its images' keys in it, as vLLM hashes them)."""
        h = hashlib.sha256()
        if parent is not None:
            h.update(parent)
        elif self.style != "sglang":
            h.update(_VLLM_ROOT)
        h.update(array.array("I", tokens).tobytes())
        if extra:
            h.update(repr(list(extra)).encode())
        return h.digest()

    def wire_hashes(self, token_ids: Sequence[int]) -> list[int | bytes]:
        """The engine hashes of a token sequence's full blocks (for tests)."""
        out: list[int | bytes] = []
        parent: bytes | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.digest(parent, token_ids[start : start + bs])
            out.append(_wire(self.style, parent))
        return out

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens are cached now (uncapped, no side effects)."""
        parent: bytes | None = None
        bs = self.block_size
        n = 0
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.digest(parent, token_ids[start : start + bs])
            if parent not in self._blocks:
                break
            n += bs
        return n

    # -- a request's life ------------------------------------------------------

    def admit(self, prompt: Sequence[int], media: Sequence[MediaKey] = ()) -> KvAllocation:
        """Look the prompt up, pin the hit, store and announce its other full blocks.

        ``media``: the prompt's images, whose hashes key the blocks they fill.
        """
        alloc = KvAllocation(self._epoch, list(prompt), [], None, 0, open=self.enabled)
        if not self.enabled:
            return alloc
        bs = self.block_size
        digests: list[bytes] = []
        parent: bytes | None = None
        extras = block_extra_keys(media, bs, len(prompt) // bs)
        for i, start in enumerate(range(0, len(prompt) - bs + 1, bs)):
            parent = self.digest(parent, prompt[start : start + bs], extras[i])
            digests.append(parent)
        hit = 0
        for digest in digests:
            if digest not in self._blocks:
                break
            self._pin(digest, alloc)
            hit += 1
        self.hits += hit
        # At least one prompt token is always computed, as on the real engines.
        alloc.cached_tokens = min(hit * bs, (len(prompt) - 1) // bs * bs)
        events: list[CacheEvent] = []
        removed: list[int | bytes] = []
        run = self._new_run(digests[hit - 1] if hit else None)
        for i in range(hit, len(digests)):
            block = prompt[i * bs : (i + 1) * bs]
            run = self._store(alloc, digests[i], block, run, events, removed, extras[i])
        alloc.last_digest = digests[-1] if digests else None
        self._emit(removed, events, run)
        return alloc

    def extend(self, alloc: KvAllocation, token_id: int) -> None:
        """One more generated token; a block that fills is stored and announced."""
        alloc.tokens.append(token_id)
        bs = self.block_size
        if not alloc.open or alloc.epoch != self._epoch or len(alloc.tokens) % bs:
            return
        block = alloc.tokens[-bs:]
        digest = self.digest(alloc.last_digest, block)
        alloc.last_digest = digest
        events: list[CacheEvent] = []
        removed: list[int | bytes] = []
        parent = alloc.pinned[-1] if alloc.pinned else None
        run = self._new_run(parent)
        run = self._store(alloc, digest, block, run, events, removed)
        self._emit(removed, events, run)

    def release(self, alloc: KvAllocation) -> None:
        """The request ended: its blocks stay cached, tail first in eviction order."""
        if alloc.epoch != self._epoch:
            alloc.pinned.clear()
            return
        for digest in reversed(alloc.pinned):
            block = self._blocks.get(digest)
            if block is None:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._free[digest] = None
        alloc.pinned.clear()

    # -- whole-cache operations ------------------------------------------------

    def clear(self) -> None:
        """Drop every unpinned block and announce AllBlocksCleared (a prefix-cache reset)."""
        for digest in self._free:
            del self._blocks[digest]
        self._free.clear()
        if self.enabled and self.sink is not None:
            self.sink([CacheCleared()])

    def reset(self) -> None:
        """Forget everything silently: a new process starts with an empty cache."""
        self._blocks.clear()
        self._free.clear()
        self._epoch += 1  # running requests' allocations no longer refer to anything

    # -- internals -------------------------------------------------------------

    def _new_run(self, parent_digest: bytes | None) -> StoredRun:
        parent = None if parent_digest is None else self._blocks[parent_digest].wire
        return StoredRun([], parent, [], self.block_size)

    def _store(
        self,
        alloc: KvAllocation,
        digest: bytes,
        tokens: Sequence[int],
        run: StoredRun,
        events: list[CacheEvent],
        removed: list[int | bytes],
        extra: list[tuple[str, int]] | None = None,
    ) -> StoredRun:
        """Cache one new full block after ``run``'s; returns the run to continue."""
        if not alloc.open:
            return run
        block = self._blocks.get(digest)
        if block is not None:
            # Cached behind a missing block: reuse it silently, start a new run after it.
            self._pin(digest, alloc)
            if run.block_hashes:
                events.append(run)
            return StoredRun([], block.wire, [], self.block_size)
        if len(self._blocks) >= self.capacity_blocks:
            if not self._free:
                alloc.open = False  # every block is pinned: no room, and no chain after this
                return run
            victim, _ = self._free.popitem(last=False)
            removed.append(self._blocks.pop(victim).wire)
            self.evictions += 1
        wire = _wire(self.style, digest)
        self._blocks[digest] = _Block(wire)
        self._pin(digest, alloc)
        run.block_hashes.append(wire)
        run.token_ids.extend(tokens)
        run.extra_keys.append(extra)
        return run

    def _pin(self, digest: bytes, alloc: KvAllocation) -> None:
        block = self._blocks[digest]
        if block.refs == 0:
            self._free.pop(digest, None)
        block.refs += 1
        alloc.pinned.append(digest)

    def _emit(self, removed: list[int | bytes], events: list[CacheEvent], run: StoredRun) -> None:
        if run.block_hashes:
            events.append(run)
        if self.sink is None or not (removed or events):
            return
        batch: list[CacheEvent] = [RemovedBlocks(removed)] if removed else []
        batch.extend(events)
        self.sink(batch)
