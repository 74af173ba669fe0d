"""Fault injection: engines that die, hang, slow down, fail, refuse or restart on cue.

Every test drives a real engine over loopback with a grpclib client and
checks what the router would see on the wire: the tokens that made it out,
then a dropped connection, silence, or a status, never a terminal complete.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from typing import Any

import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from direct_frontend.protos import sglang_scheduler_pb2, vllm_engine_pb2
from direct_frontend.protos.sglang_scheduler_grpc import SglangSchedulerStub
from direct_frontend.protos.vllm_engine_grpc import VllmEngineStub
from direct_frontend.simulator import EngineConfig, EngineKind, SimEngine, TimingModel
from direct_frontend.simulator.cli import fault_plan
from direct_frontend.simulator.control import control_request, plan_from_json
from direct_frontend.simulator.core import JobState
from direct_frontend.simulator.faults import FaultPlan, parse_status
from tests.simulator.test_engine import (
    KINDS,
    PROMPT,
    SLOW,
    build_request,
    generate,
    generate_method,
    output_of,
)
from tests.simulator.test_servicers import DIM, EMBEDDING_KINDS, STUBS, embed_request
from tests.support.sim import (
    EOS,
    VOCAB,
    cli_command,
    run,
    serving,
    start_cli,
    stop_cli,
    until,
)

DROPPED = (StreamTerminatedError, ConnectionError)


async def collect(
    kind: EngineKind,
    channel: Channel,
    request_id: str = "req-1",
    *,
    max_tokens: int = 8,
    stream: bool = True,
) -> tuple[list[str], list[int], BaseException | None]:
    """Run one Generate to its end: message kinds in order, streamed tokens, and the error."""
    request = build_request(
        kind, request_id, PROMPT, max_tokens=max_tokens, stream=stream, ignore_eos=True
    )
    kinds: list[str] = []
    tokens: list[int] = []
    try:
        async with generate_method(kind, channel).open() as call:
            await call.send_message(request, end=True)
            async for message in call:
                which = message.WhichOneof("response")
                kinds.append(which)
                if which == "chunk":
                    tokens.extend(message.chunk.token_ids)
            await call.recv_trailing_metadata()
    except (GRPCError, *DROPPED) as exc:
        return kinds, tokens, exc
    return kinds, tokens, None


async def other_call_works(kind: EngineKind, channel: Channel) -> None:
    """A fresh request on ``channel`` completes (the channel reconnects by itself)."""
    reply = await generate(kind, channel, request_id="after", max_tokens=3, ignore_eos=True)
    assert len(output_of(kind, reply, stream=True)) == 3


# -- die ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_die_after_tokens_drops_the_connection_without_a_complete(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind, faults=FaultPlan(die_after_tokens=3)) as (engine, channel):
            kinds, tokens, error = await collect(kind, channel)
            assert kinds == ["chunk"] * 3 and len(tokens) == 3
            assert isinstance(error, DROPPED)
            # Exactly N tokens, where the stream would have ended: still no complete.
            kinds, tokens, error = await collect(kind, channel, "exact", max_tokens=3)
            assert kinds == ["chunk"] * 3 and isinstance(error, DROPPED)
            # Shorter than N: not affected.
            kinds, _, error = await collect(kind, channel, "short", max_tokens=2)
            assert kinds[-1] == "complete" and error is None
            # Non-streaming: the one complete would carry the tokens, so nothing arrives.
            kinds, _, error = await collect(kind, channel, "whole", stream=False)
            assert kinds == [] and isinstance(error, DROPPED)

            assert engine.fault_stats.died == ["req-1", "exact", "whole"]
            await until(lambda: engine.stats.running == 0)
            assert engine.stats.cancellations == 0  # a death is not a client cancel

            engine.faults = FaultPlan(die_after_tokens=0)  # dies as the request arrives
            kinds, _, error = await collect(kind, channel, "doa")
            assert kinds == [] and isinstance(error, DROPPED)
            assert engine.stats.request_ids[-1] == "doa"
            engine.faults = FaultPlan()
            await other_call_works(kind, channel)

    run(body())


def test_die_on_the_nth_request_only_and_other_calls_on_the_connection_break_too() -> None:
    async def body() -> None:
        async with serving("sglang", timing=SLOW) as (engine, channel):
            await other_call_works("sglang", channel)  # before the plan: not counted
            engine.faults = FaultPlan(die_after_tokens=2, only_request=3)  # "second"
            first = await collect("sglang", channel, "first", max_tokens=4)
            assert first[0][-1] == "complete" and first[2] is None

            # A long bystander on the same connection dies with the connection.
            bystander = asyncio.ensure_future(
                collect("sglang", channel, "bystander", max_tokens=500)
            )
            await until(lambda: engine.stats.running == 1)
            second = await collect("sglang", channel, "second", max_tokens=4)
            assert second[0] == ["chunk", "chunk"] and isinstance(second[2], DROPPED)
            assert isinstance((await bystander)[2], DROPPED)

            third = await collect("sglang", channel, "third", max_tokens=4)
            assert third[0][-1] == "complete" and third[2] is None
            assert engine.fault_stats.died == ["second"]
            assert engine.fault_stats.generate_calls == 5

    run(body())


# -- hang ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("after", [0, 2])
def test_hang_keeps_the_call_and_connection_open_but_silent(kind: EngineKind, after: int) -> None:
    async def body() -> None:
        async with serving(kind, faults=FaultPlan(hang_after_tokens=after)) as (engine, channel):
            request = build_request(kind, "stuck", PROMPT, max_tokens=8, stream=True)
            async with generate_method(kind, channel).open() as call:
                await call.send_message(request, end=True)
                for _ in range(after):
                    message = await call.recv_message()
                    assert message is not None and message.WhichOneof("response") == "chunk"
                pending = asyncio.ensure_future(call.recv_message())
                await until(lambda: engine.fault_stats.hung == ["stuck"])
                # The same connection still serves other calls; the stuck one stays silent.
                engine.faults = FaultPlan()
                await other_call_works(kind, channel)
                assert not pending.done()
                assert engine.stats.running == 1  # the hung sequence keeps its slot
                pending.cancel()
                await call.cancel()
            await until(lambda: engine.stats.running == 0)
            assert engine.stats.cancelled_request_ids == ["stuck"]

    run(body())


def test_hang_non_streaming_and_hung_calls_end_on_close() -> None:
    async def body() -> None:
        async with serving("trtllm", faults=FaultPlan(hang_after_tokens=5)) as (engine, channel):
            call_task = asyncio.ensure_future(collect("trtllm", channel, "whole", stream=False))
            await until(lambda: engine.fault_stats.hung == ["whole"])
            assert not call_task.done()
            engine.close()
            kinds, _, error = await call_task
            assert kinds == [] and isinstance(error, (GRPCError, *DROPPED))
            await engine.wait_closed()
            assert engine.stats.running == 0 and engine.stats.cancellations == 0

    run(body())


# -- status -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "status", [Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED, Status.INVALID_ARGUMENT]
)
def test_status_before_the_first_token(kind: EngineKind, status: Status) -> None:
    async def body() -> None:
        plan = FaultPlan(status=status, status_message="injected")
        async with serving(kind, faults=plan) as (engine, channel):
            kinds, _, error = await collect(kind, channel, "refused")
            assert kinds == []
            assert isinstance(error, GRPCError)
            assert (error.status, error.message) == (status, "injected")
            assert engine.stats.request_ids == ["refused"]  # it reached the engine...
            assert engine.stats.requests == 0  # ...which never admitted it
            assert engine.fault_stats.failed == ["refused"]

    run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_status_mid_stream(kind: EngineKind) -> None:
    async def body() -> None:
        plan = FaultPlan(status=Status.UNAVAILABLE, status_after_tokens=3)
        async with serving(kind, faults=plan) as (engine, channel):
            kinds, tokens, error = await collect(kind, channel)
            assert kinds == ["chunk"] * 3 and len(tokens) == 3
            assert isinstance(error, GRPCError) and error.status is Status.UNAVAILABLE
            kinds, _, error = await collect(kind, channel, "whole", stream=False)
            assert kinds == [] and isinstance(error, GRPCError)
            await until(lambda: engine.stats.running == 0)
            engine.faults.status = None  # mutate the live plan in place
            await other_call_works(kind, channel)
            # The non-streaming sequence finished before its reply was replaced.
            assert engine.stats.completed == 2

    run(body())


# -- Embed ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_a_status_fault_fails_embed_before_it_is_answered(kind: EngineKind) -> None:
    async def body() -> None:
        plan = FaultPlan(status=Status.UNAVAILABLE, status_message="engine going away")
        async with serving(kind, embedding_dim=DIM, faults=plan) as (engine, channel):
            stub = STUBS[kind](channel)
            with pytest.raises(GRPCError) as error:
                await stub.Embed(embed_request(kind, PROMPT, "emb-down"))
            assert (error.value.status, error.value.message) == (
                Status.UNAVAILABLE,
                "engine going away",
            )
            assert engine.fault_stats.failed == ["emb-down"]
            assert engine.stats.embeds == 0
            assert engine.stats.request_ids == []  # Generate's list: an Embed stays out of it
            # only_request numbers Embed calls as it numbers Generate calls
            engine.faults = FaultPlan(status=Status.UNAVAILABLE, only_request=2)
            replies = []
            for n in range(1, 4):
                try:
                    replies.append(await stub.Embed(embed_request(kind, PROMPT, f"emb-{n}")))
                except GRPCError as exc:
                    assert exc.status is Status.UNAVAILABLE
            assert len(replies) == 2 and engine.fault_stats.failed[-1] == "emb-2"
            assert engine.stats.embeds == 2
            assert engine.fault_stats.embed_calls == 4
            assert engine.fault_stats.generate_calls == 0

    run(body())


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_die_and_hang_at_zero_hit_embed_and_later_thresholds_do_not(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind, embedding_dim=DIM) as (engine, channel):
            stub = STUBS[kind](channel)
            engine.faults = FaultPlan(die_after_tokens=0)
            with pytest.raises(DROPPED):
                await stub.Embed(embed_request(kind, PROMPT, "emb-dead"))
            assert engine.fault_stats.died == ["emb-dead"]
            # an Embed sends no tokens: a threshold above 0 is never reached
            engine.faults = FaultPlan(
                die_after_tokens=1, hang_after_tokens=1, status=Status.INTERNAL,
                status_after_tokens=1,
            )
            reply = await stub.Embed(embed_request(kind, PROMPT, "emb-ok"))
            assert reply.embedding_dim == DIM
            engine.faults = FaultPlan(hang_after_tokens=0)
            pending = asyncio.ensure_future(stub.Embed(embed_request(kind, PROMPT, "emb-stuck")))
            await until(lambda: engine.fault_stats.hung == ["emb-stuck"])
            assert not pending.done()
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            assert engine.stats.embeds == 1

    run(body())


# -- slow ---------------------------------------------------------------------


def test_token_delay_adds_to_every_token() -> None:
    async def body() -> None:
        timing = TimingModel(decode_us_per_token=10_000)
        async with serving("vllm", timing=timing) as (engine, channel):
            engine.faults = FaultPlan(token_delay_s=0.05)
            started = time.monotonic()
            await other_call_works("vllm", channel)  # 3 tokens: 3 delays + 2 decode steps
            assert time.monotonic() - started >= (3 * 0.05 + 2 * 0.01) * 0.95  # additive
        async with serving("sglang", faults=FaultPlan(token_delay_s=0.03)) as (engine, channel):
            started = time.monotonic()  # an instant engine sleeps too
            await other_call_works("sglang", channel)
            assert time.monotonic() - started >= 3 * 0.03 * 0.95

    run(body())


def test_faults_flip_mid_stream_even_from_another_thread() -> None:
    async def body() -> None:
        async with serving("trtllm", timing=SLOW) as (engine, channel):
            request = build_request("trtllm", "live", PROMPT, max_tokens=200, stream=True)

            def generated() -> int:
                (job,) = engine.core.jobs(JobState.RUNNING)
                return len(job.generation.output_ids)

            async def received_up_to(count: int) -> None:
                while True:  # TRT-LLM chunk counts are cumulative
                    message = await call.recv_message()
                    assert message is not None and message.WhichOneof("response") == "chunk"
                    if message.chunk.completion_tokens == count:
                        return

            async with generate_method("trtllm", channel).open() as call:
                await call.send_message(request, end=True)
                assert await call.recv_message() is not None
                # Slow it down from another thread (the loop is blocked meanwhile).
                flipper = threading.Thread(
                    target=setattr, args=(engine, "faults", FaultPlan(token_delay_s=0.1))
                )
                flipped_at = time.monotonic()
                flipper.start()
                flipper.join()
                # Every token after the next one to be generated waits the new delay.
                await received_up_to(generated() + 2)
                assert time.monotonic() - flipped_at >= 0.1 * 0.95
                # Then make it hang two tokens on, by mutating the live plan in place.
                engine.faults.token_delay_s = 0.0
                hang_at = generated() + 2
                engine.faults.hang_after_tokens = hang_at
                await received_up_to(hang_at)
                await until(lambda: engine.fault_stats.hung == ["live"])
                pending = asyncio.ensure_future(call.recv_message())
                await other_call_works("trtllm", channel)  # 3 tokens: under the threshold
                assert not pending.done()
                pending.cancel()
                await call.cancel()
            await until(lambda: engine.stats.running == 0)

    run(body())


# -- refusing connections, restarting ------------------------------------------


def test_stop_listening_refuses_new_connections_but_serves_open_ones() -> None:
    async def body() -> None:
        async with serving("vllm") as (engine, channel):
            await other_call_works("vllm", channel)  # connected before
            await engine.stop_listening()
            assert not engine.listening
            fresh = Channel("127.0.0.1", engine.port)
            try:
                with pytest.raises(ConnectionRefusedError):
                    await VllmEngineStub(fresh).HealthCheck(vllm_engine_pb2.HealthCheckRequest())
                await other_call_works("vllm", channel)  # the open connection still serves
                await engine.stop_listening()  # idempotent
                await engine.resume_listening()
                assert engine.listening
                await engine.resume_listening()  # idempotent
                health = await VllmEngineStub(fresh).HealthCheck(
                    vllm_engine_pb2.HealthCheckRequest()
                )
                assert health.healthy
            finally:
                fresh.close()

    run(body())


def test_restart_drops_everything_and_comes_back_on_the_same_port() -> None:
    async def body() -> None:
        async with serving("sglang", timing=SLOW) as (engine, channel):
            stub = SglangSchedulerStub(channel)
            before = await stub.GetServerInfo(sglang_scheduler_pb2.GetServerInfoRequest())
            port = engine.port
            in_flight = asyncio.ensure_future(collect("sglang", channel, "doomed", max_tokens=500))
            await until(lambda: engine.stats.running == 1)
            await engine.restart()
            kinds, _, error = await in_flight
            assert "complete" not in kinds and isinstance(error, (GRPCError, *DROPPED))
            assert engine.port == port and engine.listening
            assert (engine.stats.running, engine.stats.waiting) == (0, 0)
            after = await stub.GetServerInfo(sglang_scheduler_pb2.GetServerInfoRequest())
            assert after.start_time.ToNanoseconds() > before.start_time.ToNanoseconds()
            assert (
                after.uptime_seconds
                < before.uptime_seconds
                + (after.start_time.ToNanoseconds() - before.start_time.ToNanoseconds()) / 1e9
            )
            await other_call_works("sglang", channel)
        # vLLM has no start time: its uptime drops instead.
        async with serving("vllm") as (engine, channel):
            stub_v = VllmEngineStub(channel)
            await until(lambda: engine.core.uptime > 0.05, within=2.0)
            old = await stub_v.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
            await engine.restart()
            new = await stub_v.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
            assert new.uptime_seconds < old.uptime_seconds

    run(body())


def test_restart_keeps_serve_forever_running() -> None:
    async def body() -> None:
        engine = SimEngine(EngineConfig("trtllm", "m", VOCAB, EOS))
        ready = asyncio.Event()
        server = asyncio.ensure_future(engine.serve_forever("127.0.0.1", 0, ready=ready.set))
        await ready.wait()
        await engine.restart()
        channel = Channel("127.0.0.1", engine.port)
        try:
            await other_call_works("trtllm", channel)
            assert not server.done()
        finally:
            channel.close()
            engine.close()
        await server

    run(body())


# -- options, flags and the control channel ------------------------------------


def test_plan_validation_and_parsing() -> None:
    assert parse_status("unavailable") is Status.UNAVAILABLE
    assert parse_status("8") is Status.RESOURCE_EXHAUSTED
    for bad in ("NOPE", "OK", "0"):
        with pytest.raises(ValueError):
            parse_status(bad)
    with pytest.raises(ValueError):
        FaultPlan(die_after_tokens=-1)
    with pytest.raises(ValueError):
        FaultPlan(status=Status.OK)
    assert fault_plan() is None and fault_plan(fault_only_request=2) is None
    assert fault_plan(fault_status="UNAVAILABLE", fault_token_delay_ms=20) == FaultPlan(
        status=Status.UNAVAILABLE, token_delay_s=0.02
    )
    assert plan_from_json({"hang_after_tokens": 1, "status": "INTERNAL"}) == FaultPlan(
        hang_after_tokens=1, status=Status.INTERNAL
    )
    with pytest.raises(ValueError):
        plan_from_json({"explode": True})


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (("--fault-die-after", "2"), "died"),
        (("--fault-status", "RESOURCE_EXHAUSTED"), "status"),
        (("--fault-hang-after", "1"), "hung"),
    ],
)
def test_cli_fault_flags(flags: tuple[str, ...], expect: str) -> None:
    process, (port,) = start_cli("vllm", *flags)
    try:

        async def body() -> None:
            async with Channel("127.0.0.1", port) as channel:
                if expect == "hung":
                    request = build_request("vllm", "cli", PROMPT, max_tokens=8, stream=True)
                    async with generate_method("vllm", channel).open() as call:
                        await call.send_message(request, end=True)
                        assert await call.recv_message() is not None
                        pending = asyncio.ensure_future(call.recv_message())
                        health = await VllmEngineStub(channel).HealthCheck(
                            vllm_engine_pb2.HealthCheckRequest()
                        )
                        assert health.healthy and not pending.done()
                        pending.cancel()
                        await call.cancel()
                    return
                kinds, _, error = await collect("vllm", channel, "cli")
                if expect == "died":
                    assert kinds == ["chunk", "chunk"] and isinstance(error, DROPPED)
                else:
                    assert isinstance(error, GRPCError)
                    assert error.status is Status.RESOURCE_EXHAUSTED and not kinds

        run(body())
    finally:
        stop_cli(process)


def test_cli_rejects_an_unknown_status() -> None:
    result = subprocess.run(
        cli_command("vllm", "--fault-status", "SOMETIMES", vocab_size=10),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "SOMETIMES" in result.stderr


def test_control_channel_drives_a_standalone_engine() -> None:
    process, (port, control) = start_cli("vllm", "--control-port", "0")
    try:

        def command(**message: Any) -> dict[str, Any]:
            return control_request("127.0.0.1", control, message)

        state = command(op="get")
        assert state["ok"] and state["listening"] and state["faults"]["status"] is None
        reply = command(op="set_faults", faults={"die_after_tokens": 2})
        assert reply["faults"]["die_after_tokens"] == 2

        async def died() -> None:
            async with Channel("127.0.0.1", port) as channel:
                kinds, _, error = await collect("vllm", channel, "ctl")
                assert kinds == ["chunk", "chunk"] and isinstance(error, DROPPED)

        run(died())
        assert command(op="get")["fault_stats"]["died"] == ["ctl"]
        assert command(op="set_faults", faults={})["faults"]["die_after_tokens"] is None
        assert not command(op="stop_listening")["listening"]
        with pytest.raises(ConnectionRefusedError):
            connect_once(port)
        assert command(op="resume_listening")["listening"]
        assert command(op="restart")["ok"]
        assert command(op="set_healthy", healthy=False)["healthy"] is False

        async def sick() -> bool:
            async with Channel("127.0.0.1", port) as channel:
                health = await VllmEngineStub(channel).HealthCheck(
                    vllm_engine_pb2.HealthCheckRequest()
                )
                return health.healthy

        assert run(sick()) is False
        bad = command(op="set_faults", faults={"status": "WHATEVER"})
        assert not bad["ok"] and "WHATEVER" in bad["error"]
        assert not command(op="fly")["ok"]
    finally:
        stop_cli(process)


def test_a_standalone_embedding_engine_and_its_faults() -> None:
    process, (port, control) = start_cli(
        "vllm", "--embedding-dim", str(DIM), "--control-port", "0"
    )
    try:

        async def embed(request_id: str) -> Any:
            async with Channel("127.0.0.1", port) as channel:
                stub = VllmEngineStub(channel)
                info = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
                assert info.is_generation is False
                return await stub.Embed(embed_request("vllm", PROMPT, request_id))

        assert run(embed("cli-1")).embedding_dim == DIM
        assert control_request("127.0.0.1", control, {"op": "get"})["embeds"] == 1
        faults = {"status": "UNAVAILABLE"}
        control_request("127.0.0.1", control, {"op": "set_faults", "faults": faults})
        with pytest.raises(GRPCError) as error:
            run(embed("cli-2"))
        assert error.value.status is Status.UNAVAILABLE
        state = control_request("127.0.0.1", control, {"op": "get"})
        assert state["fault_stats"]["failed"] == ["cli-2"] and state["embeds"] == 1
    finally:
        stop_cli(process)


def test_cli_refuses_a_negative_or_trtllm_embedding_dim() -> None:
    for kind, dim, message in (
        ("vllm", "-1", "must not be negative"),
        ("trtllm", "8", "serves no embeddings"),
    ):
        result = subprocess.run(
            cli_command(kind, "--embedding-dim", dim, vocab_size=10),
            capture_output=True, text=True, timeout=30,
        )
        assert result.returncode == 2 and message in result.stderr


def connect_once(port: int) -> None:
    """Connect once to ``port`` (raises ConnectionRefusedError when nothing listens)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
