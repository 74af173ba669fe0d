"""A modelled engine whose prefix cache is the simulated engines' own (``SimPrefixCache``).

The live bench's engines (``bench_routing.py engine``) run
:class:`~direct_frontend.simulator.kvcache.SimPrefixCache`: pages of the
engine's own size (SGLang's default of one token included), a hard capacity
(a request whose next page finds every page pinned stores nothing more: its
later pages cannot chain), a prompt looked up and stored the moment the
engine takes it (before its first step), the answer's pages stored as
decoding fills them, and each batch of stores and removals published as KV
events. :class:`CachedEngine` plays that cache, unchanged, inside the model's
steps (:class:`routing_model.ModelEngine`), and turns its events into the
router's (``direct_frontend.kv.events``, as the daemon's subscriber does), so
the router's index re-cuts finer pages into its blocks exactly as it does
live. The grid (``routing_sim.py``) keeps its own LRU of router blocks.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from routing_model import ModelEngine, Request

from direct_frontend.kv.events import BlockRemoved, BlockStored
from direct_frontend.simulator.kvcache import (
    CacheEvent,
    KvAllocation,
    RemovedBlocks,
    SimPrefixCache,
    StoredRun,
)
from direct_frontend.simulator.steps import Seat

if TYPE_CHECKING:
    from routing_sim import Point


class _Cache(SimPrefixCache):
    """The simulated engines' cache with a cheaper page id (64 bits of Python's tuple hash).

    A page's digest only names it (the router's index hashes the token ids
    itself); SHA-256 per page of one token made the model five times slower.
    """

    def digest(self, parent: bytes | None, tokens: Sequence[int],
               extra: Sequence[tuple[str, int]] | None = None) -> bytes:
        return (hash((parent, *tokens, *(extra or ()))) & _MASK).to_bytes(8, "big")


_MASK = (1 << 64) - 1


class CachedEngine(ModelEngine):
    """:class:`ModelEngine` with the simulated engines' prefix cache (see the module)."""

    def __init__(self, point: Point, number: int, publish: Callable[[str, Any], None],
                 page_size: int, capacity_tokens: int) -> None:
        super().__init__(point, number, publish)
        self.page_size = page_size
        # wire hashes as the live bench's engines (SGLang's contract) publish them
        self.cache = _Cache(max(1, capacity_tokens // page_size), page_size, "sglang",
                                    sink=self._events)
        #: each running request's pages, and how many of its answer tokens they hold
        self.allocs: dict[Seat, tuple[KvAllocation, list[int]]] = {}

    def _events(self, batch: Sequence[CacheEvent]) -> None:
        """One batch of the cache's events, as the router's index receives them."""
        for event in batch:
            if isinstance(event, StoredRun):
                self.publish(self.key, BlockStored(
                    block_hashes=tuple(event.block_hashes),  # type: ignore[arg-type]
                    parent_block_hash=event.parent_block_hash,  # type: ignore[arg-type]
                    token_ids=array.array("I", event.token_ids),
                    block_size=event.block_size, medium="GPU"))
            elif isinstance(event, RemovedBlocks):
                self.evictions += len(event.block_hashes)
                self.publish(self.key, BlockRemoved(
                    tuple(event.block_hashes), medium="GPU"))  # type: ignore[arg-type]

    def arrive(self, request: Request) -> None:
        """Taken at once when a batch slot is free: looked up and stored before any step."""
        super().arrive(request)
        self.admit()

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.point.max_running:
            request = self.waiting.popleft()
            alloc = self.cache.admit(request.tokens)
            request.cached_tokens = alloc.cached_tokens
            seat = self.steps.admit(len(request.tokens) - alloc.cached_tokens,
                                    len(request.answer))
            self.running[seat] = request
            self.allocs[seat] = (alloc, [0])

    def _generated(self, seat: Seat) -> None:
        """The answer tokens the steps gave ``seat`` so far, into its pages."""
        alloc, done = self.allocs[seat]
        answer = self.running[seat].answer
        for token in answer[done[0]:seat.given]:
            self.cache.extend(alloc, token)
        done[0] = max(done[0], min(seat.given, len(answer)))

    def finish_step(self) -> tuple[list[Request], list[Request]]:
        steps = self.steps
        self.step_end = None
        prefilled = list(itertools.takewhile(lambda seat: seat.left <= 0, steps.prefilling))
        steps.finish(self.decoded)
        for seat in (*self.decoded, *prefilled):
            self._generated(seat)
        ended = [seat for seat in (*self.decoded, *prefilled) if seat.given >= seat.wanted]
        first = [self.running[seat] for seat in prefilled]
        done = []
        for seat in ended:
            steps.leave(seat)
            alloc, _ = self.allocs.pop(seat)
            self.cache.release(alloc)
            done.append(self.running.pop(seat))
        return first, done
