"""A tally of block hashes that several requests hold at once (a multiset in a dict).

A hash is present while at least one request holds it and goes with the last,
so ``h in counts`` answers "does anyone hold it" with one probe. A request's
block hashes are distinct (they chain), so each step is a few bulk passes in C;
hashes that repeat take a step each.
"""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Sequence

__all__ = ["add_all", "remove_all"]


def add_all(counts: dict[int, int], hashes: Sequence[int]) -> None:
    """One more hold of each of ``hashes``."""
    if len(set(hashes)) != len(hashes):
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1
        return
    held = list(map(counts.get, hashes, itertools.repeat(0)))
    counts.update(zip(hashes, map(operator.add, held, itertools.repeat(1)), strict=True))


def remove_all(counts: dict[int, int], hashes: Sequence[int]) -> None:
    """One hold fewer of each of ``hashes`` (each held); a hash nobody holds any more goes."""
    if len(set(hashes)) != len(hashes):
        for h in hashes:
            left = counts[h] - 1
            if left:
                counts[h] = left
            else:
                del counts[h]
        return
    remaining = list(map(operator.sub, map(counts.__getitem__, hashes), itertools.repeat(1)))
    counts.update(zip(hashes, remaining, strict=True))
    collections.deque(map(counts.__delitem__, itertools.compress(
        hashes, map(operator.not_, remaining))), maxlen=0)
