"""The messages replicas send each other over NATS, and their subjects (sans-IO).

msgspec msgpack, one struct per subject. Every message names its sender, so
a replica ignores its own and a peer's word is matched to that peer. Loads
are state, not deltas (the whole per-engine table each time, numbered), so a
lost or reordered message costs nothing once the next arrives and a link
that comes back resyncs by itself.
"""

from __future__ import annotations

import array
from typing import Any, TypeVar

import msgspec

from direct_frontend.errors import EngineError, ErrorKind


class LoadReport(msgspec.Struct, frozen=True):
    """A replica's in-flight requests and blocks (packed u64) per engine name.

    ``leaving``: its last word (its load goes at once).
    """

    replica: str
    seq: int
    loads: dict[str, tuple[int, bytes]]
    leaving: bool = False

    @classmethod
    def of(cls, replica: str, seq: int, loads: dict[str, tuple[int, frozenset[int]]],
           *, leaving: bool = False) -> LoadReport:
        packed = {name: (requests, _pack(blocks)) for name, (requests, blocks) in loads.items()}
        return cls(replica, seq, packed, leaving)

    def unpacked(self) -> dict[str, tuple[int, frozenset[int]]]:
        return {name: (requests, frozenset(_unpack(blocks)))
                for name, (requests, blocks) in self.loads.items()}


class FaultReport(msgspec.Struct, frozen=True):
    """A transport fault one replica's request saw on an engine."""

    replica: str
    engine: str
    url: str
    kind: str
    message: str

    @classmethod
    def of(cls, replica: str, engine: str, url: str, error: EngineError) -> FaultReport:
        return cls(replica, engine, url, error.kind.value, error.message)

    def error(self) -> EngineError | None:
        """The fault as ours to act on; None for a kind that does not take an engine down."""
        try:
            kind = ErrorKind(self.kind)
        except ValueError:
            return None
        if not kind.engine_is_down:
            return None
        return EngineError(kind, f"seen by replica {self.replica}: {self.message}",
                           engine=self.engine)


class Placements(msgspec.Struct, frozen=True):
    """Approximate-mode placements: (engine name, its prefix hashes as packed u64)."""

    replica: str
    placed: list[tuple[str, bytes]]

    @classmethod
    def of(cls, replica: str, placed: list[tuple[str, tuple[int, ...]]]) -> Placements:
        return cls(replica, [(name, _pack(hashes)) for name, hashes in placed])

    def each(self) -> list[tuple[str, list[int]]]:
        return [(name, _unpack(packed)) for name, packed in self.placed]


class ResponseQuery(msgspec.Struct, frozen=True):
    """Asks the replica that holds a stored response for it (``get``), to drop it
    (``delete``) or to cancel it (``cancel``, a background response).

    To ``get`` it answers ``ok`` and sends the record (openai/response_store.py
    ``encode_record``) to ``inbox`` in chunks (kv/snapshot.py ``split``), or
    answers empty: not held. To ``delete``, ``1`` or ``0``. To ``cancel``, once the
    response has ended, ``cancelled`` or ``not_background``; empty: not held.
    ``owner`` is who asks (http/identity.py): another owner's response is not
    held, as at home.
    """

    replica: str
    op: str
    id: str
    inbox: str = ""
    owner: str = ""


def _pack(hashes: tuple[int, ...] | frozenset[int]) -> bytes:
    return array.array("Q", hashes).tobytes()


def _unpack(packed: bytes) -> list[int]:
    """Packed u64s; a ragged tail (a malformed message) is dropped."""
    hashes = array.array("Q")
    hashes.frombytes(packed[: len(packed) // 8 * 8])
    return hashes.tolist()


Message = LoadReport | FaultReport | Placements | ResponseQuery

M = TypeVar("M", LoadReport, FaultReport, Placements, ResponseQuery)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(kind)
    for kind in (LoadReport, FaultReport, Placements, ResponseQuery)
}


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(kind: type[M], data: bytes) -> M | None:
    """The message, or None if ``data`` is not one (counted and skipped by the caller)."""
    try:
        message: M = _decoders[kind].decode(data)
    except (msgspec.DecodeError, ValueError):
        return None
    return message


class Subjects:
    """The NATS subjects of one cluster of replicas (``[frontend.replicas] cluster``)."""

    def __init__(self, cluster: str) -> None:
        self.load = f"{cluster}.load"
        self.fault = f"{cluster}.fault"
        self.placements = f"{cluster}.placements"
        self.snapshot = f"{cluster}.kv-snapshot"
        self._responses = f"{cluster}.responses."

    def responses(self, holder: str) -> str:
        """Where the replica whose response ids carry ``holder`` answers for them."""
        return self._responses + holder
