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

Both are counted by C loops over the text's UTF-8 bytes (``bytes.translate``
and ``bytes.count``, a few passes), never per character in Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

#: the bytes whose forbidden predecessors are counted (word ends before a space or a line break)
_SEPARATORS = (0x20, 0x0A)
#: byte weights are grouped under these longest-entry bounds (one counting pass per group)
_GROUP_BOUNDS = (2, 4, 8)
#: bytes counted per C call (≈ 0.2 ms each): a worker thread holds the GIL no longer
CHUNK = 256 << 10


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

    def fewest(self, data: bytes) -> int:
        """At least this many tokens make ``data`` (its UTF-8 bytes).

        Counted :data:`CHUNK` bytes at a time, so no one C call holds the GIL for
        more than a fraction of a millisecond (a pair split between two chunks is
        not counted: fewer pairs, still a lower bound).
        """
        if not data:
            return 0
        scale = math.lcm(*self.longest[1:])  # exact: the weights as integers over it
        weights = [(group, scale // high) for group, high in enumerate(self.longest) if group]
        weighted = forced = 0
        for at in range(0, len(data), CHUNK):
            chunk = data[at : at + CHUNK]
            grouped = chunk.translate(self.groups)
            weighted += sum(grouped.count(group) * weight for group, weight in weights)
            forced += chunk.translate(self.pairs).count(b"\x01\x02")
        return max(weighted // scale, forced + 1)
