"""A prompt's token ids held as u32 bytes, as the tokenizer gives them (sans-IO).

Kept with them: what the layers above derive from the ids once and reuse for
the prompts built from them (a conversation's next turn): their KV block hash
chains (kv/prefix.py) and their encoding for the engine request
(engines/dialects/ids.py).
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, overload

__all__ = ["PromptIds", "Runs", "u32_bytes", "u32_ids"]

#: ids are held little-endian, as fastokens writes them and as block hashes read them
#: (kv/prefix.py); ``array`` writes this machine's order
_SWAP: Final = sys.byteorder == "big"


#: a kept encoding of ids in pieces: (ids from the start to this piece's end, the piece),
#: each piece the packed varints of its ids (a protobuf ``repeated uint32`` run's payload)
Runs = tuple[tuple[int, bytes], ...]


def u32_ids(data: bytes | memoryview) -> array.array[int]:
    """Ids held as little-endian u32 bytes, as an array."""
    out = array.array("I")
    out.frombytes(data)
    if _SWAP:
        out.byteswap()
    return out


def u32_bytes(ids: Iterable[int]) -> bytes:
    """Ids (ints) as little-endian u32 bytes."""
    out = array.array("I", ids)
    if _SWAP:
        out.byteswap()
    return out.tobytes()


class PromptIds(Sequence[int]):
    """A prompt's token ids, held as little-endian u32 bytes (``raw``), that remember their
    prefix hashes and whose they share.

    The ids are not held as Python ints: a long prompt's ids are hashed
    (kv/prefix.py ``prefix_hashes``), counted and encoded into the engine request
    (engines/dialects/ids.py) from these bytes, and each of those would
    otherwise cost a pass of per-int work (≈ 15 ns an id, 18k ids a prompt).
    Reading an id, or iterating, converts on demand; a slice is a tuple of its
    ids alone, and adding gives a tuple, so callers see a plain sequence (equal to,
    and hashed as, the tuple of its ids). It is no tuple, though: an encoder that
    takes tuples (msgspec, JSON) takes ``tuple(ids)``.

    ``source`` is the chains of an earlier prompt whose first ``known`` ids these
    ids begin with (the prompt cache knows, having built these ids from those);
    ``prefix_hashes`` takes the blocks within ``known`` from there instead of
    hashing them again, and keeps what it computes in ``chains`` for the prompts
    built from this one.

    ``encoded``: the packed varints of these ids, in pieces (:data:`Runs`), kept
    for the prompts built from this one, whose engine requests take the pieces
    within their ``known`` ids from ``encoded_source`` (the earlier prompt's
    ``encoded``) instead of encoding them again; None where no prompt will be
    built from these ids (they are not kept for a conversation's next turn).
    """

    __slots__ = ("chains", "encoded", "encoded_source", "known", "raw", "source")

    raw: bytes
    chains: dict[tuple[int, int, str | None], tuple[int, ...]]
    source: dict[tuple[int, int, str | None], tuple[int, ...]] | None
    known: int
    encoded: Runs | None
    encoded_source: Runs | None

    def __init__(self, ids: bytes | bytearray | memoryview | Iterable[int],
                 source: dict[tuple[int, int, str | None], tuple[int, ...]] | None = None,
                 known: int = 0, *, encoded_source: Runs | None = None,
                 keep_encoded: bool = False) -> None:
        """``ids``: little-endian u32 bytes (as the tokenizer gives them), or ints."""
        raw = (bytes(ids) if isinstance(ids, (bytes, bytearray, memoryview))
               else u32_bytes(ids))
        if len(raw) % 4:
            raise ValueError("prompt ids as bytes are whole u32s: a length divisible by 4")
        if not 0 <= known <= len(raw) >> 2:
            raise ValueError(f"{known} known ids of {len(raw) >> 2}")
        self.raw = raw
        self.chains = {}
        self.source = source
        self.known = known if source is not None else 0
        self.encoded = () if keep_encoded else None
        self.encoded_source = encoded_source if self.known else None

    def __len__(self) -> int:
        return len(self.raw) >> 2

    def ints(self) -> tuple[int, ...]:
        """Every id, as ints (one pass; not kept)."""
        return tuple(u32_ids(self.raw))

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self.ints()[index]
            return tuple(u32_ids(self.raw[4 * start:4 * stop])) if stop > start else ()
        n = len(self)
        at = index + n if index < 0 else index
        if not 0 <= at < n:
            raise IndexError("prompt id index out of range")
        value: int = _U32.unpack_from(self.raw, 4 * at)[0]
        return value

    def __iter__(self) -> Iterator[int]:
        return iter(u32_ids(self.raw))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds):
            return self.raw == other.raw
        if isinstance(other, tuple):
            return len(other) == len(self) and self.ints() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ints())  # (equal to a tuple of the same ids, so hashed as one)

    def __add__(self, other: Sequence[int]) -> tuple[int, ...]:
        return self.ints() + tuple(other)

    def __radd__(self, other: Sequence[int]) -> tuple[int, ...]:
        return tuple(other) + self.ints()

    def __repr__(self) -> str:
        return f"PromptIds({self.ints()!r})"

    def take_encoded_source(self) -> Runs | None:
        """``encoded_source``, let go of: once used, the earlier prompt's encoding is not held
        alive by this one (the prefix cache's room counts only its kept entries')."""
        source, self.encoded_source = self.encoded_source, None
        return source


_U32: Final = struct.Struct("<I")
