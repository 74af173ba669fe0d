"""Benchmark the KV block index at routing scale.

Fills a :class:`~direct_frontend.kv.index.KvIndex` to 1M blocks across 8 engines
with vLLM-style stores of 4k-token prompts (block size 16, 256 blocks each, a
shared system prompt on every engine), then times what the router pays:

- per request: hashing a 4k-token prompt and looking it up (hit, shared, miss);
- per block of KV events: decoding the msgpack, applying stores and removals;
- fencing: clearing one engine;
- per batch of KV events as the engines publish them (``--events-only`` runs just
  this): an SGLang chain of one-page stores (page 1, re-cut into our blocks), and a
  vLLM step as the live routing bench sees it (one store of a run of blocks and
  one single-hash removal event per evicted block), decoded and applied.

Run: ``python scripts/bench_kv_index.py [--blocks 1000000] [--engines 8] [--events-only]``.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from collections.abc import Callable

import msgspec

from direct_frontend.kv.events import BlockRemoved, BlockStored, _decode_general, decode_payload
from direct_frontend.kv.index import KvIndex
from direct_frontend.simulator.kv_publisher import sglang_batch, vllm_batch
from direct_frontend.simulator.kvcache import RemovedBlocks, StoredRun

BS = 16
PROMPT_BLOCKS = 256  # 4096 tokens
SYSTEM_BLOCKS = 32  # a 512-token system prompt every engine caches


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def micro(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = statistics.median(ordered) * 1e6
    p99 = ordered[int(len(ordered) * 0.99) - 1] * 1e6
    return f"p50 {p50:8.1f} µs   p99 {p99:8.1f} µs"


def payload_for(hashes: list[int], parent: int | None, tokens: list[int]) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return msgspec.msgpack.encode([time.time(), [event], 0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--events-only", action="store_true",
                        help="only the per-batch KV event cases (no 1M-block fill)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    event_batches(random.Random(args.seed + 1))  # (its own: the fill below draws as before)
    if args.events_only:
        return
    engines = [f"engine-{i}" for i in range(args.engines)]
    index = KvIndex(BS, max_blocks=args.blocks * 2)
    system = [rng.randrange(150_000) for _ in range(SYSTEM_BLOCKS * BS)]
    tail_blocks = PROMPT_BLOCKS - SYSTEM_BLOCKS

    # -- fill: every engine caches the system prompt, then many distinct 4k prompts
    next_hash = 1
    prompts: dict[str, list[list[int]]] = {e: [] for e in engines}
    events: list[tuple[str, BlockStored]] = []
    system_hash: dict[str, int] = {}
    for engine in engines:
        hashes = list(range(next_hash, next_hash + SYSTEM_BLOCKS))
        next_hash += SYSTEM_BLOCKS
        events.append((engine, _stored(hashes, None, system)))
        system_hash[engine] = hashes[-1]
    total = SYSTEM_BLOCKS * len(engines)
    i = 0
    while total < args.blocks:
        engine = engines[i % len(engines)]
        i += 1
        tail = [rng.randrange(150_000) for _ in range(tail_blocks * BS)]
        hashes = list(range(next_hash, next_hash + tail_blocks))
        next_hash += tail_blocks
        events.append((engine, _stored(hashes, system_hash[engine], tail)))
        prompts[engine].append(system + tail)
        total += tail_blocks
    start = time.perf_counter()
    for engine, event in events:
        index.store(engine, event)
    fill = time.perf_counter() - start
    stats = index.stats()
    print(f"index: {stats.blocks:,} blocks, {stats.prefixes:,} prefixes, {stats.engines} engines")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  bytes estimate {stats.bytes_estimate / 2**20:,.0f} MiB; "
          f"process max RSS {rss:,.0f} MiB (includes the benchmark's own prompts)")
    print(f"  fill (BlockStored, {tail_blocks}-block events, dicts growing): "
          f"{fill / stats.blocks * 1e9:,.0f} ns/block")

    # -- per request: hash + lookup of a 4k-token prompt
    hit = prompts[engines[3]][len(prompts[engines[3]]) // 2]
    shared = system + [rng.randrange(150_000) for _ in range(tail_blocks * BS)]
    miss = [rng.randrange(150_000) for _ in range(PROMPT_BLOCKS * BS)]
    assert index.lookup(hit)[engines[3]] == PROMPT_BLOCKS
    assert index.lookup(shared) == {e: SYSTEM_BLOCKS for e in engines}
    assert index.lookup(miss) == {}
    repeat = 2000
    tokens_n = PROMPT_BLOCKS * BS
    print(f"per request, {tokens_n}-token prompt ({PROMPT_BLOCKS} blocks), {repeat} runs:")
    hashing = timed(lambda: index.request_hashes(hit), repeat)
    print(f"  {'hash only (request_hashes)':42s} {micro(hashing)}")
    cases = (("full hit on one engine", hit), ("system prompt on all engines", shared),
             ("miss", miss))
    for name, prompt in cases:
        hashes = index.request_hashes(prompt)
        walk = timed(lambda h=hashes: index.lookup_hashes(h), repeat)  # type: ignore[misc]
        both = timed(lambda p=prompt: index.lookup(p), repeat)  # type: ignore[misc]
        print(f"  {'walk only, ' + name:42s} {micro(walk)}")
        print(f"  {'hash + walk, ' + name:42s} {micro(both)}")

    # -- event side: decode + apply per block
    tokens = [rng.randrange(150_000) for _ in range(PROMPT_BLOCKS * BS)]
    hashes = list(range(next_hash, next_hash + PROMPT_BLOCKS))
    next_hash += PROMPT_BLOCKS
    payload = payload_for(hashes, None, tokens)
    decode = timed(lambda: decode_payload(payload), 500)
    print(f"events, one {PROMPT_BLOCKS}-block BlockStored ({len(payload):,} bytes msgpack):")
    print(f"  decode   {statistics.median(decode) / PROMPT_BLOCKS * 1e9:8,.0f} ns/block")
    batch = decode_payload(payload)
    applies = []
    removes = []
    for _ in range(200):
        start = time.perf_counter()
        index.apply("bench", batch)
        applies.append(time.perf_counter() - start)
        start = time.perf_counter()
        index.remove("bench", BlockRemoved(tuple(hashes), "GPU"))
        removes.append(time.perf_counter() - start)
    print(f"  store    {statistics.median(applies) / PROMPT_BLOCKS * 1e9:8,.0f} ns/block")
    print(f"  remove   {statistics.median(removes) / PROMPT_BLOCKS * 1e9:8,.0f} ns/block")

    # -- fencing
    victim = engines[0]
    n = index.blocks_of(victim)
    start = time.perf_counter()
    index.clear_engine(victim)
    cleared = time.perf_counter() - start
    steps = []
    while True:
        start = time.perf_counter()
        if not index.sweep():
            break
        steps.append(time.perf_counter() - start)
    print(f"clear_engine of {n:,} blocks: {cleared * 1e6:,.1f} µs (bit retired), then "
          f"{len(steps)} sweep steps of p50 {statistics.median(steps) * 1e3:.2f} ms "
          f"({sum(steps) / n * 1e9:,.0f} ns/block in all)")


def event_batches(rng: random.Random, repeat: int = 200) -> None:
    """Decode and apply per batch, for the batch shapes the engines publish."""
    print(f"per batch of KV events (median of {repeat}; index block size {BS}):")
    cases = (
        ("sglang, 1024 one-token pages chained", _sglang_case(rng, 1024, 1)),
        ("sglang, 64 pages of 16 chained", _sglang_case(rng, 64, BS)),
        ("vllm, store 8 blocks + 8 removals", _vllm_case(rng, 8, 8)),
        ("vllm, store 64 blocks + 64 removals", _vllm_case(rng, 64, 64)),
    )
    for name, (store, remove, blocks) in cases:
        index = KvIndex(BS)
        decodes, applies, generals = [], [], []
        for _ in range(repeat):
            start = time.perf_counter()
            _decode_general(store, 0, b"")  # the general path, as every batch once took
            generals.append(time.perf_counter() - start)
            start = time.perf_counter()
            batch = decode_payload(store)
            mid = time.perf_counter()
            index.apply("bench", batch)
            applies.append(time.perf_counter() - mid)
            decodes.append(mid - start)
            index.apply("bench", decode_payload(remove))  # back to empty, untimed
        assert len(index) == 0, "the removals did not undo the stores"
        decode, apply = statistics.median(decodes) * 1e6, statistics.median(applies) * 1e6
        general = statistics.median(generals) * 1e6
        print(f"  {name:38s} {len(store):7,} B  decode {decode:8.1f} µs (general path "
              f"{general:8.1f}, ×{decode / general:.2f})  apply {apply:8.1f} µs"
              f"  = {(decode + apply) / blocks:6.2f} µs per page/block")


def _sglang_case(rng: random.Random, pages: int, size: int) -> tuple[bytes, bytes, int]:
    """One chain of ``pages`` one-page stores (SGLang's signed hashes) and their removal."""
    hashes: list[int | bytes] = [rng.randrange(-(2**63), 2**63) for _ in range(pages)]
    tokens = [rng.randrange(150_000) for _ in range(pages * size)]
    store = sglang_batch([StoredRun(hashes, None, tokens, size)], time.time())
    return store, sglang_batch([RemovedBlocks(hashes)], time.time()), pages


def _vllm_case(rng: random.Random, blocks: int, removals: int) -> tuple[bytes, bytes, int]:
    """A vLLM step: one store of ``blocks`` and ``removals`` single-block removal events
    (of blocks the index never held), then the store's removal."""
    hashes: list[int | bytes] = [rng.randrange(2**64) for _ in range(blocks)]
    gone: list[int | bytes] = [rng.randrange(2**64) for _ in range(removals)]
    tokens = [rng.randrange(150_000) for _ in range(blocks * BS)]
    store = vllm_batch([StoredRun(hashes, None, tokens, BS), RemovedBlocks(gone)], time.time())
    return store, vllm_batch([RemovedBlocks(hashes)], time.time()), blocks


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    import array

    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=array.array("I", tokens),
        block_size=BS,
        medium="GPU",
    )


if __name__ == "__main__":
    main()
