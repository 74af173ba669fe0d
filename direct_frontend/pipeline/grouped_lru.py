"""A least-recently-used store of entries found by a key, several per key, bounded in bytes.

The prompt caches (pipeline/prompt_cache.py :class:`PrefixCache`,
pipeline/render_cache.py :class:`TurnCache`) keep what a conversation's next
turn can reuse. Many conversations share a key (their system prompt), so each
key holds a few entries, the oldest of a key leaving first beyond
``per_key``; beyond ``max_bytes`` in all (each entry's ``cost``), the least
recently used leaves. Entries are told apart by identity. Sans-IO.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

__all__ = ["Costed", "GroupedLru"]


class Costed(Protocol):
    @property
    def cost(self) -> int:
        """The bytes an entry is counted as."""
        ...


K = TypeVar("K", bound=Hashable)
E = TypeVar("E", bound=Costed)


class GroupedLru(Generic[K, E]):
    """Entries grouped by key (at most ``per_key`` each), at most ``max_bytes`` of them."""

    def __init__(self, max_bytes: int, per_key: int) -> None:
        self.max_bytes = max_bytes
        self.per_key = per_key
        self.size = 0  # the kept entries' costs
        self.hits = 0  # look-ups that found an entry (counted by the caches built on this)
        self.misses = 0
        self._lru: collections.OrderedDict[int, tuple[K, E]] = collections.OrderedDict()
        self._groups: dict[K, list[E]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def kept(self) -> Iterator[E]:
        """The kept entries, the least recently used first."""
        return (entry for _, entry in self._lru.values())

    def group(self, key: K) -> Sequence[E]:
        """The entries kept under ``key``, the oldest first."""
        return self._groups.get(key, ())

    def touch(self, entry: E) -> None:
        """``entry`` was used: it leaves last."""
        self._lru.move_to_end(id(entry))

    def keep(self, key: K, entry: E) -> None:
        """Keep ``entry`` under ``key``; the oldest of its key and the least recently used
        leave while over the bounds."""
        same = self._groups.setdefault(key, [])
        same.append(entry)
        self._lru[id(entry)] = (key, entry)
        self.size += entry.cost
        if len(same) > self.per_key:
            self.drop(same[0])
        while self.size > self.max_bytes and self._lru:
            self.drop(next(iter(self._lru.values()))[1])

    def drop(self, entry: E) -> None:
        """``entry`` leaves (nothing if it is not kept)."""
        kept = self._lru.pop(id(entry), None)
        if kept is None:
            return
        key = kept[0]
        self.size -= entry.cost
        same = self._groups[key]
        same.remove(entry)
        if not same:
            del self._groups[key]
