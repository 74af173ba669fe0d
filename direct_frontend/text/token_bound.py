"""A lower bound on how many tokens a byte-level BPE makes of a text, read from its bytes.

A prompt too long for the model's context is refused before it is tokenized
when the bound already exceeds the context. The bound must never exceed the
real count, so it only uses facts of the vocabulary that hold for every
tokenization of every text:

- tokens partition the text's bytes (a byte-level BPE spells every byte, and
  no normalizer rewrites them), and each token is a vocabulary entry;
- so with a weight ``w(b) = 1 / L(b)`` per byte value, ``L(b)`` being the
  longest entry that contains ``b``, no token weighs more than 1, and the
  text's total weight is a lower bound on its tokens;
- and a pair of bytes that no entry contains side by side (in a byte-level
  BPE: a letter then a space, since pre-tokenization starts every word at its
  space) is always a boundary between two tokens: ``n`` such pairs mean at
  least ``n + 1`` tokens.

Both are counted by C loops over the text's UTF-8 bytes (``bytes.translate``,
``bytes.count`` and integer bit operations, a few passes), never per character
in Python.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

#: the bytes whose forbidden predecessors are counted (word ends before a space or a line break)
_SEPARATORS = (0x20, 0x0A)
#: byte weights are grouped under these longest-entry bounds (one counting pass per group)
_GROUP_BOUNDS = (2, 4, 8)
#: bytes counted per C call (≈ 0.05 ms each): a worker thread holds the GIL no longer, and
#: each pass's temporaries stay below the size from which the daemon has glibc map buffers
#: from the OS one by one (pipeline/tokenizing.py), which would add a map, its page faults
#: and an unmap to every pass (≈ 40 % more for passes of that size)
CHUNK = 64 << 10


@functools.lru_cache(maxsize=4)
def _low_bits(size: int) -> int:
    """The integer of ``size`` bytes that are each 1."""
    return int.from_bytes(b"\x01" * size, "big")


@dataclasses.dataclass(frozen=True, slots=True)
class ByteLevelBound:
    """The weights and forbidden pairs of one vocabulary; :meth:`fewest` applies them."""

    #: each byte's weight group (1, 2, ...): its value in the translated text
    groups: bytes
    #: the longest entry of each group (index 0 unused)
    longest: tuple[int, ...]
    #: 1 for a byte that no entry shows before a space or a line break, 2 for those two
    pairs: bytes

    @classmethod
    def of(cls, entries: Iterable[bytes]) -> ByteLevelBound | None:
        """The bound of a vocabulary given as each entry's bytes (added tokens included)."""
        longest = [0] * 256
        followed = bytearray(256)  # 1: some entry has b before a separator
        for entry in entries:
            size = len(entry)
            for b in set(entry):
                if longest[b] < size:
                    longest[b] = size
            if size > 1:
                for sep in _SEPARATORS:
                    at = entry.find(sep, 1)
                    while at != -1:
                        followed[entry[at - 1]] = 1
                        at = entry.find(sep, at + 1)
        top = max(longest)
        if top == 0:
            return None
        bounds = [*(g for g in _GROUP_BOUNDS if g < top), top]
        groups = bytes(next(i for i, high in enumerate(bounds, 1) if max(longest[b], 1) <= high)
                       for b in range(256))
        marks = bytearray(0 if followed[b] else 1 for b in range(256))
        for sep in _SEPARATORS:
            marks[sep] = 2  # never its own predecessor: counting fewer pairs stays sound
        return cls(groups, (0, *bounds), bytes(marks))

    def fewest(self, data: bytes, enough: int | None = None) -> int:
        """At least this many tokens make ``data`` (its UTF-8 bytes).

        Counted :data:`CHUNK` bytes at a time, so no one C call holds the GIL for
        more than a fraction of a millisecond (a pair split between two chunks is
        not counted: fewer pairs, still a lower bound). Each count only grows with
        each chunk, so counting stops once one reaches ``enough``: a prompt far
        beyond a context is proven so from its first part, by its pairs alone
        when it is prose (the cheaper count, so the first).
        """
        if not data:
            return 0
        goal = len(data) + 1 if enough is None else enough  # the bound never exceeds len
        chunks = range(0, len(data), CHUNK)
        forced = 0
        for at in chunks:
            forced += self._pairs(data[at : at + CHUNK])
            if forced + 1 >= goal:
                return forced + 1
        scale = math.lcm(*self.longest[1:])  # exact: the weights as integers over it
        *weights, (_, last_weight) = [(group, scale // high)
                                      for group, high in enumerate(self.longest) if group]
        weighted = 0
        for at in chunks:
            grouped = data[at : at + CHUNK].translate(self.groups)
            counts = [grouped.count(group) for group, _ in weights]  # the last group: the rest
            weighted += (sum(n * weight for n, (_, weight) in zip(counts, weights, strict=True))
                         + (len(grouped) - sum(counts)) * last_weight)
            if weighted // scale >= goal:
                break
        return max(weighted // scale, forced + 1)

    def _pairs(self, chunk: bytes) -> int:
        """The pairs in ``chunk``: a byte marked 1 before one marked 2 (marks in bits 0 and
        1). As one integer, bit 0 of each byte after a shift by a byte and by a bit: a
        2-byte ``bytes.count`` takes twice as long where most bytes are marked."""
        marks = int.from_bytes(chunk.translate(self.pairs), "big")
        return (marks >> 8 & marks >> 1 & _low_bits(len(chunk))).bit_count()
