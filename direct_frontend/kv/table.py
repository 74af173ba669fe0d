"""The KV index's shared table: prefix hash → bitmask of the holders that hold it (sans-IO).

A holder (an engine, or one rank of it) owns one bit, by slot. Lookup walks a
request's prefix hashes through the one table, one dict probe per matched
block whatever the number of holders. A holder's bit can be retired at once
(lookups stop seeing it) while its entries are swept from the table a bounded
amount at a time (:meth:`PrefixTable.sweep`), so dropping a big engine never
stalls the event loop; its slot is reused once swept.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

__all__ = ["COMPACT_MIN", "HASH_BYTES", "PrefixTable", "due_for_rebuild"]

HASH_BYTES: Final = sys.getsizeof(1 << 63)  # a hash as a Python int
COMPACT_MIN: Final = 4096  # smaller dicts are not worth rebuilding


def due_for_rebuild(size: int, peak: int) -> bool:
    """Whether a dict that held ``peak`` entries and holds ``size`` is worth rebuilding:
    CPython never shrinks a dict, so one mostly emptied keeps its peak's memory."""
    return peak > COMPACT_MIN and size < peak // 4


@dataclasses.dataclass(slots=True)
class _Grave:
    """A retired holder's slot: its bit is dead, its table entries still to sweep."""

    slot: int
    blocks: dict[int, int]  # the holder's entries (their values: the prefixes to sweep)
    hashes: Iterator[int]
    left: int


class PrefixTable:
    """Which holders hold each prefix; see the module docstring."""

    def __init__(self) -> None:
        self._table: dict[int, int] = {}
        self._peak = 0  # len(_table) when it was last rebuilt or grew
        self._names: list[str | None] = []  # by slot; a retired slot keeps its name until swept
        self._live = 0  # the bits of live holders: retired bits never match
        self._graveyard: collections.deque[_Grave] = collections.deque()

    # -- holders -----------------------------------------------------------

    def claim(self, name: str) -> int:
        """A free slot for a new holder ``name`` (its bit is ``1 << slot``), live at once."""
        try:
            slot = self._names.index(None)
        except ValueError:
            slot = len(self._names)
            self._names.append(None)
        self._names[slot] = name
        self._live |= 1 << slot
        return slot

    def retire(self, slot: int, blocks: dict[int, int]) -> None:
        """Stop seeing ``slot`` now; sweep its prefixes (``blocks``' values) later."""
        self._live &= ~(1 << slot)
        self._graveyard.append(_Grave(slot, blocks, iter(blocks.values()), len(blocks)))

    def release(self, slot: int) -> None:
        """``slot``'s holder is gone (it holds nothing): the slot is free for the next."""
        self._live &= ~(1 << slot)
        self._names[slot] = None

    # -- holding -----------------------------------------------------------

    def hold(self, hashes: Iterable[int], bit: int, aliases: dict[int, int]) -> None:
        """The holder of ``bit`` holds each of ``hashes`` (once more, where it already does).

        ``aliases`` counts the holder's extra holds of a prefix (two of its
        blocks with one prefix hash).
        """
        table = self._table
        hashes = hashes if isinstance(hashes, list | tuple) else list(hashes)
        masks = list(map(table.get, hashes, itertools.repeat(0)))
        if len(set(hashes)) == len(hashes) and not any(
                map(operator.and_, masks, itertools.repeat(bit))):
            # the usual store (a prompt's distinct prefixes, none held yet): in bulk, in C
            table.update(zip(hashes, map(operator.or_, masks, itertools.repeat(bit)),
                             strict=False))
        else:
            for h in hashes:
                mask = table.get(h, 0)
                if mask & bit:
                    aliases[h] = aliases.get(h, 0) + 1
                else:
                    table[h] = mask | bit
        if len(table) > self._peak:
            self._peak = len(table)

    def unhold(self, hashes: Iterable[int], bit: int,
               aliases: dict[int, int] | None = None) -> None:
        """The holder of ``bit`` lets go of each of ``hashes`` once; a prefix nobody holds goes.

        ``aliases``: the holder's extra holds (:meth:`hold`), let go of before its bit.
        """
        table = self._table
        keep = ~bit
        for h in hashes:
            if aliases and let_go_extra(aliases, h, 1):
                continue
            mask = table.get(h)
            if mask is None:
                continue
            mask &= keep
            if mask:
                table[h] = mask
            else:
                del table[h]

    def sweep(self, budget: int) -> int:
        """Sweep up to ``budget`` entries of retired holders from the table; returns how many."""
        done = 0
        graveyard = self._graveyard
        while graveyard and done < budget:
            grave = graveyard[0]
            swept = list(itertools.islice(grave.hashes, budget - done))
            self.unhold(swept, 1 << grave.slot)
            n = len(swept)
            grave.left -= n
            done += n
            if grave.left <= 0 or n == 0:
                graveyard.popleft()
                self._names[grave.slot] = None
                self.compact()
        return done

    def may_compact(self, removed: int) -> bool:
        """Whether :meth:`compact` could rebuild the table once up to ``removed`` more go."""
        return due_for_rebuild(len(self._table) - removed, self._peak)

    def compact(self) -> None:
        """Rebuild the table once removals left it mostly empty: CPython never shrinks a dict."""
        if self.may_compact(0):
            self._table = dict(self._table)
            self._peak = len(self._table)

    # -- lookup ------------------------------------------------------------

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading prefixes of ``hashes`` each live holder holds; holders with none are absent."""
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
        names = self._names
        while mask:
            low = mask & -mask
            name = names[low.bit_length() - 1]
            if name is not None:
                result[name] = depth
            mask ^= low

    # -- observation -------------------------------------------------------

    def __len__(self) -> int:
        return len(self._table)

    @property
    def sweeping(self) -> bool:
        """Whether retired holders' entries are still to sweep."""
        return bool(self._graveyard)

    def pending_sweep(self) -> int:
        """Entries of retired holders not yet swept."""
        return sum(grave.left for grave in self._graveyard)

    def bytes_estimate(self) -> int:
        """The table's and the retired holders' dicts, with their hash int objects."""
        size = sys.getsizeof(self._table) + len(self._table) * HASH_BYTES
        for grave in self._graveyard:
            size += sys.getsizeof(grave.blocks) + len(grave.blocks) * HASH_BYTES
        return size


def let_go_extra(counts: dict[int, int], key: int, last: int) -> bool:
    """Let go of one extra hold of ``key`` if ``counts`` has one; its entry goes at ``last``."""
    n = counts.get(key)
    if n is None:
        return False
    if n <= last:
        del counts[key]
    else:
        counts[key] = n - 1
    return True
