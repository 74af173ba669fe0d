"""Events of an engine whose KV page size is not ours, re-cut into our blocks (sans-IO).

The index matches requests in blocks of one size (``block_size``), but an
engine publishes pages of its own: SGLang's default page is one token (one
stored page per token), vLLM's block is 16. Rather than drop such an engine,
its pages are re-cut:

- **finer pages** (our block is ``k`` pages): pages are remembered along their
  chain until ``k`` of them complete one of our blocks, which is then stored
  under the engine hash of its last page, its parent the previous completed
  block's. A radix cache branches anywhere, also inside one of our blocks, so
  every page keeps its own tokens until it is removed (memory: one small entry
  per page). Removing a block's last page removes the block; a radix cache
  evicts leaves first, so a page inside a block goes after the block's end did.
- **coarser pages** (a page is ``m`` of our blocks): each page becomes ``m``
  blocks with ids derived from the page hash; its removal removes all ``m``.
  This costs nothing to index, but the engine reuses (and evicts) whole pages
  only: a shared prefix is worth only its full pages to it, while the index
  matches in our blocks, so a prediction can exceed the engine's hit by less
  than a page.

Page sizes that neither divide nor are a multiple of ours cannot be re-cut
(:func:`compatible` says so); such stores are skipped by the index.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from direct_frontend.kv.events import MASK64, BlockRemoved, BlockStored


def compatible(page_size: int, block_size: int) -> bool:
    """Whether an engine's pages can be re-cut into our blocks."""
    return page_size > 0 and (block_size % page_size == 0 or page_size % block_size == 0)


@dataclasses.dataclass(slots=True)
class _Page:
    parent: int | None  # the previous page of the chain (None: the chain's first)
    tokens: bytes
    extra: Any
    depth: int  # pages since the last completed block, this one included (1..k)
    anchor: int | None  # the last completed block before this page (its last page's hash)


class Regrouper:
    """One engine rank's pages of ``page_size`` tokens as events of ``block_size`` blocks."""

    def __init__(self, page_size: int, block_size: int) -> None:
        if not compatible(page_size, block_size):
            raise ValueError(f"pages of {page_size} cannot be re-cut into blocks of {block_size}")
        self.page_size = page_size
        self.block_size = block_size
        self._pages: dict[int, _Page] = {}
        self.unplaced = 0  # stores whose parent page we never saw

    def __len__(self) -> int:
        return len(self._pages)

    def stored(self, event: BlockStored) -> list[BlockStored]:
        """The blocks of ours that ``event``'s pages complete (none, one or several)."""
        if self.page_size > self.block_size:
            return [self._split(event)]
        return self._join(event)

    def removed(self, event: BlockRemoved) -> BlockRemoved | None:
        """Our blocks that ``event``'s page removals take away (None: none)."""
        if self.page_size > self.block_size:
            return msgspec.structs.replace(
                event, block_hashes=tuple(h for page in event.block_hashes
                                          for h in self._parts(page))
            )
        k = self.block_size // self.page_size
        gone = []
        for page in event.block_hashes:
            entry = self._pages.pop(page, None)
            if entry is not None and entry.depth == k:
                gone.append(page)
        return msgspec.structs.replace(event, block_hashes=tuple(gone)) if gone else None

    def clear(self) -> None:
        self._pages = {}

    # -- finer pages -------------------------------------------------------

    def _join(self, event: BlockStored) -> list[BlockStored]:
        k = self.block_size // self.page_size
        step = self.page_size * 4
        data = event.token_ids.tobytes()
        extras = event.extra_keys
        pages = self._pages
        parent = event.parent_block_hash
        if parent is None:
            depth, anchor = 0, None
        else:
            known = pages.get(parent)
            if known is None:
                self.unplaced += 1
                return []
            depth, anchor = known.depth, known.anchor
            if depth == k:
                depth, anchor = 0, parent
        first_anchor = anchor
        done: list[int] = []
        for i, page in enumerate(event.block_hashes):
            depth += 1
            extra = extras[i] if extras is not None and i < len(extras) else None
            pages[page] = _Page(parent, data[i * step : (i + 1) * step], extra, depth, anchor)
            parent = page
            if depth == k:
                done.append(page)
                depth, anchor = 0, page
        tokens = array.array("I")
        block_extras: list[Any] = []
        complete: list[int] = []
        for last in done:
            chunk = self._chunk(last, k)
            if chunk is None:  # a page inside it was removed before its end was stored
                self.unplaced += 1
                break
            for entry in reversed(chunk):
                tokens.frombytes(entry.tokens)
            own = [entry.extra for entry in reversed(chunk) if entry.extra is not None]
            block_extras.append(own or None)
            complete.append(last)
        if not complete:
            return []
        return [msgspec.structs.replace(
            event, block_hashes=tuple(complete), parent_block_hash=first_anchor, token_ids=tokens,
            block_size=self.block_size,
            extra_keys=tuple(block_extras) if any(block_extras) else None,
            cache_salt=event.cache_salt if first_anchor is None else None,
        )]

    def _chunk(self, last: int, k: int) -> list[_Page] | None:
        """The ``k`` pages of the block ending at page ``last``, last first (None: a gap)."""
        out = []
        page: int | None = last
        for _ in range(k):
            entry = self._pages.get(page) if page is not None else None
            if entry is None:
                return None
            out.append(entry)
            page = entry.parent
        return out

    # -- coarser pages -----------------------------------------------------

    def _parts(self, page: int) -> Sequence[int]:
        m = self.page_size // self.block_size
        return [xxhash.xxh3_64_intdigest(page.to_bytes(8, "little"), j) & MASK64
                for j in range(m)]

    def _split(self, event: BlockStored) -> BlockStored:
        m = self.page_size // self.block_size
        parent = event.parent_block_hash
        extras = event.extra_keys
        return msgspec.structs.replace(
            event,
            block_hashes=tuple(h for page in event.block_hashes for h in self._parts(page)),
            parent_block_hash=None if parent is None else self._parts(parent)[-1],
            block_size=self.block_size,
            extra_keys=None if extras is None else tuple(
                extras[i] if i < len(extras) else None
                for i in range(len(event.block_hashes)) for _ in range(m)
            ),
        )
