"""The KV block index: our content hash, prefix lookup across engines, removal, bounds."""

from __future__ import annotations

import array
import gc
import random
import tracemalloc
from collections.abc import Sequence

import msgspec
import pytest
import xxhash

from direct_frontend.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    decode_payload,
)
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.prefix import (
    ROOT_SEED,
    block_content_hash,
    mm_block_extras,
    namespace_seed,
    prefix_hashes,
)

BS = 4


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    parent: int | None = None,
    *,
    block_size: int = BS,
    **fields: object,
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=array.array("I", tokens),
        block_size=block_size,
        medium=fields.pop("medium", "GPU"),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


def seq_tokens(n_blocks: int, base: int = 100) -> list[int]:
    return list(range(base, base + n_blocks * BS))


def store_chain(
    index: KvIndex, engine: str, tokens: Sequence[int], salt: int, parent: int | None = None
) -> list[int]:
    """Store ``tokens`` as one vLLM-style event; engine hashes are ``salt*1000 + i``."""
    n = len(tokens) // BS
    hashes = [salt * 1000 + i for i in range(n)]
    index.store(engine, stored(hashes, tokens[: n * BS], parent))
    return hashes


# -- the hash --------------------------------------------------------------------


def test_content_hash_vectors() -> None:
    """docs/kv-events.md §12.4: XXH3-64, seed 1337, LE u32 tokens."""
    assert block_content_hash([1, 2, 3, 4]) == 14643705804678351452
    assert block_content_hash([5, 6, 7, 8]) == 16777012769546811212


def test_prefix_chain_rule() -> None:
    """h1 is the content hash; each next block is hashed with the previous prefix hash as seed."""
    h1, h2 = prefix_hashes(range(1, 10), 4)  # the 9th token is a partial block: dropped
    assert h1 == 14643705804678351452
    assert h2 == xxhash.xxh3_64_intdigest(array.array("I", [5, 6, 7, 8]).tobytes(), h1)
    assert prefix_hashes([1, 2, 3], 4) == []
    assert namespace_seed(None) == ROOT_SEED
    lora = (ROOT_SEED + xxhash.xxh3_64_intdigest(b"adapter")) & ((1 << 64) - 1)
    assert namespace_seed("adapter") == lora  # Dynamo's seed change
    assert prefix_hashes([1, 2, 3, 4], 4, lora_name="adapter") == [
        xxhash.xxh3_64_intdigest(array.array("I", [1, 2, 3, 4]).tobytes(), lora)
    ]


def test_request_hashes_tolerate_bad_token_ids() -> None:
    index = KvIndex(BS)
    assert index.request_hashes([-1, 2, 3, 4]) == []
    assert index.request_hashes([1 << 32, 2, 3, 4]) == []
    assert index.lookup([-1, 2, 3, 4]) == {}


# -- lookup ----------------------------------------------------------------------


def test_lookup_counts_leading_blocks_per_engine() -> None:
    index = KvIndex(BS)
    shared = seq_tokens(4)
    store_chain(index, "a", shared, 1)
    store_chain(index, "b", shared[: 2 * BS] + seq_tokens(2, base=900), 2)
    store_chain(index, "c", seq_tokens(3, base=5000), 3)
    request = [*shared, 1, 2]  # four full blocks and a partial one
    assert index.lookup(request) == {"a": 4, "b": 2}
    assert index.lookup(shared[:BS]) == {"a": 1, "b": 1}
    assert index.lookup(seq_tokens(2, base=7)) == {}
    assert index.lookup([]) == {}
    # Not a leading match: block 0 differs, so later equal blocks do not count.
    assert index.lookup(seq_tokens(1, base=1) + shared[BS:]) == {}


def test_stores_chain_through_engine_parent_hashes() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(4)
    first = store_chain(index, "a", tokens[: 2 * BS], 1)
    store_chain(index, "a", tokens[2 * BS :], 2, parent=first[-1])
    assert index.lookup(tokens) == {"a": 4}
    # SGLang style: one event per page, each chained to the previous page.
    parent = None
    for i in range(4):
        index.store("s", stored([-(i + 1)], tokens[i * BS : (i + 1) * BS], parent))
        parent = -(i + 1)
    assert index.lookup(tokens) == {"a": 4, "s": 4}


def test_unknown_parent_is_counted_and_dropped() -> None:
    index = KvIndex(BS)
    index.store("a", stored([5], seq_tokens(1), parent=12345))
    assert len(index) == 0 and index.stats().unknown_parent == 1


def test_lookup_matches_a_brute_force_model() -> None:
    """Random stores and removals on 4 engines; lookup equals a set-of-prefixes model."""
    rng = random.Random(7)
    index = KvIndex(BS)
    vocab = [1, 2, 3]  # tiny, so prefixes collide and share often
    model: dict[str, dict[int, tuple[int, ...]]] = {e: {} for e in "abcd"}  # hash → prefix
    next_hash = 1
    for _ in range(400):
        engine = rng.choice("abcd")
        held = model[engine]
        if held and rng.random() < 0.3:
            victim = rng.choice(list(held))
            del held[victim]
            index.remove(engine, BlockRemoved((victim,), "GPU"))
            continue
        # Extend a held prefix (or start one) by 1-3 blocks, as a real engine would.
        parent = rng.choice([None, *held]) if held else None
        prefix = held[parent] if parent is not None else ()
        n = rng.randint(1, 3)
        tokens = [rng.choice(vocab) for _ in range(n * BS)]
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        index.store(engine, stored(hashes, tokens, parent))
        for i, h in enumerate(hashes):
            held[h] = prefix + tuple(tokens[: (i + 1) * BS])
    for _ in range(300):
        request = [rng.choice(vocab) for _ in range(rng.randint(0, 6) * BS)]
        expected = {}
        for engine, held in model.items():
            prefixes = set(held.values())
            depth = 0
            while depth * BS < len(request) and tuple(request[: (depth + 1) * BS]) in prefixes:
                depth += 1
            if depth:
                expected[engine] = depth
        assert index.lookup(request) == expected


# -- namespaces -----------------------------------------------------------------


def test_lora_blocks_match_only_the_same_adapter() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(2)
    index.store("a", stored([1, 2], tokens, lora_name="ad", extra_keys=(["ad"], ["ad"])))
    index.store("b", stored([1, 2], tokens))
    assert index.lookup(tokens) == {"b": 2}
    assert index.lookup(tokens, lora_name="ad") == {"a": 2}


def test_cache_salt_vllm_extra_keys_and_sglang_field_agree() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(2)
    index.store("v", stored([1, 2], tokens, extra_keys=(["s1"], None)))  # vLLM: salt on block 0
    index.store("g", stored([7], tokens[:BS], cache_salt="s1"))  # SGLang: on the event
    index.store("g", stored([8], tokens[BS:], parent=7, cache_salt="s1"))
    assert index.lookup(tokens) == {}
    assert index.lookup(tokens, cache_salt="s1") == {"v": 2, "g": 2}
    assert index.lookup(tokens, cache_salt="other") == {}


def test_multimodal_extra_keys_never_match_text_but_still_chain_and_free() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(3)
    index.store("a", stored([1, 2], tokens[: 2 * BS], extra_keys=([["img", 0]], None)))
    index.store("a", stored([3], tokens[2 * BS :], parent=2))
    assert len(index) == 3 and index.stats().unknown_parent == 0
    assert index.lookup(tokens) == {}
    index.remove("a", BlockRemoved((1, 2, 3), "GPU"))
    assert len(index) == 0 and index.stats().prefixes == 0


# -- removal, copies, clears -------------------------------------------------------


def test_removal_frees_entries_and_the_table() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(3)
    hashes = store_chain(index, "a", tokens, 1)
    store_chain(index, "b", tokens, 2)
    index.remove("a", BlockRemoved(tuple(hashes[1:]), "GPU"))
    assert index.lookup(tokens) == {"a": 1, "b": 3}
    index.remove("a", BlockRemoved((hashes[0], 999), "GPU"))
    assert index.lookup(tokens) == {"b": 3}
    stats = index.stats()
    assert (stats.blocks, stats.prefixes, stats.unknown_removals) == (3, 3, 1)
    assert stats.blocks_by_engine == {"a": 0, "b": 3}


def test_removal_of_another_tier_or_group_leaves_the_device_copy() -> None:
    index = KvIndex(BS)
    hashes = store_chain(index, "a", seq_tokens(1), 1)
    index.remove("a", BlockRemoved(tuple(hashes), "CPU"))
    index.remove("a", BlockRemoved(tuple(hashes), "GPU", group_idx=1))
    assert len(index) == 1
    index.remove("a", BlockRemoved(tuple(hashes), None))  # SGLang: no medium = device
    assert len(index) == 0


def test_two_physical_copies_need_two_removals() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(1)
    index.store("a", stored([5], tokens))
    index.store("a", stored([5], tokens))  # vLLM can hold two copies of one hash
    assert len(index) == 1
    index.remove("a", BlockRemoved((5,), "GPU"))
    assert index.lookup(tokens) == {"a": 1}
    index.remove("a", BlockRemoved((5,), "GPU"))
    assert index.lookup(tokens) == {} and len(index) == 0


def test_two_engine_hashes_for_one_prefix_on_one_engine() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(1)
    index.store("a", stored([5], tokens))
    index.store("a", stored([6], tokens))  # e.g. a namespaced and a plain engine hash
    index.remove("a", BlockRemoved((5,), "GPU"))
    assert index.lookup(tokens) == {"a": 1}
    index.remove("a", BlockRemoved((6,), "GPU"))
    assert index.lookup(tokens) == {} and index.stats().prefixes == 0


def test_all_blocks_cleared_and_clear_engine() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(2)
    store_chain(index, "a", tokens, 1)
    store_chain(index, "b", tokens, 2)
    index.apply("a", KvEventBatch(seq=0, ts=0.0, events=(AllBlocksCleared(),)))
    assert index.lookup(tokens) == {"b": 2}
    assert index.clear_engine("b") == 2
    assert index.lookup(tokens) == {} and len(index) == 0 and index.stats().prefixes == 0
    assert index.clear_engine("nobody") == 0


def test_remove_engine_frees_its_slot() -> None:
    index = KvIndex(BS)
    tokens = seq_tokens(1)
    store_chain(index, "a", tokens, 1)
    store_chain(index, "b", tokens, 2)
    index.remove_engine("a")
    assert index.engines() == ["b"]
    store_chain(index, "c", tokens, 3)  # reuses a's bit: must not inherit anything
    assert index.lookup(tokens) == {"b": 1, "c": 1}


def test_removals_really_give_memory_back() -> None:
    index = KvIndex(16)
    n = 40_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(0, n, 100):
            tokens = list(range(i * 16, (i + 100) * 16))
            index.store("a", stored(range(i + 1, i + 101), tokens, block_size=16))
        filled = tracemalloc.get_traced_memory()[0] - before
        for i in range(0, n, 100):
            index.remove("a", BlockRemoved(tuple(range(i + 1, i + 101)), "GPU"))
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 0 and index.stats().prefixes == 0
    assert filled > n * 100  # at least 100 bytes per block while held
    # What is left is the small dicts below the rebuild threshold, not the 40k entries.
    assert left < filled * 0.05, (filled, left)


# -- filters and bounds -------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (stored([1], seq_tokens(1), group_idx=1), "not_full_attention"),
        (stored([1], seq_tokens(1), kv_cache_spec_kind="sliding_window"), "not_full_attention"),
        (stored([1], seq_tokens(1), kv_cache_spec_kind="mamba"), "not_full_attention"),
        (stored([1], seq_tokens(1), locality="REMOTE"), "remote"),
        (stored([1], seq_tokens(1), medium="CPU"), "tier"),
        (stored([1], seq_tokens(1), medium="WEIRD"), "tier"),
        (stored([1], [], block_size=0), "placeholder"),
        (stored([1], seq_tokens(1)[:3], block_size=3), "block_size"),
        (stored([1, 2], seq_tokens(1)), "unaligned"),
        (stored([1], seq_tokens(1), parent=1), "self_parent"),
        (stored([1, 1], seq_tokens(2)), "self_parent"),
        (stored([1], seq_tokens(1), bigram=True), "bigram_tokens"),
    ],
)
def test_unindexable_stores_are_skipped_and_counted(event: BlockStored, reason: str) -> None:
    index = KvIndex(BS)
    assert index.store("a", event) == 0
    assert len(index) == 0 and index.stats().skipped == {reason: 1}


def test_full_attention_and_local_stores_are_indexed() -> None:
    index = KvIndex(BS)
    event = stored(
        [1], seq_tokens(1), group_idx=0, kv_cache_spec_kind="full_attention", locality="LOCAL"
    )
    assert index.store("a", event) == 1
    assert index.store("b", stored([1], seq_tokens(1), medium=None)) == 1
    cpu = KvIndex(BS, tiers={"GPU", "CPU"})
    assert cpu.store("a", stored([1], seq_tokens(1), medium="CPU")) == 1


def test_cap_evicts_oldest_entries_of_the_largest_engines() -> None:
    index = KvIndex(BS, max_blocks=100, evict_to=0.5)
    old = seq_tokens(60, base=0)
    store_chain(index, "a", old, 1)
    store_chain(index, "b", seq_tokens(30, base=10_000), 2)
    new = seq_tokens(20, base=50_000)
    store_chain(index, "a", new, 3)  # 110 > 100: evict down to 50
    stats = index.stats()
    assert stats.blocks <= 50 and stats.evictions >= 60
    assert stats.blocks_by_engine["a"] >= stats.blocks_by_engine["b"]
    assert index.lookup(new) == {"a": 20}  # the newest survive
    assert "a" not in index.lookup(old)  # the oldest went first


def test_stats_bytes_estimate_grows_and_shrinks() -> None:
    index = KvIndex(BS)
    empty = index.stats().bytes_estimate
    store_chain(index, "a", seq_tokens(5000), 1)
    full = index.stats().bytes_estimate
    assert full > empty + 5000 * 100
    index.clear_engine("a")
    while index.sweep():  # a big engine's clear is swept in steps
        pass
    assert index.stats().bytes_estimate < empty + 2000


def test_a_decoded_engine_batch_applies() -> None:
    """The §12.1 shape end to end through decode and apply (block size 2)."""
    index = KvIndex(2)
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [2**64 - 5, 7],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            ],
            0,
        ]
    )
    index.apply("e", decode_payload(payload))
    assert index.lookup([1, 2, 3, 4]) == {"e": 1}


def test_clearing_a_big_engine_is_immediate_and_swept_in_steps() -> None:
    """A fence must not stall the loop: the bit is retired at once, the table swept later."""
    index = KvIndex(BS)
    shared = seq_tokens(10)
    big = seq_tokens(6000, base=100_000)
    store_chain(index, "a", shared, 1)
    store_chain(index, "a", big, 2)
    store_chain(index, "b", shared, 3)
    assert index.clear_engine("a") == 6010
    assert index.lookup(shared) == {"b": 10} and index.lookup(big) == {}
    stats = index.stats()
    assert stats.blocks == 10 and stats.pending_sweep == 6010
    # The engine carries on at once, on a fresh bit.
    store_chain(index, "a", shared, 4)
    assert index.lookup(shared) == {"a": 10, "b": 10}
    assert index.sweep(1000) == 1000 and index.stats().pending_sweep == 5010
    while index.sweep():
        pass
    stats = index.stats()
    assert stats.pending_sweep == 0 and stats.prefixes == 10 and stats.blocks == 20
    assert index.lookup(shared) == {"a": 10, "b": 10}
    index.remove("a", BlockRemoved(tuple(4000 + i for i in range(10)), "GPU"))
    assert index.lookup(shared) == {"b": 10}
    # Batches sweep as they are applied; a removed engine's big leftovers go the same way.
    store_chain(index, "c", big, 5)
    index.remove_engine("c")
    assert index.engines() == ["b", "a"] and index.lookup(big) == {}
    for _ in range(10):
        index.apply_events("b", ())
    assert index.stats().pending_sweep == 0 and index.stats().prefixes == 10


def test_two_big_engines_cleared_together_leave_nothing_for_a_reused_slot() -> None:
    """One sweep that finishes one engine and starts the next, with the table rebuilt between."""
    index = KvIndex(BS)
    first = seq_tokens(20_000, base=100_000)
    second = seq_tokens(5_000, base=300_000)
    store_chain(index, "a", first, 1)
    store_chain(index, "b", second, 2)
    index.clear_engine("a")
    index.clear_engine("b")
    # a's 20,000 leave a quarter of the table's peak: it is rebuilt before b's are swept
    assert index.sweep(22_000) == 22_000
    while index.sweep():
        pass
    assert index.stats().prefixes == 0
    for name in ("c", "d"):  # new engines on the old slots hold none of what was cleared
        store_chain(index, name, seq_tokens(1), 3)
    assert index.lookup(first) == {} and index.lookup(second) == {}


# -- snapshots --------------------------------------------------------------------


def test_an_exported_engine_imports_to_the_same_lookups_and_keeps_applying() -> None:
    from direct_frontend.kv.snapshot import (
        IndexSnapshot,
        RankSnapshot,
        Reassembly,
        decode_snapshot,
        encode_snapshot,
        split,
    )

    old = KvIndex(BS)
    tokens = seq_tokens(6)
    hashes = store_chain(old, "g1r0", tokens, salt=7)
    store_chain(old, "g1r0", seq_tokens(2, base=900), salt=8)
    old.store("g1r0", stored([hashes[0]], tokens[:BS]))  # a second copy of block 0
    blocks, copies = old.export_engine("g1r0")
    rank = RankSnapshot.of(("a", "grpc://a:1", "tcp://a:2", 0), 12, blocks, copies)
    snapshot = IndexSnapshot("sibling", BS, [rank])
    assembly = Reassembly()
    for chunk in reversed(split(encode_snapshot(snapshot), size=64)):
        assembly.add(chunk)
    assert assembly.done
    received = decode_snapshot(assembly.data())
    assert received == snapshot and len(received.ranks[0]) == 8

    new = KvIndex(BS)
    loaded = new.import_engine("g5r0", received.ranks[0].blocks(), received.ranks[0].copies)
    assert loaded == 8 and len(new) == len(old)
    for prompt in (tokens, seq_tokens(2, base=900), tokens[: 3 * BS]):
        assert new.lookup(prompt) == {"g5r0": old.lookup(prompt)["g1r0"]}
    # the engine's own hashes came along: a child stored under an old parent chains on
    child = seq_tokens(1, base=2000)
    for index, key in ((old, "g1r0"), (new, "g5r0")):
        index.store(key, stored([99_999], child, parent=hashes[-1]))
        index.remove(key, BlockRemoved(block_hashes=(hashes[0],), medium="GPU"))
    assert new.lookup([*tokens, *child]) == {"g5r0": 7}
    assert old.lookup([*tokens, *child]) == {"g1r0": 7}  # block 0 had two copies: still held


def test_a_malformed_snapshot_rank_says_so() -> None:
    from direct_frontend.kv.snapshot import RankSnapshot

    rank = RankSnapshot("a", "u", "e", 0, 1, b"\0" * 16, b"\0" * 8)
    with pytest.raises(ValueError, match="differ in number"):
        list(rank.blocks())


def test_an_image_prefix_matches_the_same_image_as_vllm_publishes_it() -> None:
    """vLLM keys each block an image's run overlaps with (its hash, the run's offset from the
    block's start) and publishes those pairs per block; a request keyed the same way matches
    them, the same tokens of another image do not, nor do they match text."""
    index = KvIndex(BS)
    tokens = [*seq_tokens(1), *([9] * 6), *seq_tokens(1, 300)[:2]]  # 3 blocks: text, run, run
    media = [("img-a", 4, 6)]  # the run covers [4, 10): blocks 1 and 2
    # vLLM 0.32's wire: per block, a tuple of (identifier, offset) pairs, or nil
    wire = ["BlockStored", [11, 12, 13], None, tokens, BS, None, "GPU", None,
            [None, [["img-a", 0]], [["img-a", -4]]]]
    batch = decode_payload(msgspec.msgpack.encode([1.0, [wire], 0]))
    index.apply("v", batch)
    assert index.lookup_hashes(prefix_hashes(tokens, BS, media=media)) == {"v": 3}
    assert index.lookup_hashes(prefix_hashes(tokens, BS, media=[("img-b", 4, 6)])) == {"v": 1}
    assert index.lookup_hashes(prefix_hashes(tokens, BS, media=[("img-a", 5, 5)])) == {"v": 1}
    assert index.lookup(tokens) == {"v": 1}  # text alone: only the block before the image
    assert mm_block_extras(media, BS, 3) == [None, [["img-a", 0]], [["img-a", -4]]]
    # two images in one block, the second starting mid-block
    assert mm_block_extras([("a", 0, 2), ("b", 2, 5)], BS, 2) == [
        [["a", 0], ["b", 2]], [["b", -2]]]
