"""A generate request's prompt ids, encoded from their u32 bytes straight into the request.

Every contract holds a prompt's ids in a packed ``repeated uint32`` of its
``tokenized`` message. Filled from Python ints, protobuf converts each id
(≈ 15 ns) and then encodes it again; :class:`~direct_frontend.text.prompt_ids.PromptIds`
hold their ids as u32 bytes instead, which NumPy turns into the packed varints
in a few vectorised passes (≈ 5–8 ns an id), never making an int (below
:data:`PACKED_MIN_IDS` ids the list is filled: NumPy's fixed cost is more). Such a
request's own list stays empty: :func:`encode_request` puts the ids' message
before the request's encoding, and a protobuf parser merges the two
occurrences of the ``tokenized`` field into one message (its text from the
second, its ids from the first), the same message as one filled in place.

A conversation's next prompt begins with the last one's ids: the encoding of
those is kept with them (``PromptIds.encoded``, in pieces), so only the ids
that follow are encoded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from direct_frontend.text.prompt_ids import PromptIds, Runs, u32_ids

#: a kept encoding is in at most this many pieces (the oldest are joined into one)
RUNS_MAX_PIECES: Final = 16
#: fewer ids go into the request's list as ints: NumPy's dozen calls cost ≈ 15–20 µs however
#: few the ids, protobuf's conversion ≈ 20 ns an id (the two cross near 1,000 ids)
PACKED_MIN_IDS: Final = 768

#: protobuf's wire type of a length-delimited field (a packed run, a message)
_LEN: Final = 2


@dataclasses.dataclass(frozen=True, slots=True)
class IdRuns:
    """A generate request's prompt ids, held encoded rather than in its list.

    ``pieces``: the ids' packed varints, in order; the request's ``sub`` message
    holds them in its field numbered ``field_number``.
    """

    field_number: int
    pieces: tuple[bytes, ...]
    #: the request's field that holds the ids' message (every contract's)
    sub: str = "tokenized"


def varint(value: int) -> bytes:
    """One unsigned protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def packed_varints(raw: bytes | memoryview) -> bytes:
    """The packed varints of the little-endian u32 ids ``raw`` holds, vectorised.

    Ids below 2**21 (every vocabulary in use) take at most three bytes: each
    id's bytes are spread into a u32 with their continuation bits set, and
    the bytes each id does not use are dropped in one pass. Larger ids take
    the general path (up to five bytes, in a u64).
    """
    ids = np.frombuffer(raw, dtype="<u4")
    if not ids.size:
        return b""
    if (ids >= 1 << 21).any():
        return _packed_wide(ids)
    two = ids >= 0x80
    three = ids >= 0x4000
    spread = (ids & 0x7F) | ((ids & 0x3F80) << 1) | ((ids & 0x1FC000) << 2)
    spread |= two.astype(np.uint32) << 7
    spread |= three.astype(np.uint32) << 15
    used = np.zeros((ids.size, 4), dtype=bool)
    used[:, 0] = True
    used[:, 1] = two
    used[:, 2] = three
    out: bytes = np.compress(used.ravel(), spread.astype("<u4", copy=False).view(np.uint8)
                             ).tobytes()
    return out


def _packed_wide(ids: np.ndarray[Any, np.dtype[np.uint32]]) -> bytes:
    """:func:`packed_varints` for ids of up to 32 bits: five 7-bit groups in a u64."""
    wide = ids.astype(np.uint64)
    spread = np.zeros(ids.size, dtype=np.uint64)
    used = np.zeros((ids.size, 8), dtype=bool)
    used[:, 0] = True
    for k in range(5):
        group = (wide >> np.uint64(7 * k)) & np.uint64(0x7F)
        spread |= group << np.uint64(8 * k)
        if k:
            more = wide >= np.uint64(1 << (7 * k))
            used[:, k] = more
            spread |= more.astype(np.uint64) << np.uint64(8 * k - 1)
    out: bytes = np.compress(used.ravel(), spread.astype("<u8", copy=False).view(np.uint8)
                             ).tobytes()
    return out


def _bounded(runs: Runs) -> Runs:
    """``runs`` in at most :data:`RUNS_MAX_PIECES` pieces: beyond, the oldest are joined into
    one, leaving half as many (a copy of the oldest every so many turns, not every turn)."""
    if len(runs) <= RUNS_MAX_PIECES:
        return runs
    cut = len(runs) - RUNS_MAX_PIECES // 2 + 1
    return ((runs[cut - 1][0], b"".join(piece for _, piece in runs[:cut])), *runs[cut:])


def _shared(ids: PromptIds) -> Runs:
    """The encoding of ``ids``' first ``known`` ids: the pieces of the earlier prompt's kept
    encoding that end within them, and the rest of them encoded now."""
    known = ids.known
    kept = ids.take_encoded_source() or ()
    whole = tuple(piece for piece in kept if piece[0] <= known)
    done = whole[-1][0] if whole else 0
    if done == known:
        return whole
    return (*whole, (known, packed_varints(memoryview(ids.raw)[4 * done:4 * known])))


def fill_prompt(tokenized: Any, field: str, text: str, ids: Sequence[int]) -> IdRuns | None:
    """Set a contract's tokenized input (``tokenized``, built in place) to ``text`` and ``ids``
    (its repeated ``field``); for :class:`PromptIds` of :data:`PACKED_MIN_IDS` or more, the
    :class:`IdRuns` that hold the ids instead (the message's list stays empty:
    :func:`encode_request` puts them in).

    Ids that begin with an earlier prompt's (a conversation's next turn:
    ``PromptIds`` that know their shared prefix) take the encoding of that
    prefix from the earlier prompt's, so only the new ids are encoded; where
    these ids keep their encoding (for the next turn's), it is kept, in pieces.
    """
    tokenized.original_text = text
    tokenized.SetInParent()  # (present even when empty, as when set from a dict)
    if not isinstance(ids, PromptIds):
        getattr(tokenized, field).extend(ids)
        return None
    if len(ids) < PACKED_MIN_IDS:
        getattr(tokenized, field).extend(u32_ids(ids.raw))
        return None
    number = tokenized.DESCRIPTOR.fields_by_name[field].number
    if ids.encoded and ids.encoded[-1][0] == len(ids):  # built before (another attempt)
        return IdRuns(number, tuple(piece for _, piece in ids.encoded))
    shared: Runs = _shared(ids) if ids.known else ()
    start = shared[-1][0] if shared else 0
    runs = shared
    if start < len(ids):
        runs = (*shared, (len(ids), packed_varints(memoryview(ids.raw)[4 * start:])))
    runs = _bounded(runs)
    if ids.encoded is not None:
        ids.encoded = runs
    return IdRuns(number, tuple(piece for _, piece in runs))


def encode_request(request: Any, runs: IdRuns | None) -> bytes:
    """``request`` encoded; with ``runs``, its prompt ids put in from their encoding.

    The ids' message goes first, holding the ids alone (one packed run), then
    the request's own encoding, whose message of the same field holds the
    text: a parser merges the two into one message.
    """
    data: bytes = request.SerializeToString()
    if runs is None:
        return data
    size = sum(map(len, runs.pieces))
    if not size:
        return data
    inner = (varint(runs.field_number << 3 | _LEN), varint(size), *runs.pieces)
    number = request.DESCRIPTOR.fields_by_name[runs.sub].number
    inner_size = sum(map(len, inner))
    return b"".join((varint(number << 3 | _LEN), varint(inner_size), *inner, data))
