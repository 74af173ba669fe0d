"""Decoding of the KV-cache events stock engines publish over ZeroMQ (sans-IO).

One decoder for every layout vLLM and SGLang put on the wire (docs/kv-events.md
§3–§7): a batch is a 3- or 2-element msgpack array ``[ts, events, rank]`` (or,
in one main-branch vLLM, a map); each event is a map tagged with ``"type"`` or a
legacy tag-first array. Block hashes arrive as unsigned ints (vLLM), signed
ints (SGLang) or raw digest bytes; all are normalised to one u64 here, because
they are only ever compared with each other.

Structural damage (wrong frame count, a seq frame that is not 8 bytes, a payload
that is not a batch) raises :class:`KvDecodeError`. A single malformed event
inside an otherwise good batch is skipped and counted in
:attr:`KvEventBatch.malformed_events` instead, so one bad event never costs the
batch's other events (a lost removal leaves a stale index entry behind).
"""

from __future__ import annotations

import array
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias, cast

import msgspec

__all__ = [
    "END_SEQ",
    "MASK64",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvDecodeError",
    "KvEvent",
    "KvEventBatch",
    "ReplayReply",
    "decode_message",
    "decode_payload",
    "encode_replay_request",
    "normalise_hash",
    "parse_replay_reply",
    "parse_seq",
]

MASK64: Final = 0xFFFF_FFFF_FFFF_FFFF
END_SEQ: Final = MASK64
"""The seq of a replay's end marker (``ff`` × 8, signed -1 as the engines write it)."""

if array.array("I").itemsize != 4 or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("direct_frontend.kv needs 4-byte little-endian array('I')")

_decode_msgpack: Final = msgspec.msgpack.Decoder().decode


class KvDecodeError(ValueError):
    """A ZMQ message that is not a KV-event batch in any known layout.

    ``seq`` is the message's sequence number when its seq frame was readable,
    so a tracker can step past the message instead of replaying it forever.
    """

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Full blocks that entered an engine's prefix cache, in prefix order.

    ``token_ids`` holds all listed blocks' tokens as a u32 array (cheap to hash
    and compact). ``bigram`` marks SGLang Eagle ``[t, t+1]`` pairs: their first
    elements are kept in ``token_ids`` but the index skips such events
    (docs/kv-events.md §10, UNCONFIRMED layout).

    The event records are frozen msgspec structs, built in C: a page-1 engine
    publishes one store per token. Copy one with :func:`msgspec.structs.replace`.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: array.array[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    bigram: bool = False


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks evicted from one tier of an engine's cache (one removal per physical copy)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The engine (this rank) dropped its whole prefix cache."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, frozen=True, gc=False):
    """One published batch: the events of one engine step, with its frame metadata.

    ``unknown_events`` counts events of a type we do not know (ignored by the
    doc's rules); ``malformed_events`` counts known events we could not read.
    """

    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    topic: bytes = b""
    unknown_events: int = 0
    malformed_events: int = 0


# -- frames -------------------------------------------------------------------


def parse_seq(frame: bytes) -> int:
    """The big-endian u64 of a seq frame."""
    if len(frame) != 8:
        raise KvDecodeError(f"seq frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes]) -> KvEventBatch:
    """Decode one live PUB message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise KvDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_frame, payload = frames
    return decode_payload(payload, seq=parse_seq(seq_frame), topic=bytes(topic))


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayReply:
    """One message a replay DEALER received: a batch, or the end marker."""

    seq: int
    payload: bytes
    topic: bytes = b""

    @property
    def is_end(self) -> bool:
        return self.seq == END_SEQ


def encode_replay_request(start_seq: int) -> list[bytes]:
    """The two frames a DEALER sends: the empty delimiter, then the start seq (u64 BE)."""
    if not 0 <= start_seq < END_SEQ:
        raise ValueError(f"start_seq {start_seq} is outside 0..2^64-2")
    return [b"", start_seq.to_bytes(8, "big")]


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Read a replay reply in either form the engines send (docs/kv-events.md §8.1).

    4 frames ``["", topic, seq, payload]`` (vLLM 0.32, SGLang 0.5.23) or 3 frames
    ``["", seq, payload]`` (older releases); the end marker has seq ``END_SEQ``
    and an empty payload in both.
    """
    if len(frames) == 4:
        delimiter, topic, seq_frame, payload = frames
    elif len(frames) == 3:
        delimiter, seq_frame, payload = frames
        topic = b""
    else:
        raise KvDecodeError(f"replay reply has {len(frames)} frames, expected 3 or 4")
    if delimiter:
        raise KvDecodeError("replay reply does not start with an empty delimiter frame")
    seq = parse_seq(seq_frame)
    if seq == END_SEQ and payload:
        raise KvDecodeError("replay end marker carries a payload", seq=None)
    return ReplayReply(seq, bytes(payload), bytes(topic))


# -- payload ------------------------------------------------------------------


def normalise_hash(value: object) -> int:
    """An engine block hash as u64: ints masked (two's complement), bytes' last 8 bytes BE."""
    if type(value) is int:
        return value & MASK64
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise ValueError("empty hash bytes")
        return int.from_bytes(raw[-8:], "big")
    raise ValueError(f"block hash of type {type(value).__name__}")


_RANK_KEYS: Final = ("data_parallel_rank", "attn_dp_rank", "dp_rank")


def decode_payload(payload: bytes, *, seq: int = 0, topic: bytes = b"") -> KvEventBatch:
    """Decode a msgpack batch: a 3- or 2-element array, or a map keyed by field name.

    The layouts today's engines publish (an array batch of tagged-map events)
    are decoded typed, in C (:func:`_decode_typed`); anything that does not fit
    those types exactly (map batches, tag-first arrays, unknown or damaged
    events) takes the general path, which gives the same result for what both
    read and is the one that reports damage.
    """
    typed = _decode_typed(payload)
    if typed is None:
        return _decode_general(payload, seq, topic)
    ts, items, rank = typed
    decoded, malformed = _convert_typed(items)
    return KvEventBatch(seq=seq, ts=ts, events=decoded, dp_rank=rank, topic=topic,
                        malformed_events=malformed)


def _decode_general(payload: bytes, seq: int, topic: bytes) -> KvEventBatch:
    """:func:`decode_payload` through a generic msgpack decode and per-event reading."""
    try:
        raw = _decode_msgpack(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise KvDecodeError(f"payload is not msgpack: {exc}", seq=seq) from None
    except RecursionError:  # (msgspec bounds its nesting by the interpreter's limit)
        raise KvDecodeError("payload nests too deep", seq=seq) from None
    ts, events, rank = _batch_fields(raw, seq)
    decoded, unknown, malformed = _decode_events(events)
    return KvEventBatch(
        seq=seq,
        ts=ts,
        events=decoded,
        dp_rank=rank,
        topic=topic,
        unknown_events=unknown,
        malformed_events=malformed,
    )


def _batch_fields(raw: object, seq: int) -> tuple[float, list[Any], int | None]:
    """A batch's timestamp, events and rank, from whichever layout it came in, checked."""
    rank: object = None
    if isinstance(raw, list):
        if len(raw) == 3:
            ts, events, rank = raw
        elif len(raw) == 2:
            ts, events = raw
        else:
            raise KvDecodeError(f"batch array has {len(raw)} elements, expected 2 or 3", seq=seq)
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = next((raw[k] for k in _RANK_KEYS if k in raw), None)
    else:
        raise KvDecodeError(f"batch is a msgpack {type(raw).__name__}", seq=seq)
    if type(ts) is int:
        ts = float(ts)
    if type(ts) is not float:
        raise KvDecodeError("batch ts is not a number", seq=seq)
    if not isinstance(events, list):
        raise KvDecodeError("batch events is not an array", seq=seq)
    if rank is not None and type(rank) is not int:
        raise KvDecodeError("batch rank is not an int", seq=seq)
    return ts, events, rank


def _decode_events(items: list[Any]) -> tuple[tuple[KvEvent, ...], int, int]:
    """The events we know and could read, and how many were of unknown types or malformed."""
    decoded: list[KvEvent] = []
    unknown = malformed = 0
    for item in items:
        try:
            event = _decode_event(item)
        except (ValueError, TypeError, OverflowError):
            malformed += 1
            continue
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return tuple(decoded), unknown, malformed


# Declaration order, for the legacy tag-first arrays (vLLM's order; docs/kv-events.md §5.2).
_STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def _fields_of(item: object) -> tuple[str, dict[str, Any]]:
    """The tag and the field map of a tagged map or a legacy tagged array."""
    if isinstance(item, dict):
        tag = item.get("type")
        if not isinstance(tag, str):
            raise ValueError("event map without a string 'type'")
        return tag, item
    if isinstance(item, list) and item and isinstance(item[0], str):
        tag = item[0]
        names = (
            _STORED_FIELDS
            if tag == "BlockStored"
            else _REMOVED_FIELDS
            if tag == "BlockRemoved"
            else ()
        )
        # zip() drops unknown trailing elements, as the decoder rules ask.
        return tag, dict(zip(names, item[1:], strict=False))
    raise ValueError(f"event is a msgpack {type(item).__name__}")


def _decode_event(item: object) -> KvEvent | None:
    tag, f = _fields_of(item)
    if tag == "BlockStored":
        return _stored(f)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")),
            medium=_opt_str(f.get("medium")),
            group_idx=_opt_int(f.get("group_idx")),
            locality=_opt_str(f.get("locality")),
            ownership=_opt_str(f.get("ownership")),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


#: the fields of a store that sets no more than SGLang's usual page does
_PLAIN_STORED: Final = frozenset(
    {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"})


def _stored(f: dict[str, Any]) -> BlockStored:
    parent = f.get("parent_block_hash")
    raw_tokens = f.get("token_ids")
    if not isinstance(raw_tokens, list):
        raise ValueError("token_ids is not an array")
    bigram = bool(raw_tokens) and isinstance(raw_tokens[0], list)
    if bigram:
        raw_tokens = [pair[0] if isinstance(pair, list) and pair else -1 for pair in raw_tokens]
    tokens = array.array("I", raw_tokens)  # validates ints within u32, in C
    block_size = f.get("block_size")
    if type(block_size) is not int or block_size < 0:
        raise ValueError("block_size is not a non-negative int")
    if f.keys() <= _PLAIN_STORED:  # SGLang's one page (nothing else set): fewer steps
        return BlockStored(_hashes(f.get("block_hashes")),
                           None if parent is None else normalise_hash(parent), tokens,
                           block_size, _opt_int(f.get("lora_id")), _opt_str(f.get("medium")),
                           bigram=bigram)
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise ValueError("extra_keys is not an array")
    return BlockStored(
        block_hashes=_hashes(f.get("block_hashes")),
        parent_block_hash=None if parent is None else normalise_hash(parent),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id")),
        medium=_opt_str(f.get("medium")),
        lora_name=_opt_str(f.get("lora_name")),
        extra_keys=None if extra is None else tuple(extra),
        group_idx=_opt_int(f.get("group_idx")),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind")),
        kv_cache_spec_sliding_window=_opt_int(f.get("kv_cache_spec_sliding_window")),
        locality=_opt_str(f.get("locality")),
        ownership=_opt_str(f.get("ownership")),
        session_id=_opt_str(f.get("session_id")),
        cache_salt=_opt_str(f.get("cache_salt")),
        bigram=bigram,
    )


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError("block_hashes is not an array")
    return tuple(normalise_hash(h) for h in value)


def _opt_str(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"expected a string or nil, got {type(value).__name__}")


def _opt_int(value: object) -> int | None:
    if value is None or type(value) is int:
        return value
    raise ValueError(f"expected an int or nil, got {type(value).__name__}")


# -- typed fast path ----------------------------------------------------------
# The wire types of tagged-map events (vLLM 0.32, SGLang 0.5.23) in an array
# batch. msgspec checks every field's type in C, so a decode that succeeds holds
# exactly the values the general path would accept field by field; what the
# types cannot say (u32 tokens, a non-negative block size, non-empty hash bytes)
# is checked per event below, with the general path's outcome (one malformed
# event counted). Unknown fields are ignored by both paths.

_Hash = int | bytes
#: our fields' types (as annotated) → as the engines write them
_WIRE_TYPES: Final[dict[str, Any]] = {
    "tuple[int, ...]": list[_Hash], "array.array[int]": list[int],
    "tuple[Any, ...] | None": list[Any], "int": int, "int | None": int, "str | None": str,
}


def _wire_struct(record: type[msgspec.Struct]) -> Any:
    """A tagged-map wire type with ``record``'s fields in its order (its flag ``bigram``
    aside), each nil when missing (a nil where a value is needed is a malformed event,
    as on the general path), typed as the engines write them: a hash an int or bytes
    (``parent_block_hash`` too), arrays as lists."""
    fields = [(name, (_Hash if name == "parent_block_hash" else _WIRE_TYPES[hint]) | None, None)
              for name, hint in record.__annotations__.items() if hint != "bool"]
    return msgspec.defstruct(f"_Wire{record.__name__}", fields, tag=record.__name__, gc=False)


_WireStored: Final = _wire_struct(BlockStored)
_WireRemoved: Final = _wire_struct(BlockRemoved)


_WireCleared: Final = msgspec.defstruct("_WireCleared", [], tag="AllBlocksCleared", gc=False)
_list: Any = list  # subscripted with runtime types, which a type checker cannot see
_WireBatch: Final = msgspec.defstruct("_WireBatch", [
    ("ts", float), ("events", _list[_WireStored | _WireRemoved | _WireCleared]),
    ("rank", int | None, None),
    # msgspec ignores trailing array elements; one here means more than 3 (malformed)
    ("beyond", msgspec.Raw | msgspec.UnsetType, msgspec.UNSET),
], array_like=True, gc=False)
_decode_wire: Final[Callable[[bytes], Any]] = msgspec.msgpack.Decoder(_WireBatch).decode


def _decode_typed(payload: bytes) -> tuple[float, list[Any], int | None] | None:
    """The batch decoded typed, or None where it does not fit the wire types."""
    try:
        batch = _decode_wire(payload)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    if batch.beyond is not msgspec.UNSET:
        return None
    return batch.ts, batch.events, batch.rank


def _convert_typed(items: list[Any]) -> tuple[tuple[KvEvent, ...], int]:
    """Typed wire events as our events, and how many were malformed."""
    decoded: list[KvEvent] = []
    malformed = 0
    for item in items:
        try:
            if type(item) is _WireStored:
                decoded.append(_typed_stored(item))
            elif type(item) is _WireRemoved:
                decoded.append(BlockRemoved(
                    block_hashes=_wire_hashes(item.block_hashes), medium=item.medium,
                    group_idx=item.group_idx, locality=item.locality,
                    ownership=item.ownership))
            else:
                decoded.append(AllBlocksCleared())
        except (ValueError, TypeError, OverflowError):
            malformed += 1
    return tuple(decoded), malformed


def _typed_stored(e: Any) -> BlockStored:
    """A wire store as ours; a nil hash list, token list or block size raises TypeError."""
    tokens = array.array("I", e.token_ids)  # validates ints within u32, in C
    if e.block_size < 0:
        raise ValueError("block_size is negative")
    parent = e.parent_block_hash
    extra = e.extra_keys
    return BlockStored(
        block_hashes=_wire_hashes(e.block_hashes),
        parent_block_hash=None if parent is None else normalise_hash(parent),
        token_ids=tokens, block_size=e.block_size, lora_id=e.lora_id, medium=e.medium,
        lora_name=e.lora_name, extra_keys=None if extra is None else tuple(extra),
        group_idx=e.group_idx, kv_cache_spec_kind=e.kv_cache_spec_kind,
        kv_cache_spec_sliding_window=e.kv_cache_spec_sliding_window, locality=e.locality,
        ownership=e.ownership, session_id=e.session_id, cache_salt=e.cache_salt)


def _wire_hashes(raw: list[_Hash]) -> tuple[int, ...]:
    """:func:`normalise_hash` of each, with no Python call per hash where all are ints
    (msgpack ints lie within -2^63..2^64-1, so one at least 0 is already a u64)."""
    if len(raw) == 1:
        only = raw[0]
        return (only & MASK64,) if type(only) is int else (normalise_hash(only),)
    try:
        low = min(raw)  # TypeError: ints and bytes mixed; ValueError: none
    except (TypeError, ValueError):
        return tuple(map(normalise_hash, raw))
    if type(low) is not int:
        return tuple(map(normalise_hash, raw))
    ints = cast("list[int]", raw)  # all ints: min() of a mixed list raises
    return tuple(ints) if low >= 0 else tuple([h & MASK64 for h in ints])
