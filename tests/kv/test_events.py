"""KV-event decoding: the doc's byte-exact vectors, every layout, hash normalisation, damage.

The vectors are docs/kv-events.md §12; the simulator's msgspec structs (which
mirror the engines' declarations) must encode them byte for byte, and the
decoder must read them and every variant the stock engines emit.
"""

from __future__ import annotations

import msgspec
import pytest

from direct_frontend.kv.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDecodeError,
    decode_message,
    decode_payload,
    encode_replay_request,
    normalise_hash,
    parse_replay_reply,
    parse_seq,
)
from direct_frontend.simulator.kv_publisher import (
    LegacyAllBlocksCleared,
    LegacyBlockRemoved,
    LegacyBlockStored,
    LegacyEventBatch,
    SglangBlockStored,
    SglangEventBatch,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    sglang_batch,
    vllm_batch,
)
from direct_frontend.simulator.kvcache import CacheCleared, RemovedBlocks, StoredRun

# docs/kv-events.md §12.1: vLLM 0.32.0 map encoding, 210 bytes.
VECTOR_MAP = bytes.fromhex(
    """
    93 cb 3f f8 00 00 00 00 00 00 93 89 a4 74 79 70
    65 ab 42 6c 6f 63 6b 53 74 6f 72 65 64 ac 62 6c
    6f 63 6b 5f 68 61 73 68 65 73 92 cf 80 00 00 00
    00 00 00 05 07 b1 70 61 72 65 6e 74 5f 62 6c 6f
    63 6b 5f 68 61 73 68 c0 a9 74 6f 6b 65 6e 5f 69
    64 73 94 01 02 03 04 aa 62 6c 6f 63 6b 5f 73 69
    7a 65 02 a7 6c 6f 72 61 5f 69 64 c0 a6 6d 65 64
    69 75 6d a3 47 50 55 a9 6c 6f 72 61 5f 6e 61 6d
    65 c0 a9 67 72 6f 75 70 5f 69 64 78 00 83 a4 74
    79 70 65 ac 42 6c 6f 63 6b 52 65 6d 6f 76 65 64
    ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73 91 07 a6
    6d 65 64 69 75 6d a3 47 50 55 81 a4 74 79 70 65
    b0 41 6c 6c 42 6c 6f 63 6b 73 43 6c 65 61 72 65
    64 00
    """
)
# §12.2: the same events in the legacy tag-first array layout, 87 bytes.
VECTOR_LEGACY = bytes.fromhex(
    """
    93 cb 3f f8 00 00 00 00 00 00 93 98 ab 42 6c 6f
    63 6b 53 74 6f 72 65 64 92 cf 80 00 00 00 00 00
    00 05 07 c0 94 01 02 03 04 02 c0 a3 47 50 55 c0
    93 ac 42 6c 6f 63 6b 52 65 6d 6f 76 65 64 91 07
    a3 47 50 55 91 b0 41 6c 6c 42 6c 6f 63 6b 73 43
    6c 65 61 72 65 64 00
    """
)
# docs/real-vllm.md §7.4: a batch holding only AllBlocksCleared, ts 1.5.
VECTOR_CLEARED = bytes.fromhex("93 cb 3ff8000000000000 91 81 a4") + b"type" + (
    b"\xb0AllBlocksCleared\x00"
)
BIG = 9223372036854775813  # above i64::MAX: msgpack uint64 (cf)


def check_vector_events(events: tuple[object, ...], *, group_idx: int | None) -> None:
    stored, removed, cleared = events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (BIG, 7)
    assert stored.parent_block_hash is None
    assert list(stored.token_ids) == [1, 2, 3, 4]
    assert stored.block_size == 2
    assert (stored.lora_id, stored.medium, stored.lora_name) == (None, "GPU", None)
    assert stored.group_idx == group_idx
    assert removed == BlockRemoved(block_hashes=(7,), medium="GPU")
    assert cleared == AllBlocksCleared()


def test_map_vector_decodes() -> None:
    assert len(VECTOR_MAP) == 210
    batch = decode_payload(VECTOR_MAP, seq=5, topic=b"kv")
    assert (batch.seq, batch.ts, batch.dp_rank, batch.topic) == (5, 1.5, 0, b"kv")
    assert (batch.unknown_events, batch.malformed_events) == (0, 0)
    check_vector_events(batch.events, group_idx=0)


def test_legacy_vector_decodes() -> None:
    assert len(VECTOR_LEGACY) == 87
    batch = decode_payload(VECTOR_LEGACY)
    assert (batch.ts, batch.dp_rank) == (1.5, 0)
    check_vector_events(batch.events, group_idx=None)


def test_cleared_only_vector_decodes() -> None:
    batch = decode_payload(VECTOR_CLEARED)
    assert batch.events == (AllBlocksCleared(),) and batch.dp_rank == 0


def test_engine_structs_encode_the_vectors_byte_for_byte() -> None:
    """The simulator publishes exactly what the engines' msgspec declarations produce."""
    current = VllmEventBatch(
        1.5,
        [
            VllmBlockStored([BIG, 7], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0),
            VllmBlockRemoved([7], "GPU"),
            VllmAllBlocksCleared(),
        ],
        0,
    )
    assert msgspec.msgpack.encode(current) == VECTOR_MAP
    legacy = LegacyEventBatch(
        1.5,
        [
            LegacyBlockStored([BIG, 7], None, [1, 2, 3, 4], 2, None, "GPU", None),
            LegacyBlockRemoved([7], "GPU"),
            LegacyAllBlocksCleared(),
        ],
        0,
    )
    assert msgspec.msgpack.encode(legacy) == VECTOR_LEGACY


def test_frames_vectors() -> None:
    """§12.3: a live message, a replay request, and both end-marker forms."""
    batch = decode_message([b"", bytes(8), VECTOR_MAP])
    assert batch.seq == 0 and len(batch.events) == 3
    assert encode_replay_request(5) == [b"", bytes.fromhex("0000000000000005")]
    four = parse_replay_reply([b"", b"", b"\xff" * 8, b""])
    three = parse_replay_reply([b"", b"\xff" * 8, b""])
    assert four.is_end and three.is_end and four.seq == END_SEQ
    item = parse_replay_reply([b"", b"topic", (7).to_bytes(8, "big"), VECTOR_MAP])
    assert (item.seq, item.topic, item.payload, item.is_end) == (7, b"topic", VECTOR_MAP, False)
    item3 = parse_replay_reply([b"", (7).to_bytes(8, "big"), VECTOR_MAP])
    assert (item3.seq, item3.topic, item3.payload) == (7, b"", VECTOR_MAP)


def test_batch_shapes_two_elements_and_map() -> None:
    events = [{"type": "AllBlocksCleared"}]
    two = decode_payload(msgspec.msgpack.encode([2.0, events]))
    assert two.dp_rank is None and two.events == (AllBlocksCleared(),)
    as_map = decode_payload(
        msgspec.msgpack.encode({"ts": 3, "events": events, "data_parallel_rank": 2})
    )
    assert (as_map.ts, as_map.dp_rank, as_map.events) == (3.0, 2, (AllBlocksCleared(),))
    sglang_nil_rank = decode_payload(msgspec.msgpack.encode([1.0, events, None]))
    assert sglang_nil_rank.dp_rank is None


def test_sglang_layout_signed_hashes_normalised() -> None:
    payload = msgspec.msgpack.encode(
        SglangEventBatch(1.0, [SglangBlockStored([-1], -2, [1, 2], 2, None)], None)
    )
    (stored,) = decode_payload(payload).events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == ((1 << 64) - 1,)
    assert stored.parent_block_hash == (1 << 64) - 2
    assert stored.medium is None and stored.cache_salt is None


def test_hash_normalisation_rules() -> None:
    """Ints: two's complement u64; bytes: the last 8 bytes big-endian (= vLLM's int form)."""
    digest = bytes(range(32))
    assert normalise_hash(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert normalise_hash(-3488128144981237669) == (-3488128144981237669) & ((1 << 64) - 1)
    assert normalise_hash(BIG) == BIG
    assert normalise_hash(b"\x01\x02") == 0x0102
    for bad in (True, 1.5, "x", b"", None):
        with pytest.raises(ValueError):
            normalise_hash(bad)


def test_bytes_hashes_in_events() -> None:
    digest = bytes(range(32))
    payload = msgspec.msgpack.encode(
        [
            0.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [digest],
                    "parent_block_hash": digest[:16],
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"},
            ],
            0,
        ]
    )
    stored, removed = decode_payload(payload).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == removed.block_hashes == (int.from_bytes(digest[-8:], "big"),)
    assert stored.parent_block_hash == int.from_bytes(digest[8:16], "big")


def test_simulator_payloads_round_trip() -> None:
    run = StoredRun([BIG, 5], None, [1, 2, 3, 4], 2)
    vllm = decode_payload(vllm_batch([RemovedBlocks([9, 10]), run, CacheCleared()], 1.0))
    removed_a, removed_b, stored, cleared = vllm.events
    assert removed_a == BlockRemoved((9,), "GPU", group_idx=0)
    assert removed_b == BlockRemoved((10,), "GPU", group_idx=0)
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == (None, None) and stored.kv_cache_spec_kind == "full_attention"
    assert cleared == AllBlocksCleared()
    sglang = decode_payload(sglang_batch([StoredRun([-5, 6], 4, [1, 2, 3, 4], 2)], 1.0))
    first, second = sglang.events  # one store per page, chained
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == ((-5) & ((1 << 64) - 1),) and first.parent_block_hash == 4
    assert second.parent_block_hash == first.block_hashes[0]
    assert list(second.token_ids) == [3, 4]


def test_unknown_keys_types_and_trailing_elements_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "future": [1, 2]},
                {"type": "SomethingNew", "x": 1},
                ["BlockRemoved", [2], "GPU", 0, None, None, "extra", "trailing"],
                ["FutureEvent", 1, 2],
            ],
            0,
        ]
    )
    batch = decode_payload(payload)
    assert batch.unknown_events == 2 and batch.malformed_events == 0
    assert [e.block_hashes for e in batch.events if isinstance(e, BlockRemoved)] == [(1,), (2,)]


def test_bigram_tokens_are_flagged() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [[5, 6], [6, 7]],
                    "block_size": 2,
                    "lora_id": None,
                }
            ],
            None,
        ]
    )
    (stored,) = decode_payload(payload).events
    assert isinstance(stored, BlockStored) and stored.bigram
    assert list(stored.token_ids) == [5, 6]


@pytest.mark.parametrize(
    "frames",
    [
        [b"", bytes(8)],  # two frames
        [b"", bytes(8), VECTOR_MAP, b"x"],  # four frames
        [b"", bytes(7), VECTOR_MAP],  # short seq
        [b"", bytes(8), b"\xc1"],  # not msgpack (0xc1 is never used)
        [b"", bytes(8), msgspec.msgpack.encode("a string")],
        [b"", bytes(8), msgspec.msgpack.encode([1.0])],  # one element
        [b"", bytes(8), msgspec.msgpack.encode([1.0, [], 0, 4])],  # four elements
        [b"", bytes(8), msgspec.msgpack.encode(["ts", [], 0])],
        [b"", bytes(8), msgspec.msgpack.encode([1.0, {"not": "a list"}, 0])],
        [b"", bytes(8), msgspec.msgpack.encode([1.0, [], "rank"])],
        [b"", bytes(8), VECTOR_MAP[:-5]],  # truncated
        [b"", bytes(8), b"\x91" * 100_000 + b"\xc0"],  # nested beyond the interpreter's limit
        # the same inside the events of a batch the typed path would read
        [b"", bytes(8), b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" * 100_000 + b"\xc0\x00"],
    ],
)
def test_structural_damage_raises_one_error(frames: list[bytes]) -> None:
    with pytest.raises(KvDecodeError):
        decode_message(frames)


def test_decode_error_carries_the_seq_when_readable() -> None:
    with pytest.raises(KvDecodeError) as raised:
        decode_message([b"", (42).to_bytes(8, "big"), b"\xc1"])
    assert raised.value.seq == 42
    with pytest.raises(KvDecodeError) as short:
        parse_seq(b"\x00")
    assert short.value.seq is None


def test_a_malformed_event_costs_only_itself() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockStored", "block_hashes": "nope", "token_ids": [], "block_size": 1},
                {"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 1},
                {"type": "BlockStored", "block_hashes": [1], "token_ids": [1 << 32]},
                {"type": "BlockRemoved", "block_hashes": [1.5]},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": 3},
                {"no": "type"},
                42,
                {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
            ],
            0,
        ]
    )
    batch = decode_payload(payload)
    assert batch.malformed_events == 7
    assert batch.events == (BlockRemoved((3,), "GPU"),)


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"\xff" * 8],  # two frames
        [b"x", b"\xff" * 8, b""],  # no empty delimiter
        [b"", b"", b"\xff" * 8, b"payload"],  # an end marker with a payload
        [b"", b"\x01", b""],
    ],
)
def test_bad_replay_replies(frames: list[bytes]) -> None:
    with pytest.raises(KvDecodeError):
        parse_replay_reply(frames)


def test_replay_request_range() -> None:
    with pytest.raises(ValueError):
        encode_replay_request(-1)
    with pytest.raises(ValueError):
        encode_replay_request(END_SEQ)
