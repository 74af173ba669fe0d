"""The simulator's prefix cache and KV events, alone and end to end with the subscriber.

- the cache (no I/O): hits from block 0, the one-token cap, decode blocks,
  LRU eviction tail first, pinning, clears, each engine kind's hash style;
- over gRPC: ``cached_tokens`` is real and prefill time follows the uncached
  tokens;
- end to end under Trio (the daemon's arrangement): simulated vLLM and SGLang
  engines publish, subscribers index, and a lookup names the engine that
  served a prompt sharing a long prefix, predicting its ``cached_tokens``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import trio
import trio_asyncio
from grpclib.client import Channel

from direct_frontend.kv.events import decode_payload
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.subscriber import KvSubscription, run_kv_subscriber
from direct_frontend.protos import (
    common_pb2,
    sglang_scheduler_pb2,
    trtllm_service_pb2,
    vllm_engine_pb2,
)
from direct_frontend.protos.sglang_scheduler_grpc import SglangSchedulerStub
from direct_frontend.protos.trtllm_service_grpc import TrtllmServiceStub
from direct_frontend.protos.vllm_engine_grpc import VllmEngineStub
from direct_frontend.simulator import EngineConfig, EngineKind, SimEngine, TimingModel
from direct_frontend.simulator.kv_publisher import SimKvEvents
from direct_frontend.simulator.kvcache import (
    CacheCleared,
    CacheEvent,
    RemovedBlocks,
    SimPrefixCache,
    StoredRun,
)
from tests.support.daemon import free_ports
from tests.support.sim import run, run_trio, started, started_from_trio, until_trio

VOCAB = 2000
EOS = 2


class Sink:
    def __init__(self) -> None:
        self.batches: list[list[CacheEvent]] = []

    def __call__(self, events: list[CacheEvent]) -> None:
        self.batches.append(events)

    def take(self) -> list[list[CacheEvent]]:
        out, self.batches = self.batches, []
        return out


def cache(
    capacity: int = 100, block_size: int = 4, style: Any = "vllm"
) -> tuple[SimPrefixCache, Sink]:
    sink = Sink()
    return SimPrefixCache(capacity, block_size, style, sink=sink), sink


# -- the cache alone -------------------------------------------------------------------


def test_a_miss_stores_and_announces_every_full_block() -> None:
    c, sink = cache()
    alloc = c.admit(list(range(10, 20)))  # 2 full blocks + 2 tokens
    assert alloc.cached_tokens == 0
    ((run,),) = sink.take()
    assert isinstance(run, StoredRun)
    assert run.parent_block_hash is None and run.token_ids == list(range(10, 18))
    assert run.block_hashes == c.wire_hashes(list(range(10, 18)))
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in run.block_hashes)


def test_hits_count_from_block_zero_and_leave_one_token_to_compute() -> None:
    c, sink = cache()
    prompt = list(range(10, 18))  # exactly 2 blocks
    c.release(c.admit(prompt))
    sink.take()
    assert c.admit(prompt).cached_tokens == 4  # not 8: the last token is recomputed
    assert c.admit([*prompt, 99]).cached_tokens == 8
    assert sink.take() == []  # nothing new to announce
    shared = [*prompt[:4], 50, 51, 52, 53, 54]
    alloc = c.admit(shared)
    assert alloc.cached_tokens == 4
    ((run,),) = sink.take()
    assert isinstance(run, StoredRun)
    assert run.parent_block_hash == c.wire_hashes(prompt)[0]  # chained to the hit
    assert run.token_ids == [50, 51, 52, 53]


def test_blocks_filled_during_decode_are_announced_as_they_fill() -> None:
    c, sink = cache()
    alloc = c.admit([1, 2, 3, 4, 5, 6])
    sink.take()
    c.extend(alloc, 7)
    assert sink.take() == []
    c.extend(alloc, 8)  # block 2 is full now: prompt tokens 5, 6 plus two generated
    ((run,),) = sink.take()
    assert isinstance(run, StoredRun)
    assert run.token_ids == [5, 6, 7, 8]
    assert run.parent_block_hash == c.wire_hashes([1, 2, 3, 4])[0]
    c.release(alloc)
    assert c.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_lru_eviction_takes_a_requests_tail_first_and_announces_removals_first() -> None:
    c, sink = cache(capacity=4)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]
    c.release(c.admit(a))
    c.release(c.admit(b))
    sink.take()
    c.release(c.admit([21, 22, 23, 24, 25]))  # one new block: evicts a's tail
    ((removed, run),) = sink.take()
    assert removed == RemovedBlocks([c.wire_hashes(a)[1]])
    assert isinstance(run, StoredRun)
    assert c.cached_prefix_tokens(a) == 4 and c.evictions == 1
    c.release(c.admit([*a[:4], 1]))  # touching a's head makes b the oldest
    c.release(c.admit([31, 32, 33, 34, 35]))
    ((removed, _),) = sink.take()
    assert removed == RemovedBlocks([c.wire_hashes(b)[1]])


def test_pinned_blocks_are_never_evicted() -> None:
    c, sink = cache(capacity=2)
    held = c.admit([1, 2, 3, 4, 5, 6, 7, 8, 9])  # running: both blocks pinned
    sink.take()
    other = c.admit([11, 12, 13, 14, 15])
    assert other.cached_tokens == 0 and not other.open and sink.take() == []
    c.release(held)
    c.release(c.admit([11, 12, 13, 14, 15]))
    ((removed, run),) = sink.take()
    assert isinstance(removed, RemovedBlocks) and isinstance(run, StoredRun)


def test_clear_announces_and_keeps_pinned_blocks_reset_is_silent() -> None:
    c, sink = cache()
    c.release(c.admit([1, 2, 3, 4, 5]))
    running = c.admit([6, 7, 8, 9, 10])
    sink.take()
    c.clear()
    assert sink.take() == [[CacheCleared()]]
    assert len(c) == 1  # the running request's block stays
    c.reset()  # a new process
    assert len(c) == 0 and sink.take() == []
    c.release(running)  # an allocation of the old incarnation is harmless
    c.extend(running, 1)


def test_engine_hash_styles() -> None:
    """SGLang's exact scheme gives the doc's vector (docs/kv-events.md §12.4)."""
    sglang, _ = cache(style="sglang")
    assert sglang.wire_hashes([1, 2, 3, 4, 5, 6, 7, 8]) == [
        -3488128144981237669,
        5674439469042975057,
    ]
    as_bytes, _ = cache(style="vllm-bytes")
    as_int, _ = cache(style="vllm")
    digest = as_bytes.wire_hashes([1, 2, 3, 4])[0]
    assert isinstance(digest, bytes) and len(digest) == 32
    assert as_int.wire_hashes([1, 2, 3, 4])[0] == int.from_bytes(digest[-8:], "big")


def test_disabled_cache_does_nothing() -> None:
    sink = Sink()
    c = SimPrefixCache(10, 4, "vllm", enabled=False, sink=sink)
    c.release(c.admit([1, 2, 3, 4, 5]))
    assert c.admit([1, 2, 3, 4, 5]).cached_tokens == 0 and sink.batches == [] and len(c) == 0


def test_trtllm_gets_a_cache_but_no_publisher() -> None:
    with pytest.raises(ValueError, match="no KV events"):
        SimKvEvents("trtllm", SimPrefixCache(10, 16, "vllm"), events_port=0)
    with pytest.raises(ValueError, match="needs kv_events_port"):
        SimKvEvents("vllm", SimPrefixCache(10, 16, "vllm"), replay_port=0)


# -- over gRPC ----------------------------------------------------------------------------


def request_for(
    kind: EngineKind, request_id: str, prompt: Sequence[int], max_tokens: int,
    rank: int | None = None,
) -> Any:
    if kind == "sglang":
        return sglang_scheduler_pb2.GenerateRequest(
            request_id=request_id,
            tokenized=sglang_scheduler_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=sglang_scheduler_pb2.SamplingParams(
                max_new_tokens=max_tokens, ignore_eos=True
            ),
            stream=True,
            data_parallel_rank=rank,
        )
    if kind == "vllm":
        return vllm_engine_pb2.GenerateRequest(
            request_id=request_id,
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            stream=True,
            data_parallel_rank=rank,
        )
    return trtllm_service_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=trtllm_service_pb2.TokenizedInput(input_token_ids=prompt),
        max_tokens=max_tokens,
        streaming=True,
        ignore_eos=True,
    )


async def generate(
    kind: EngineKind, port: int, prompt: Sequence[int], max_tokens: int = 4,
    rank: int | None = None,
) -> tuple[int, float]:
    """One streamed request on asyncio: the final ``cached_tokens`` and the time to first token."""
    channel = Channel("127.0.0.1", port)
    try:
        stub: Any = {
            "sglang": SglangSchedulerStub,
            "vllm": VllmEngineStub,
            "trtllm": TrtllmServiceStub,
        }[kind](channel)
        start = time.monotonic()
        ttft = 0.0
        cached = -1
        async with stub.Generate.open() as call:
            await call.send_message(request_for(kind, "r", prompt, max_tokens, rank), end=True)
            async for reply in call:
                which = reply.WhichOneof("response")
                if which == "chunk" and not ttft:
                    ttft = time.monotonic() - start
                    assert reply.chunk.cached_tokens >= 0
                if which == "complete":
                    cached = reply.complete.cached_tokens
        return cached, ttft
    finally:
        channel.close()


def new_engine(kind: EngineKind, **options: Any) -> SimEngine:
    """An engine of this file's model (not yet started)."""
    return SimEngine(EngineConfig(kind, "m", VOCAB, EOS, **options))


LONG = [(7 * i + 11) % 1900 + 10 for i in range(256)]  # 16 blocks of 16


@pytest.mark.parametrize(("kind", "sizes"), [("vllm", {}), ("sglang", {"page_size": 16}),
                                             ("trtllm", {})])
def test_cached_tokens_are_reported(kind: EngineKind, sizes: dict[str, int]) -> None:
    async def body() -> None:
        async with started(new_engine(kind, **sizes)) as engine:
            first, _ = await generate(kind, engine.port, LONG)
            again, _ = await generate(kind, engine.port, LONG)
            shared, _ = await generate(kind, engine.port, [*LONG[:100], 5, 6, 7])
            assert (first, again, shared) == (0, 240, 96)  # capped, and block-aligned

    run(body())


def test_prefill_time_follows_the_uncached_tokens() -> None:
    async def body() -> None:
        timing = TimingModel(prefill_us_per_token=1000, decode_us_per_token=0)
        async with started(new_engine("vllm", timing=timing)) as engine:
            _, cold = await generate("vllm", engine.port, LONG, max_tokens=1)
            cached, warm = await generate("vllm", engine.port, LONG, max_tokens=1)
            assert cached == 240
            assert cold >= 0.25  # 256 tokens at 1 ms
            assert warm < cold / 3  # 16 uncached tokens
        engine = new_engine("vllm", timing=timing, enable_prefix_cache=False)
        async with started(engine):
            await generate("vllm", engine.port, LONG, max_tokens=1)
            cached, again = await generate("vllm", engine.port, LONG, max_tokens=1)
            assert cached == 0 and again >= 0.25

    run(body())


# -- end to end: simulator → ZMQ → subscriber → index ------------------------------------


@contextlib.asynccontextmanager
async def fleet(
    index: KvIndex, specs: dict[str, tuple[EngineKind, dict[str, Any]]]
) -> AsyncIterator[dict[str, tuple[SimEngine, KvSubscription]]]:
    """Engines on the trio-asyncio loop, each with a subscriber into ``index``."""
    async with contextlib.AsyncExitStack() as stack:
        engines: dict[str, SimEngine] = {}
        for name, (kind, options) in specs.items():
            engine = new_engine(kind, kv_events_port=0, kv_replay_port=0, **options)
            engines[name] = await stack.enter_async_context(started_from_trio(engine))
        async with trio.open_nursery() as nursery:
            out = {}
            for name, engine in engines.items():
                assert engine.kv_events_endpoint is not None
                sub = await nursery.start(
                    functools.partial(
                        run_kv_subscriber,
                        name,
                        engine.kv_events_endpoint,
                        engine.kv_replay_endpoint,
                        index,
                        16,
                        on_malformed=lambda e: pytest.fail(f"malformed from {e}"),
                    )
                )
                out[name] = (engine, sub)
            yield out
            nursery.cancel_scope.cancel()


async def serve(
    engine: SimEngine, prompt: Sequence[int], max_tokens: int = 4, rank: int | None = None
) -> int:
    """One request from Trio (pinned to ``rank`` if given); the engine's ``cached_tokens``."""
    call = trio_asyncio.aio_as_trio(generate)
    cached: int = (await call(engine.kind, engine.port, prompt, max_tokens, rank))[0]
    return cached


def synced(index: KvIndex, engine: str, sub: KvSubscription, pub_seq: Callable[[], int]) -> bool:
    return sub.tracker.state == "live" and sub.tracker.next_seq == pub_seq()


def test_lookup_names_the_engine_that_served_a_shared_prefix() -> None:
    async def body() -> None:
        index = KvIndex(16)
        specs: dict[str, tuple[EngineKind, dict[str, Any]]] = {
            "vllm-a": ("vllm", {}),
            "sglang-b": ("sglang", {"page_size": 16}),
        }
        async with fleet(index, specs) as engines:
            (a, sub_a), (b, sub_b) = engines["vllm-a"], engines["sglang-b"]
            system = LONG[:160]  # 10 blocks
            prompt_a = [*system, *range(1000, 1040)]
            prompt_b = [*range(500, 700)]
            assert await serve(a, prompt_a, max_tokens=8) == 0  # 208 tokens: 13 blocks
            assert await serve(b, prompt_b) == 0

            def seq_of(engine: SimEngine) -> Callable[[], int]:
                return lambda: engine.kv_publisher.next_seq if engine.kv_publisher else -1

            await until_trio(lambda: synced(index, "a", sub_a, seq_of(a)), what="a indexed")
            await until_trio(lambda: synced(index, "b", sub_b, seq_of(b)), what="b indexed")
            follow_up = [*system, *range(1000, 1016), 1, 2, 3]  # 11 blocks shared with A
            predicted = index.lookup(follow_up)
            assert predicted == {"vllm-a": 11}
            assert index.lookup(prompt_b) == {"sglang-b": 12}  # 200 tokens: 12 full pages
            # The hit-rate check: the engine's own count matches the prediction.
            assert await serve(a, follow_up) == predicted["vllm-a"] * 16
            assert await serve(b, [*prompt_b[:64], 9]) == 64
            # The 13th block filled during decode (8 prompt + 8 generated tokens): indexed too.
            assert index.blocks_of("vllm-a") == 13

    run_trio(body)


def test_restart_flush_and_history_replay_through_the_simulator() -> None:
    async def body() -> None:
        index = KvIndex(16)
        async with fleet(index, {"v": ("vllm", {})}) as engines:
            engine, sub = engines["v"]
            prompt = LONG[:128]

            def caught_up() -> bool:
                pub = engine.kv_publisher
                return pub is not None and synced(index, "v", sub, lambda: pub.next_seq)

            await serve(engine, prompt)
            await until_trio(caught_up, what="indexed")
            assert index.lookup(prompt) == {"v": 8}
            # A forced gap: the batch is lost live and recovered by replay.
            assert engine.kv_publisher is not None
            engine.kv_publisher.drop_next(1)
            other = LONG[128:]
            await serve(engine, other)
            await serve(engine, list(range(1500, 1540)))  # a later batch reveals the gap
            await until_trio(caught_up, what="gap replayed")
            assert index.lookup(other) == {"v": 8}
            # FlushCache: AllBlocksCleared empties the index.
            await trio_asyncio.aio_as_trio(flush)(engine.port)
            await until_trio(lambda: len(index) == 0, what="flushed")
            # A restart: the connection drops, the index is cleared, then rebuilt.
            await serve(engine, prompt)
            await until_trio(lambda: index.lookup(prompt) == {"v": 8}, what="re-indexed")
            await trio_asyncio.aio_as_trio(engine.restart)()
            await until_trio(lambda: len(index) == 0, what="cleared on restart")
            assert await serve(engine, prompt) == 0  # the new process has a cold cache
            await until_trio(lambda: index.lookup(prompt) == {"v": 8}, what="new incarnation")
            assert sub.tracker.stats.restarts + sub.tracker.stats.clears >= 3

    run_trio(body)


async def flush(port: int, kind: EngineKind = "vllm") -> None:
    channel = Channel("127.0.0.1", port)
    try:
        stub = SglangSchedulerStub(channel) if kind == "sglang" else VllmEngineStub(channel)
        await stub.FlushCache(common_pb2.FlushCacheRequest())
    finally:
        channel.close()


def test_published_payloads_decode_per_kind() -> None:
    """What the simulator's engines actually put on the wire, decoded by the router."""

    async def body() -> None:
        kinds: tuple[tuple[EngineKind, int], ...] = (("vllm", 1), ("sglang", 16))
        for kind, page_size in kinds:
            engine = new_engine(kind, kv_events_port=0, page_size=page_size)
            async with started(engine):
                pub = engine.kv_publisher
                assert pub is not None
                await generate(engine.kind, engine.port, LONG[:40])
                seq, payload = pub._history[-1]
                batch = decode_payload(payload, seq=seq)
                stores = batch.events
                assert stores and all(e.block_size == 16 for e in stores)  # type: ignore[union-attr]
                assert batch.dp_rank == (0 if kind == "vllm" else None)
                assert len(stores) == (1 if kind == "vllm" else 2)  # SGLang: one per page

    run(body())


# -- data-parallel ranks: a cache, a publisher and a port each -------------------------------


@pytest.mark.parametrize(("kind", "sizes"), [("vllm", {}), ("sglang", {"page_size": 16})])
def test_each_rank_publishes_on_its_own_port_stamped_with_its_rank(
    kind: EngineKind, sizes: dict[str, int]
) -> None:
    async def body() -> None:
        index = KvIndex(16)
        events, replay = free_ports(2), free_ports(2)
        engine = new_engine(kind, kv_events_port=events, kv_replay_port=replay, dp_size=2,
                            **sizes)
        async with started_from_trio(engine), trio.open_nursery() as nursery:
            assert engine.kv_events_endpoints == [
                f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 1}"]
            assert engine.kv_replay_endpoints == [
                f"tcp://127.0.0.1:{replay}", f"tcp://127.0.0.1:{replay + 1}"]
            assert engine.kv_events_endpoint == engine.kv_events_endpoints[0]  # rank 0's
            subs = [
                await nursery.start(functools.partial(
                    run_kv_subscriber, f"rank{rank}", endpoint, replay_endpoint, index, 16,
                    on_malformed=lambda e: pytest.fail(f"malformed from {e}")))
                for rank, (endpoint, replay_endpoint) in enumerate(
                    zip(engine.kv_events_endpoints, engine.kv_replay_endpoints, strict=True))
            ]
            publishers = [rank.publisher for rank in engine.kv_ranks]
            assert None not in publishers

            def caught_up() -> bool:
                return all(synced(index, "", sub, lambda p=pub: p.next_seq)  # type: ignore[union-attr]
                           for sub, pub in zip(subs, publishers, strict=True))

            prompt = LONG[:64]
            if kind == "vllm":
                assert await serve(engine, prompt, rank=1) == 0
                assert await serve(engine, prompt, rank=1) == 48  # rank 1's cache
                assert await serve(engine, prompt, rank=0) == 0  # not rank 0's
                assert engine.stats.rank_of == {"r": 0}  # the last of the three, by request id
            else:  # SGLang reads no rank: its balancer takes turns, 0, 1, then 0 again
                assert [await serve(engine, prompt, rank=1) for _ in range(3)] == [0, 0, 48]
            await until_trio(caught_up, what="both ranks indexed")
            assert index.lookup(prompt) == {"rank0": 4, "rank1": 4}
            for rank, pub in enumerate(publishers):
                assert pub is not None
                seq, payload = pub._history[-1]
                assert decode_payload(payload, seq=seq).dp_rank == rank  # SGLang too: DP > 1
            # FlushCache clears every rank, each announcing it on its own port.
            await trio_asyncio.aio_as_trio(flush)(engine.port, kind)
            await until_trio(lambda: len(index) == 0, what="both ranks cleared")
            # A restart: every rank starts over cold at seq 0, on the same ports.
            await trio_asyncio.aio_as_trio(engine.restart)()
            assert [rank.publisher.next_seq for rank in engine.kv_ranks  # type: ignore[union-attr]
                    ] == [0, 0]
            assert engine.kv_events_endpoints[1] == f"tcp://127.0.0.1:{events + 1}"
            assert await serve(engine, prompt, rank=1) == 0
            nursery.cancel_scope.cancel()

    run_trio(body)


def test_one_sglang_rank_stamps_no_rank_and_free_ports_are_picked_per_rank() -> None:
    async def body() -> None:
        for kind, dp_size, stamps in (("sglang", 1, [None]), ("vllm", 2, [0, 1])):
            engine = new_engine(kind, kv_events_port=0, dp_size=dp_size)
            async with started(engine):
                assert len(set(engine.kv_events_endpoints)) == dp_size
                assert engine.kv_replay_endpoints == []
                assert [rank.publisher.dp_rank for rank in engine.kv_ranks  # type: ignore[union-attr]
                        ] == stamps

    run(body())
