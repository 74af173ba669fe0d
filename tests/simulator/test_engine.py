"""The engine simulator: its token model, and each kind's contract over a real socket.

Every server test starts a :class:`SimEngine` on 127.0.0.1 (a free port) and
talks to it with a grpclib ``Channel`` and the generated stubs, the way the
router will. The stream quirks asserted here are the ones
``docs/engine-contracts.md`` §4–§6 documents for the stock servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import itertools
import time
import zipfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio_asyncio
from google.protobuf.message import DecodeError
from grpclib import GRPCError, Status
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from direct_frontend.protos import (
    common_pb2,
    sglang_scheduler_pb2,
    trtllm_service_pb2,
    vllm_engine_pb2,
)
from direct_frontend.protos.sglang_scheduler_grpc import SglangSchedulerStub
from direct_frontend.protos.trtllm_service_grpc import TrtllmServiceStub
from direct_frontend.protos.vllm_engine_grpc import VllmEngineStub
from direct_frontend.simulator import (
    EngineConfig,
    EngineKind,
    Generation,
    SimEngine,
    SimModel,
    SimSequence,
    StopCriteria,
    TimingModel,
    read_tokenizer_dir,
)
from tests.support.sim import (
    EOS,
    SPECIAL,
    VOCAB,
    connected,
    run,
    run_trio,
    serving,
    start_cli,
    stop_cli,
    until,
)

KINDS: tuple[EngineKind, ...] = ("sglang", "vllm", "trtllm")
PROMPT = (11, 12, 13, 14, 15)
SLOW = TimingModel(prefill_us_per_token=0, decode_us_per_token=20_000, max_running=8)


# -- a minimal per-kind client ------------------------------------------------


@dataclasses.dataclass
class Reply:
    """One Generate call as received: responses in order, split by oneof."""

    responses: list[Any]
    chunks: list[Any]
    complete: Any


def build_request(
    kind: EngineKind,
    request_id: str,
    prompt: Sequence[int],
    *,
    max_tokens: int | None,
    stream: bool,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    min_tokens: int = 0,
    rank: int | None = None,
) -> Any:
    if kind == "sglang":
        sg_params = sglang_scheduler_pb2.SamplingParams(
            temperature=0.0,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            min_new_tokens=min_tokens,
        )
        if max_tokens is not None:
            sg_params.max_new_tokens = max_tokens
        return sglang_scheduler_pb2.GenerateRequest(
            request_id=request_id,
            tokenized=sglang_scheduler_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=sg_params,
            stream=stream,
            data_parallel_rank=rank,
        )
    if kind == "vllm":
        vl_params = vllm_engine_pb2.SamplingParams(
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, min_tokens=min_tokens
        )
        if max_tokens is not None:
            vl_params.max_tokens = max_tokens
        return vllm_engine_pb2.GenerateRequest(
            request_id=request_id,
            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vl_params,
            stream=stream,
            data_parallel_rank=rank,
        )
    sampling = trtllm_service_pb2.SamplingConfig()
    if min_tokens:
        sampling.min_tokens = min_tokens
    return trtllm_service_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=trtllm_service_pb2.TokenizedInput(input_token_ids=prompt),
        sampling_config=sampling,
        max_tokens=max_tokens or 0,
        streaming=stream,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    )


def generate_method(kind: EngineKind, channel: Channel) -> Any:
    if kind == "sglang":
        return SglangSchedulerStub(channel).Generate
    if kind == "vllm":
        return VllmEngineStub(channel).Generate
    return TrtllmServiceStub(channel).Generate


async def generate(
    kind: EngineKind,
    channel: Channel,
    prompt: Sequence[int] = PROMPT,
    *,
    request_id: str = "req-1",
    max_tokens: int | None = 64,
    stream: bool = True,
    **options: Any,
) -> Reply:
    request = build_request(
        kind, request_id, prompt, max_tokens=max_tokens, stream=stream, **options
    )
    responses = list(await generate_method(kind, channel)(request))
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert len(completes) == 1, "exactly one terminal complete"
    assert responses[-1].WhichOneof("response") == "complete", "the complete comes last"
    return Reply(responses, chunks, completes[0])


def complete_ids(kind: EngineKind, complete: Any) -> list[int]:
    return list(complete.output_token_ids if kind == "trtllm" else complete.output_ids)


def output_of(kind: EngineKind, reply: Reply, *, stream: bool) -> list[int]:
    """The generated tokens by the contract's own rules: chunks when streaming."""
    if stream:
        return [token for chunk in reply.chunks for token in chunk.token_ids]
    return complete_ids(kind, reply.complete)


async def abort(kind: EngineKind, channel: Channel, request_id: str) -> Any:
    if kind == "sglang":
        return await SglangSchedulerStub(channel).Abort(
            sglang_scheduler_pb2.AbortRequest(request_id=request_id, reason="test")
        )
    if kind == "vllm":
        return await VllmEngineStub(channel).Abort(
            vllm_engine_pb2.AbortRequest(request_ids=[request_id])
        )
    return await TrtllmServiceStub(channel).Abort(
        trtllm_service_pb2.AbortRequest(request_id=request_id)
    )


def find_eos_prompt(model: SimModel, *, within: int = 60) -> tuple[tuple[int, ...], int]:
    """A prompt whose uninterrupted run hits EOS early, and the EOS position."""
    for first in range(10, 400):
        prompt = (first, 7, 8)
        run_ids = Generation(model, prompt, StopCriteria(max_tokens=within)).run()
        if run_ids[-1] == model.eos_token_id and len(run_ids) >= 3:
            return prompt, len(run_ids) - 1
    raise AssertionError("no prompt reaches EOS")


def reference_model() -> SimModel:
    return SimModel(VOCAB, EOS, SPECIAL)


# -- the sans-IO model --------------------------------------------------------


def test_next_token_depends_only_on_the_prefix() -> None:
    model = reference_model()
    sequence = SimSequence(model, PROMPT)
    generated = [sequence.step() for _ in range(50)]
    for k in range(len(generated)):
        assert model.next_token([*PROMPT, *generated[:k]]) == generated[k]
    # Continuing from prompt + first k tokens reproduces the rest exactly.
    resumed = SimSequence(model, [*PROMPT, *generated[:20]])
    assert [resumed.step() for _ in range(30)] == generated[20:]
    # Another seed is another model; the same seed is the same model.
    assert SimModel(VOCAB, EOS, SPECIAL, seed=1).next_token(PROMPT) != generated[0] or (
        SimModel(VOCAB, EOS, SPECIAL, seed=2).next_token(PROMPT) != generated[0]
    )
    assert SimModel(VOCAB, EOS, SPECIAL).next_token(PROMPT) == generated[0]


def test_tokens_avoid_special_ids_and_eos_comes_at_the_configured_rate() -> None:
    model = SimModel(VOCAB, EOS, SPECIAL, eos_probability=0.05)
    sequence = SimSequence(model, (42,))
    drawn = [sequence.step() for _ in range(20_000)]
    assert not SPECIAL & set(drawn)
    assert all(0 <= token < VOCAB for token in drawn)
    rate = drawn.count(EOS) / len(drawn)
    assert 0.04 < rate < 0.06
    assert len(set(drawn)) > VOCAB * 0.9  # spread over the vocabulary
    never = SimModel(VOCAB, EOS, eos_probability=0.0)
    never_seq = SimSequence(never, (42,))
    assert EOS not in [never_seq.step() for _ in range(2000)]


def test_stop_criteria() -> None:
    model = reference_model()
    prompt, eos_at = find_eos_prompt(model)
    natural = Generation(model, prompt, StopCriteria(max_tokens=200)).run()
    assert len(natural) == eos_at + 1 and natural[-1] == EOS

    # max_tokens below the EOS position: a prefix, finished by length.
    short = Generation(model, prompt, StopCriteria(max_tokens=2))
    assert short.run() == natural[:2]
    assert short.finish is not None and short.finish.reason == "length"

    # A stop token id ends the sequence at its first occurrence, and is reported.
    stop_id = natural[1]
    stopped = Generation(
        model, prompt, StopCriteria(max_tokens=200, stop_token_ids=frozenset({stop_id}))
    )
    assert stopped.run() == natural[:2]
    assert stopped.finish is not None
    assert (stopped.finish.reason, stopped.finish.matched_token_id) == ("stop", stop_id)
    assert not stopped.finish.matched_eos

    # ignore_eos masks EOS: same tokens up to it, then ordinary ones, finished by length.
    ignored = Generation(model, prompt, StopCriteria(max_tokens=300, ignore_eos=True))
    ids = ignored.run()
    assert ids[:eos_at] == natural[:eos_at] and EOS not in ids and len(ids) == 300
    assert ignored.finish is not None and ignored.finish.reason == "length"

    # min_tokens masks EOS and stop ids until reached.
    at_least = Generation(model, prompt, StopCriteria(max_tokens=400, min_tokens=eos_at + 5))
    ids = at_least.run()
    assert EOS not in ids[: eos_at + 5]
    assert len(ids) > eos_at + 5
    assert at_least.finish is not None and at_least.finish.matched_eos == (ids[-1] == EOS)

    # A zero budget finishes at once.
    empty = Generation(model, prompt, StopCriteria(max_tokens=0))
    assert empty.finish is not None and empty.finish.reason == "length" and empty.run() == []


def test_timing_model() -> None:
    assert TimingModel().instant
    timing = TimingModel(prefill_us_per_token=100, decode_us_per_token=2000, max_running=4)
    assert not timing.instant
    assert timing.prefill_seconds(50) == pytest.approx(0.005)
    assert timing.decode_seconds == pytest.approx(0.002)
    with pytest.raises(ValueError):
        TimingModel(max_running=0)
    with pytest.raises(ValueError):
        TimingModel(decode_us_per_token=-1)


# -- every kind: streams, determinism, finish reasons -------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_streaming_and_non_streaming_give_the_same_tokens(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind) as (engine, channel):
            streamed = await generate(kind, channel, max_tokens=40, ignore_eos=True)
            whole = await generate(kind, channel, max_tokens=40, ignore_eos=True, stream=False)
            tokens = output_of(kind, streamed, stream=True)
            assert tokens == output_of(kind, whole, stream=False)
            assert len(tokens) == 40
            assert whole.chunks == [] and len(whole.responses) == 1
            assert whole.complete.finish_reason == "length"
            assert whole.complete.prompt_tokens == len(PROMPT)
            assert whole.complete.completion_tokens == 40
            # the repeat hits the prefix cache where blocks are one token (SGLang's page size 1);
            # an engine always recomputes at least the last prompt token
            cached = len(PROMPT) - 1 if kind == "sglang" else 0
            assert whole.complete.cached_tokens == cached
            expected = Generation(
                reference_model(), PROMPT, StopCriteria(max_tokens=40, ignore_eos=True)
            ).run()
            assert tokens == expected
            assert engine.stats.completed == 2 and engine.stats.running == 0

    run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_continuation_is_deterministic(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind) as (_, channel):
            first = await generate(kind, channel, max_tokens=30, ignore_eos=True)
            full = output_of(kind, first, stream=True)
            for k in (1, 7, 29):
                rest = await generate(
                    kind,
                    channel,
                    [*PROMPT, *full[:k]],
                    request_id=f"resume-{k}",
                    max_tokens=30 - k,
                    ignore_eos=True,
                    stream=k % 2 == 0,
                )
                assert output_of(kind, rest, stream=k % 2 == 0) == full[k:]

    run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_finish_reasons(kind: EngineKind) -> None:
    async def body() -> None:
        model = reference_model()
        prompt, eos_at = find_eos_prompt(model)
        natural = Generation(model, prompt, StopCriteria(max_tokens=200)).run()
        async with serving(kind) as (_, channel):
            # EOS: "stop"; only SGLang reports EOS as the matched token.
            eos = await generate(kind, channel, prompt, max_tokens=200)
            assert output_of(kind, eos, stream=True) == natural
            assert eos.complete.finish_reason == "stop"
            if kind == "sglang":
                assert eos.complete.WhichOneof("matched_stop") == "matched_token_id"
                assert eos.complete.matched_token_id == EOS
            else:
                assert eos.complete.WhichOneof("matched_stop") is None

            # max tokens: "length", nothing matched.
            capped = await generate(kind, channel, prompt, max_tokens=2, stream=False)
            assert output_of(kind, capped, stream=False) == natural[:2]
            assert capped.complete.finish_reason == "length"
            assert capped.complete.WhichOneof("matched_stop") is None

            # A stop token id: "stop" with the id reported by every kind.
            stop_id = natural[1]
            stopped = await generate(
                kind, channel, prompt, max_tokens=200, stop_token_ids=[stop_id]
            )
            assert output_of(kind, stopped, stream=True) == natural[:2]
            assert stopped.complete.finish_reason == "stop"
            assert stopped.complete.matched_token_id == stop_id

            # ignore_eos and min_tokens mask EOS.
            ignored = await generate(kind, channel, prompt, max_tokens=eos_at + 10, ignore_eos=True)
            ids = output_of(kind, ignored, stream=True)
            assert EOS not in ids and len(ids) == eos_at + 10
            assert ignored.complete.finish_reason == "length"
            late = await generate(
                kind, channel, prompt, max_tokens=eos_at + 3, min_tokens=eos_at + 3
            )
            assert EOS not in output_of(kind, late, stream=True)

    run(body())


# -- each kind's stream quirks ------------------------------------------------


def test_sglang_repeats_the_last_delta_as_the_complete() -> None:
    async def body() -> None:
        async with serving("sglang") as (_, channel):
            reply = await generate(
                "sglang", channel, request_id="sg-1", max_tokens=5, ignore_eos=True
            )
            assert [r.request_id for r in reply.responses] == ["sg-1"] * 6
            assert [len(c.token_ids) for c in reply.chunks] == [1] * 5
            assert [c.completion_tokens for c in reply.chunks] == [1, 2, 3, 4, 5]  # cumulative
            assert all(c.prompt_tokens == len(PROMPT) for c in reply.chunks)
            # The terminal complete holds only the last delta, again; counts are cumulative.
            assert list(reply.complete.output_ids) == list(reply.chunks[-1].token_ids)
            assert reply.complete.completion_tokens == 5
            assert reply.complete.finish_reason == "length"

    run(body())


def test_vllm_numbers_its_oneof_1_2_counts_deltas_and_has_no_request_id() -> None:
    async def body() -> None:
        async with serving("vllm") as (_, channel):
            reply = await generate("vllm", channel, max_tokens=5, ignore_eos=True)
            assert "request_id" not in vllm_engine_pb2.GenerateResponse.DESCRIPTOR.fields_by_name
            wire = [r.SerializeToString() for r in reply.responses]
            assert [w[:1] for w in wire] == [b"\x0a"] * 5 + [b"\x12"]  # fields 1 and 2
            # Decoded with SGLang's numbering, a vLLM chunk is silently misread.
            with contextlib.suppress(DecodeError):  # or fails to decode at all
                misread = sglang_scheduler_pb2.GenerateResponse.FromString(wire[0])
                assert misread.WhichOneof("response") != "chunk"
            assert [c.completion_tokens for c in reply.chunks] == [1] * 5  # per-chunk delta
            assert list(reply.complete.output_ids) == list(reply.chunks[-1].token_ids)
            assert reply.complete.completion_tokens == 1  # the repeated delta's own length
            assert reply.complete.finish_reason == "length"

            # Unset max_tokens: up to the context window.
        async with serving("vllm", context_length=64) as (_, channel):
            open_ended = await generate("vllm", channel, max_tokens=None, ignore_eos=True)
            assert len(output_of("vllm", open_ended, stream=True)) == 64 - len(PROMPT)

    run(body())


def test_trtllm_complete_is_cumulative_and_not_preceded_by_a_repeat() -> None:
    async def body() -> None:
        async with serving("trtllm") as (_, channel):
            reply = await generate(
                "trtllm", channel, request_id="t-1", max_tokens=5, ignore_eos=True
            )
            streamed = output_of("trtllm", reply, stream=True)
            assert len(streamed) == 5  # the last delta is sent once, as a chunk
            assert [c.completion_tokens for c in reply.chunks] == [1, 2, 3, 4, 5]
            assert complete_ids("trtllm", reply.complete) == streamed  # the whole output
            assert reply.complete.completion_tokens == 5
            assert all(r.request_id == "t-1" for r in reply.responses)

            with pytest.raises(GRPCError) as refused:
                await generate("trtllm", channel, max_tokens=0)
            assert refused.value.status is Status.INVALID_ARGUMENT
        async with serving("trtllm", trtllm_empty_finish_reason=True) as (_, channel):
            blank = await generate("trtllm", channel, max_tokens=2, ignore_eos=True)
            assert blank.complete.finish_reason == ""

    run(body())


def test_sglang_needs_tokens_and_has_no_default_cap() -> None:
    async def body() -> None:
        async with serving("sglang", context_length=64) as (engine, channel):
            stub = SglangSchedulerStub(channel)
            with pytest.raises(GRPCError) as refused:
                await stub.Generate(sglang_scheduler_pb2.GenerateRequest(request_id="no-input"))
            assert refused.value.status is Status.INVALID_ARGUMENT
            assert refused.value.message == "Tokenized input must be provided"
            assert "no-input" in engine.stats.request_ids

            # Unset max_new_tokens means no cap: only the window (max_req_len) stops it.
            reply = await generate("sglang", channel, max_tokens=None, ignore_eos=True)
            assert reply.complete.completion_tokens == 63 - len(PROMPT)

            # Zero new tokens: a prefill-only request still ends with chunk + complete.
            empty = await generate("sglang", channel, max_tokens=0)
            assert [len(c.token_ids) for c in empty.chunks] == [0]
            assert empty.complete.finish_reason == "length"
            assert empty.complete.completion_tokens == 0

            with pytest.raises(GRPCError) as too_long:
                await generate("sglang", channel, list(range(20, 80)))
            assert too_long.value.status is Status.INVALID_ARGUMENT
            with pytest.raises(GRPCError) as out_of_vocab:
                await generate("sglang", channel, [5, VOCAB])
            assert out_of_vocab.value.status is Status.INVALID_ARGUMENT

    run(body())


# -- abort and cancellation ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_abort_stops_generation_and_frees_the_slot(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind, timing=SLOW) as (engine, channel):
            request = build_request(kind, "victim", PROMPT, max_tokens=1000, stream=True)
            async with generate_method(kind, channel).open() as call:
                await call.send_message(request, end=True)
                first = await call.recv_message()
                assert first is not None and first.WhichOneof("response") == "chunk"
                assert engine.stats.running == 1

                reply = await abort(kind, channel, "victim")
                if kind != "vllm":
                    assert reply.success
                rest = [message async for message in call]
                if kind == "sglang":
                    # The stock servicer ends an aborted stream with an error status.
                    with pytest.raises(GRPCError) as ended:
                        await call.recv_trailing_metadata()
                    assert ended.value.status is Status.INTERNAL
                else:
                    reason = "abort" if kind == "vllm" else "cancelled"
                    assert rest[-1].complete.finish_reason == reason
                assert len(rest) < 10  # it stopped well before 1000 tokens

            await until(lambda: engine.stats.running == 0)
            stats = engine.stats
            assert (stats.aborts_received, stats.aborted, stats.cancellations) == (1, 1, 0)
            assert stats.abort_request_ids == ["victim"] and stats.request_ids == ["victim"]

            unknown = await abort(kind, channel, "nobody")
            if kind != "vllm":
                assert not unknown.success
            assert engine.stats.aborts_received == 2 and engine.stats.aborted == 1

    run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_client_cancel_stops_generation_and_frees_the_slot(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind, timing=SLOW) as (engine, channel):
            request = build_request(kind, "leaver", PROMPT, max_tokens=1000, stream=True)
            async with generate_method(kind, channel).open() as call:
                await call.send_message(request, end=True)
                assert await call.recv_message() is not None
                assert engine.stats.running == 1
                await call.cancel()
            await until(lambda: engine.stats.running == 0)
            assert engine.stats.cancellations == 1
            assert engine.stats.cancelled_request_ids == ["leaver"]
            assert engine.stats.aborted == 0 and engine.stats.completed == 0
            # The engine is still fine afterwards.
            reply = await generate(kind, channel, max_tokens=3, ignore_eos=True)
            assert len(output_of(kind, reply, stream=True)) == 3

    run(body())


def test_batch_limit_queues_in_order_and_a_queued_request_can_be_aborted() -> None:
    async def body() -> None:
        timing = TimingModel(decode_us_per_token=5_000, max_running=1)
        async with serving("sglang", timing=timing) as (engine, channel):
            stub = SglangSchedulerStub(channel)
            finished: list[str] = []

            async def one(request_id: str, max_tokens: int) -> None:
                with contextlib.suppress(GRPCError):
                    await generate(
                        "sglang",
                        channel,
                        request_id=request_id,
                        max_tokens=max_tokens,
                        ignore_eos=True,
                    )
                    finished.append(request_id)

            first = asyncio.ensure_future(one("a", 10))
            await until(lambda: engine.stats.running == 1)
            second = asyncio.ensure_future(one("b", 2))
            third = asyncio.ensure_future(one("c", 2))
            await until(lambda: engine.stats.waiting == 2)
            loads = await stub.GetLoads(sglang_scheduler_pb2.GetLoadsRequest())
            load = loads.loads[0]
            assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (1, 2, 3)
            assert load.num_waiting_uncached_tokens == 2 * len(PROMPT)

            reply = await abort("sglang", channel, "b")  # still queued
            assert reply.success
            await asyncio.gather(first, second, third)
            assert finished == ["a", "c"]  # FIFO; the aborted one never ran
            assert engine.stats.aborted == 1 and engine.stats.completed == 2
            assert (engine.stats.running, engine.stats.waiting) == (0, 0)

    run(body())


def test_timing_paces_first_token_and_decode() -> None:
    async def body() -> None:
        timing = TimingModel(prefill_us_per_token=4_000, decode_us_per_token=5_000)
        async with serving("vllm", timing=timing) as (_, channel):
            request = build_request(
                "vllm", "timed", [20] * 10, max_tokens=9, stream=True, ignore_eos=True
            )
            started = time.monotonic()
            arrivals: list[float] = []
            async with generate_method("vllm", channel).open() as call:
                await call.send_message(request, end=True)
                async for _ in call:
                    arrivals.append(time.monotonic() - started)
            assert arrivals[0] >= 0.04 * 0.9  # 10 prompt tokens × 4 ms
            assert arrivals[-1] >= (0.04 + 8 * 0.005) * 0.9  # then 5 ms per token

        async with serving("trtllm") as (_, channel):  # both times 0: never sleeps
            started = time.monotonic()
            reply = await generate(
                "trtllm", channel, max_tokens=3000, ignore_eos=True, stream=False
            )
            assert len(complete_ids("trtllm", reply.complete)) == 3000
            assert time.monotonic() - started < 2.0

    run(body())


# -- health and discovery -----------------------------------------------------


def test_a_health_probe_cancelled_at_any_step_stays_cancelled() -> None:
    """Cancelled after each loop pass in turn, until it ends on its own, the probe raises
    ``CancelledError``: a HealthCheck handler whose stream was reset never replies on it."""
    async def body() -> None:
        core = SimEngine(EngineConfig("sglang", "m", VOCAB, EOS)).core
        for passes in itertools.count():
            probe = asyncio.ensure_future(core.probe())
            for _ in range(passes):
                await asyncio.sleep(0)
            if probe.done():
                assert probe.result() is True  # it ran to its end: every earlier cut was tried
                return
            probe.cancel()
            with pytest.raises(asyncio.CancelledError):
                await probe

    run(body())



def test_sglang_health_and_info() -> None:
    async def body() -> None:
        options: dict[str, Any] = {"context_length": 2048, "role": "prefill", "page_size": 16}
        async with serving("sglang", **options) as (engine, channel):
            stub = SglangSchedulerStub(channel)
            health = await stub.HealthCheck(sglang_scheduler_pb2.HealthCheckRequest())
            assert (health.healthy, health.message) == (True, "OK")
            assert engine.stats.health_checks == 1 and engine.stats.request_ids == []
            engine.healthy = False
            sick = await stub.HealthCheck(sglang_scheduler_pb2.HealthCheckRequest())
            assert not sick.healthy

            info = await stub.GetModelInfo(sglang_scheduler_pb2.GetModelInfoRequest())
            assert info.served_model_name == "sim-model" and info.model_path == "sim"
            assert info.max_context_length == engine.config.pool_tokens != 2048
            assert info.max_req_input_len == 2047 - 5
            assert info.vocab_size == VOCAB and list(info.eos_token_ids) == [EOS]
            assert info.is_generation

            server = await stub.GetServerInfo(sglang_scheduler_pb2.GetServerInfoRequest())
            args = server.server_args
            assert args["disaggregation_mode"] == "prefill"
            assert args["disaggregation_bootstrap_port"] == 8998
            assert args["context_length"] == 2048 and args["page_size"] == 16
            assert server.server_type == "grpc"
            assert server.max_total_num_tokens == engine.config.pool_tokens
            assert abs(server.start_time.ToSeconds() - time.time()) < 60
            assert 0 <= server.uptime_seconds < 60

            loads = await stub.GetLoads(sglang_scheduler_pb2.GetLoadsRequest(include=["disagg"]))
            assert loads.dp_rank_count == 1 and len(loads.loads) == 1
            assert loads.loads[0].disaggregation.mode == "prefill"
            assert loads.loads[0].num_running_reqs == 0

            # A restart on the same port is visible in start_time (restart fencing);
            # the old channel reconnects by itself.
            port = engine.port
            engine.close()
            await engine.wait_closed()
            await asyncio.sleep(0.01)
            await engine.start("127.0.0.1", port)
            again = await stub.GetServerInfo(sglang_scheduler_pb2.GetServerInfoRequest())
            assert again.start_time.ToNanoseconds() > server.start_time.ToNanoseconds()
        async with serving("sglang") as (_, channel):
            plain = await SglangSchedulerStub(channel).GetServerInfo(
                sglang_scheduler_pb2.GetServerInfoRequest()
            )
            assert plain.server_args["disaggregation_mode"] == "null"

    run(body())


@pytest.mark.parametrize(
    ("role", "kv_role"), [("both", ""), ("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_vllm_health_and_info(role: Any, kv_role: str) -> None:
    async def body() -> None:
        async with serving("vllm", context_length=2048, role=role, block_size=32) as (
            engine,
            channel,
        ):
            stub = VllmEngineStub(channel)
            health = await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest())
            assert (health.healthy, health.message) == (True, "Health")
            info = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
            assert info.max_context_length == 2048 and info.max_req_input_len == 2048
            assert info.served_model_name == "sim-model" and list(info.eos_token_ids) == [EOS]
            server = await stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
            assert server.kv_role == kv_role
            assert (server.kv_connector != "") == (role != "both")
            assert server.data_parallel_size == 1 and server.block_size == 32
            assert server.server_type == ""
            loads = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest())
            assert loads.dp_rank_count == 1 and loads.loads[0].num_running_reqs == 0
            assert await stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=["x", "y"])) == (
                vllm_engine_pb2.AbortResponse()
            )
            assert engine.stats.aborts_received == 2
            engine.healthy = False
            assert not (await stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest())).healthy

    run(body())


def test_trtllm_health_and_info() -> None:
    async def body() -> None:
        async with serving("trtllm", context_length=8192) as (engine, channel):
            stub = TrtllmServiceStub(channel)
            health = await stub.HealthCheck(trtllm_service_pb2.HealthCheckRequest())
            assert health.status == "OK"
            info = await stub.GetModelInfo(trtllm_service_pb2.GetModelInfoRequest())
            assert info.max_seq_len == 1024 != engine.config.context_length  # untrustworthy
            assert info.model_id == "sim" and info.vocab_size == VOCAB
            server = await stub.GetServerInfo(trtllm_service_pb2.GetServerInfoRequest())
            assert server.backend == "tensorrt-llm" and server.tensor_parallel_size == 1
            # It serves beyond the 1024 it reports.
            reply = await generate("trtllm", channel, [20] * 1500, max_tokens=2, ignore_eos=True)
            assert reply.complete.prompt_tokens == 1500
            engine.healthy = False
            sick = await stub.HealthCheck(trtllm_service_pb2.HealthCheckRequest())
            assert sick.status != "OK"

    run(body())


def test_close_drops_open_streams() -> None:
    async def body() -> None:
        async with serving("vllm", timing=SLOW) as (engine, channel):
            request = build_request("vllm", "orphan", PROMPT, max_tokens=1000, stream=True)
            async with generate_method("vllm", channel).open() as call:
                await call.send_message(request, end=True)
                assert await call.recv_message() is not None
                engine.close()
                with pytest.raises((GRPCError, StreamTerminatedError, ConnectionError)):
                    async for _ in call:
                        pass
            await engine.wait_closed()
            assert engine.stats.running == 0 and engine.stats.cancellations == 0
            with pytest.raises((ConnectionError, OSError)):
                await VllmEngineStub(channel).HealthCheck(vllm_engine_pb2.HealthCheckRequest())

    run(body())


# -- data parallelism: N ranks behind one server ------------------------------

SHARED = tuple(range(40, 80))  # 40 tokens: 2 blocks of 16 cached, with page_size 16 too


def test_a_pinned_request_runs_on_its_rank_and_hits_only_its_cache() -> None:
    kind: EngineKind = "vllm"

    async def body() -> None:
        async with serving(kind, dp_size=2, page_size=16) as (engine, channel):
            async def cached(request_id: str, rank: int) -> int:
                reply = await generate(kind, channel, SHARED, request_id=request_id,
                                       max_tokens=2, rank=rank)
                return int(reply.complete.cached_tokens)

            assert await cached("first", 1) == 0
            assert await cached("again", 1) == 32
            assert await cached("other", 0) == 0  # rank 0's cache never saw it
            assert await cached("back", 1) == 32
            assert engine.stats.rank_of == {"first": 1, "again": 1, "other": 0, "back": 1}

    run(body())


def test_sglang_reads_no_rank_its_dp_controller_places_every_request() -> None:
    """As the stock Python servicer: the contract's data_parallel_rank never reaches SGLang."""
    async def body() -> None:
        async with serving("sglang", dp_size=2, page_size=16) as (engine, channel):
            for request_id in ("first", "again", "third"):
                await generate("sglang", channel, SHARED, request_id=request_id, max_tokens=2,
                               rank=1)
            await generate("sglang", channel, request_id="out", rank=5)  # not even checked
            assert engine.stats.rank_of == {"first": 0, "again": 1, "third": 0, "out": 1}

    run(body())


def test_an_out_of_range_rank_is_refused_before_anything_runs() -> None:
    kind: EngineKind = "vllm"

    async def body() -> None:
        for dp_size, ranks in ((2, (2, -1)), (1, (1,))):
            async with serving(kind, dp_size=dp_size) as (engine, channel):
                for rank in ranks:
                    with pytest.raises(GRPCError) as refused:
                        await generate(kind, channel, rank=rank)
                    assert refused.value.status is Status.INVALID_ARGUMENT
                    assert refused.value.message == (
                        f"data_parallel_rank {rank} is out of range [0, {dp_size})."
                    )
                assert engine.stats.requests == 0 and engine.stats.rank_of == {}
                await generate(kind, channel, rank=dp_size - 1)  # the last rank is fine
                assert engine.stats.rank_of == {"req-1": dp_size - 1}

    run(body())


def test_dp_size_must_be_positive_and_trtllm_has_one_rank() -> None:
    model: dict[str, Any] = {"served_model_name": "m", "vocab_size": VOCAB, "eos_token_id": EOS}
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig("vllm", dp_size=0, **model)
    with pytest.raises(ValueError, match="dp_size must be 1"):
        EngineConfig("trtllm", dp_size=2, **model)


def test_unpinned_requests_go_to_the_least_loaded_rank_and_loads_are_per_rank() -> None:
    async def body() -> None:
        timing = TimingModel(decode_us_per_token=20_000, max_running=1)  # per rank
        async with serving("vllm", dp_size=3, timing=timing, kv_capacity_blocks=64,
                           block_size=16) as (engine, channel):
            stub = VllmEngineStub(channel)
            server = await stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
            assert server.data_parallel_size == 3 and server.max_num_seqs == 1

            def start(request_id: str, rank: int | None = None) -> asyncio.Future[Reply]:
                return asyncio.ensure_future(generate(
                    "vllm", channel, request_id=request_id, max_tokens=1000, ignore_eos=True,
                    rank=rank))

            calls = [start("pinned-0", rank=0), start("pinned-0-queued", rank=0)]
            await until(lambda: (engine.stats.running, engine.stats.waiting) == (1, 1))
            calls.append(start("free-a"))  # ranks 1 and 2 are idle: the first after rank 0
            await until(lambda: engine.stats.running == 2)
            calls.append(start("free-b"))  # rank 2 is the only idle one
            await until(lambda: engine.stats.running == 3)
            calls.append(start("free-c"))  # 2, 1, 1 requests: rank 1, the first of the least
            await until(lambda: engine.stats.waiting == 2)
            assert engine.stats.rank_of == {
                "pinned-0": 0, "pinned-0-queued": 0, "free-a": 1, "free-b": 2, "free-c": 1}

            loads = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(dp_rank=2))
            assert loads.dp_rank_count == 3  # every rank: vLLM does not apply dp_rank
            assert [(load.dp_rank, load.num_running_reqs, load.num_waiting_reqs)
                    for load in loads.loads] == [(0, 1, 1), (1, 1, 1), (2, 1, 0)]
            assert {load.max_total_num_tokens for load in loads.loads} == {3 * 64 * 16}  # the sum
            assert all(load.token_usage > 0 for load in loads.loads)

            sglang = await _sglang_loads(dp_size=2)
            assert sglang.dp_rank_count == 2 and [load.dp_rank for load in sglang.loads] == [1]
            assert sglang.loads[0].num_running_reqs == 1
            assert sglang.aggregate.total_running_reqs == 2

            await abort("vllm", channel, "free-c")
            for request_id in ("pinned-0", "pinned-0-queued", "free-a", "free-b"):
                await abort("vllm", channel, request_id)
            await asyncio.gather(*calls)
            await generate("vllm", channel, request_id="idle", max_tokens=1)
            assert engine.stats.rank_of["idle"] == 2  # all idle: in turn, after free-c's rank 1
            await generate("vllm", channel, request_id="idle-2", max_tokens=1)
            assert engine.stats.rank_of["idle-2"] == 0  # and round again

    run(body())


async def _sglang_loads(dp_size: int) -> Any:
    """An SGLang engine of ``dp_size`` ranks, one request running on each: GetLoads for rank 1."""
    timing = TimingModel(decode_us_per_token=20_000)
    async with serving("sglang", dp_size=dp_size, timing=timing) as (engine, channel):
        stub = SglangSchedulerStub(channel)
        server = await stub.GetServerInfo(sglang_scheduler_pb2.GetServerInfoRequest())
        assert server.server_args["dp_size"] == dp_size
        calls = [asyncio.ensure_future(generate("sglang", channel, request_id=f"r{rank}",
                                                max_tokens=1000, ignore_eos=True))
                 for rank in range(dp_size)]
        await until(lambda: engine.stats.running == dp_size)
        assert sorted(engine.stats.rank_of.values()) == list(range(dp_size))  # one each
        loads = await stub.GetLoads(sglang_scheduler_pb2.GetLoadsRequest(dp_rank=1))
        for rank in range(dp_size):
            await abort("sglang", channel, f"r{rank}")
        await asyncio.gather(*calls, return_exceptions=True)  # aborted: an error status
        return loads


# -- a real tokenizer directory, and the standalone process -------------------


def test_from_model_dir(model_dir: Path) -> None:
    facts = read_tokenizer_dir(model_dir)
    assert facts.special_ids and facts.eos_token_id in facts.special_ids

    async def body() -> None:
        engine = SimEngine.from_model_dir("sglang", model_dir, served_model_name="demo")
        assert engine.config.vocab_size == facts.vocab_size
        assert engine.config.eos_token_id == facts.eos_token_id
        async with connected(engine) as (_, channel):
            stub = SglangSchedulerStub(channel)
            info = await stub.GetModelInfo(sglang_scheduler_pb2.GetModelInfoRequest())
            assert list(info.eos_token_ids) == [facts.eos_token_id]
            reply = await generate(
                "sglang", channel, [100, 101, 102], max_tokens=300, ignore_eos=True
            )
            tokens = output_of("sglang", reply, stream=True)
            assert not facts.special_ids & set(tokens)

            chunks = [c async for c in _tokenizer_chunks(stub)]
            archive = b"".join(c.data for c in chunks)
            assert chunks[-1].sha256 == hashlib.sha256(archive).hexdigest()
            assert all(c.sha256 == "" for c in chunks[:-1])
            names = zipfile.ZipFile(io.BytesIO(archive)).namelist()
            assert "tokenizer.json" in names and "tokenizer_config.json" in names

    run(body())


async def _tokenizer_chunks(
    stub: SglangSchedulerStub,
) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
    for chunk in await stub.GetTokenizer(common_pb2.GetTokenizerRequest()):
        yield chunk


def test_cli_serves_until_sigterm() -> None:
    process, (port,) = start_cli("trtllm")  # asserts its "listening on 127.0.0.1:" line

    async def body() -> str:
        async with Channel("127.0.0.1", port) as channel:
            health = await TrtllmServiceStub(channel).HealthCheck(
                trtllm_service_pb2.HealthCheckRequest()
            )
            return health.status

    try:
        assert run(body()) == "OK"
    finally:
        stop_cli(process)  # SIGTERM; asserts the exit status is 0


def test_embedded_engines_need_a_running_loop_and_start_fast() -> None:
    async def body() -> float:
        engine = SimEngine(EngineConfig("vllm", "m", VOCAB, EOS))
        started = time.perf_counter()
        await engine.start("127.0.0.1", 0)
        elapsed = time.perf_counter() - started
        channel = Channel("127.0.0.1", engine.port)  # listening as soon as start returns
        try:
            health = await VllmEngineStub(channel).HealthCheck(vllm_engine_pb2.HealthCheckRequest())
            assert health.healthy
        finally:
            channel.close()
            engine.close()
            await engine.wait_closed()
        return elapsed

    assert run(body()) < 0.5


def test_runs_on_a_trio_asyncio_loop() -> None:
    """The daemon embeds engines under trio-asyncio: nothing may assume plain asyncio."""

    async def aio_body() -> tuple[list[int], int]:
        async with serving("vllm", timing=SLOW) as (engine, channel):
            reply = await generate("vllm", channel, max_tokens=3, ignore_eos=True)
            request = build_request("vllm", "leaver", PROMPT, max_tokens=1000, stream=True)
            async with generate_method("vllm", channel).open() as call:
                await call.send_message(request, end=True)
                assert await call.recv_message() is not None
                await call.cancel()
            await until(lambda: engine.stats.running == 0)
            return output_of("vllm", reply, stream=True), engine.stats.cancellations

    tokens, cancellations = run_trio(trio_asyncio.aio_as_trio(aio_body))
    expected = Generation(reference_model(), PROMPT, StopCriteria(max_tokens=3, ignore_eos=True))
    assert tokens == expected.run() and cancellations == 1
