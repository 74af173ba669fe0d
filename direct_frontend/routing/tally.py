"""A tally of block hashes that several requests hold at once (a multiset in a dict).

A hash is present while at least one request holds it and goes with the last,
so ``h in counts`` answers "does anyone hold it" with one probe.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["add_all", "remove_all"]


def add_all(counts: dict[int, int], hashes: Iterable[int]) -> None:
    """One more hold of each of ``hashes``."""
    for h in hashes:
        counts[h] = counts.get(h, 0) + 1


def remove_all(counts: dict[int, int], hashes: Iterable[int]) -> None:
    """One hold fewer of each of ``hashes`` (each held); a hash nobody holds any more goes."""
    for h in hashes:
        left = counts[h] - 1
        if left:
            counts[h] = left
        else:
            del counts[h]
