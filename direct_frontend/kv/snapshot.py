"""A KV index snapshot a replica hands a sibling that starts late (sans-IO).

Index keys name the local incarnation number, which means nothing to another
replica, so a snapshot names each rank by what every replica of one fleet
file agrees on: the engine's name, URL and KV-event endpoint. With each
rank's entries comes the seq of the next event its sender would have applied,
so the receiver continues the same stream from there (the tracker's
:meth:`~direct_frontend.kv.sequence.SequenceTracker.warm`) and is fenced by
the usual rules if the snapshot is stale.

The encoded form is msgpack with the hashes as packed little-endian u64
arrays (16 bytes a block); :func:`split` and :class:`Reassembly` cut it into
messages that fit a NATS payload and put it back together.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterator

import msgspec

__all__ = [
    "CHUNK_BYTES",
    "IndexSnapshot",
    "RankKey",
    "RankSnapshot",
    "Reassembly",
    "decode_snapshot",
    "encode_snapshot",
    "split",
]

#: well under NATS's default 1 MiB max_payload
CHUNK_BYTES = 512 * 1024

#: (engine name, url, KV-event endpoint, rank): a rank as every replica names it
RankKey = tuple[str, str, str, int]

if array.array("Q").itemsize != 8 or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("direct_frontend.kv.snapshot needs 8-byte little-endian array('Q')")


class RankSnapshot(msgspec.Struct, frozen=True):
    """One engine rank's entries, and where in its event stream they stand."""

    engine: str
    url: str
    endpoint: str
    rank: int
    next_seq: int
    engine_hashes: bytes  # u64 LE, parallel to prefix_hashes
    prefix_hashes: bytes
    copies: list[tuple[int, int]] = []

    @property
    def key(self) -> RankKey:
        return (self.engine, self.url, self.endpoint, self.rank)

    @classmethod
    def of(
        cls, key: RankKey, next_seq: int, blocks: dict[int, int], copies: dict[int, int]
    ) -> RankSnapshot:
        engine, url, endpoint, rank = key
        return cls(
            engine, url, endpoint, rank, next_seq,
            array.array("Q", blocks.keys()).tobytes(),
            array.array("Q", blocks.values()).tobytes(),
            sorted(copies.items()),
        )  # fmt: skip

    def blocks(self) -> Iterator[tuple[int, int]]:
        """(engine hash, prefix hash) pairs; a malformed snapshot raises ValueError."""
        engine_hashes = array.array("Q")
        prefix_hashes = array.array("Q")
        engine_hashes.frombytes(self.engine_hashes)
        prefix_hashes.frombytes(self.prefix_hashes)
        if len(engine_hashes) != len(prefix_hashes):
            raise ValueError("engine and prefix hashes differ in number")
        return zip(engine_hashes, prefix_hashes, strict=True)

    def __len__(self) -> int:
        return len(self.engine_hashes) // 8


class IndexSnapshot(msgspec.Struct, frozen=True):
    """What one replica's index holds of every rank it follows live."""

    replica: str
    block_size: int
    ranks: list[RankSnapshot] = []


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexSnapshot)


def encode_snapshot(snapshot: IndexSnapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode_snapshot(data: bytes) -> IndexSnapshot:
    """The snapshot; a payload that is not one raises ``msgspec.DecodeError``/``ValueError``."""
    return _decoder.decode(data)


def split(data: bytes, size: int = CHUNK_BYTES) -> list[bytes]:
    """``data`` as chunks, each prefixed by its number and the count (u32 LE each)."""
    pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    count = len(pieces)
    return [
        index.to_bytes(4, "little") + count.to_bytes(4, "little") + piece
        for index, piece in enumerate(pieces)
    ]


class Reassembly:
    """Collects the chunks of one snapshot (in any order); :attr:`done` when all are in."""

    def __init__(self) -> None:
        self._pieces: dict[int, bytes] = {}
        self._count: int | None = None

    def add(self, chunk: bytes) -> None:
        if len(chunk) < 8:
            raise ValueError("a snapshot chunk shorter than its header")
        index = int.from_bytes(chunk[:4], "little")
        count = int.from_bytes(chunk[4:8], "little")
        if self._count is None:
            self._count = count
        if count != self._count or index >= count:
            raise ValueError("a snapshot chunk that does not belong to this snapshot")
        self._pieces[index] = chunk[8:]

    @property
    def done(self) -> bool:
        return self._count is not None and len(self._pieces) == self._count

    def data(self) -> bytes:
        assert self.done
        return b"".join(self._pieces[i] for i in range(len(self._pieces)))

