"""The simulator's prefill/decode roles over real sockets (simulator/disagg.py).

Engines are started on one asyncio loop, as the daemon embeds them, and
called with grpclib and the generated stubs.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel

from direct_frontend.protos import sglang_scheduler_pb2 as sg
from direct_frontend.protos import vllm_engine_pb2 as vl
from direct_frontend.protos.sglang_scheduler_grpc import SglangSchedulerStub
from direct_frontend.protos.vllm_engine_grpc import VllmEngineStub
from direct_frontend.simulator import EngineConfig, SimEngine, SimRole, disagg
from tests.support.sim import connected, run, until

PROMPT = list(range(10, 50))  # 40 tokens


def engine(kind: Any, role: SimRole) -> AbstractAsyncContextManager[tuple[SimEngine, Channel]]:
    return connected(SimEngine(EngineConfig(kind, "m", 500, 2, role=role, eos_probability=0.0,
                                            block_size=16)))


def vllm_request(rid: str, max_tokens: int, params: str | None = None) -> vl.GenerateRequest:
    request = vl.GenerateRequest(request_id=rid, tokenized={"input_ids": PROMPT}, stream=False,
                                 sampling_params={"temperature": 0, "max_tokens": max_tokens})
    if params is not None:
        request.kv_transfer_params_json = params
    return request


def sglang_request(rid: str, max_tokens: int, port: int | None) -> sg.GenerateRequest:
    request = sg.GenerateRequest(request_id=rid, tokenized={"input_ids": PROMPT}, stream=False,
                                 sampling_params={"temperature": 0, "max_new_tokens": max_tokens})
    if port is not None:
        request.disaggregated_params.bootstrap_host = "127.0.0.1"
        request.disaggregated_params.bootstrap_port = port
        request.disaggregated_params.bootstrap_room = 7
    return request


async def vllm_generate(channel: Channel, request: vl.GenerateRequest) -> vl.GenerateComplete:
    [reply] = await VllmEngineStub(channel).Generate(request)
    return reply.complete


async def sglang_generate(channel: Channel, request: sg.GenerateRequest) -> sg.GenerateComplete:
    [reply] = await SglangSchedulerStub(channel).Generate(request)
    return reply.complete


def test_vllm_prefill_hands_over_and_decode_needs_the_handoff() -> None:
    async def body() -> None:
        async with engine("vllm", "prefill") as (prefill, p), \
                engine("vllm", "decode") as (decode, d), engine("vllm", "both") as (_, a):
            with pytest.raises(GRPCError) as refused:
                await vllm_generate(d, vllm_request("r0", 8))
            assert refused.value.status is Status.INVALID_ARGUMENT
            plain = await vllm_generate(p, vllm_request("r1", 1))  # not asked: no handoff
            assert not plain.HasField("kv_transfer_params_json")
            ask = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})
            done = await vllm_generate(p, vllm_request("r2", 1, ask))
            handoff = json.loads(done.kv_transfer_params_json)
            assert handoff["do_remote_prefill"] is True and handoff["do_remote_decode"] is False
            assert len(handoff["remote_block_ids"]) == 3  # 40 tokens in 16-token blocks
            assert handoff["remote_engine_id"] == prefill.config.kv_engine_id
            assert {"remote_host", "remote_port"} <= handoff.keys()
            assert prefill.stats.kv_params_returned["r2"] == done.kv_transfer_params_json
            decoded = await vllm_generate(d, vllm_request("r3", 12, done.kv_transfer_params_json))
            assert decoded.cached_tokens == len(PROMPT)  # the handoff, observable
            assert decode.stats.kv_params_received["r3"] == done.kv_transfer_params_json
            reference = await vllm_generate(a, vllm_request("r4", 12))
            assert list(decoded.output_ids) == list(reference.output_ids)

    run(body())


def test_sglang_legs_need_a_rendezvous_and_decode_waits_for_its_prefill() -> None:
    async def body() -> None:
        async with engine("sglang", "prefill") as (prefill, p), \
                engine("sglang", "decode") as (decode, d), engine("sglang", "both") as (_, a):
            for channel in (p, d):
                with pytest.raises(GRPCError) as refused:
                    await sglang_generate(channel, sglang_request("r0", 8, None))
                assert refused.value.status is Status.INVALID_ARGUMENT
            port = prefill.config.bootstrap_port
            waiting = asyncio.ensure_future(sglang_generate(d, sglang_request("r1", 12, port)))
            await until(lambda: "r1" in decode.stats.kv_params_received)
            # no KV yet, so no sequence either (without the wait it would be admitted by now)
            assert decode.stats.requests == 0 and not waiting.done()
            first = await sglang_generate(p, sglang_request("r1", 12, port))
            assert len(first.output_ids) == 1  # a prefill leg stops after its first token
            decoded = await waiting
            assert decoded.cached_tokens == len(PROMPT)
            assert prefill.stats.kv_params_received["r1"] == decode.stats.kv_params_received["r1"]
            reference = await sglang_generate(a, sglang_request("r2", 12, None))
            assert list(decoded.output_ids) == list(reference.output_ids)

    run(body())


def test_sglang_decode_gives_up_on_a_room_that_never_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(disagg, "ROOM_WAIT_S", 0.05)

    async def body() -> None:
        async with engine("sglang", "prefill") as (prefill, _), \
                engine("sglang", "decode") as (_, d):
            request = sglang_request("r", 8, prefill.config.bootstrap_port)
            with pytest.raises(GRPCError) as failed:
                await sglang_generate(d, request)
            assert failed.value.status is Status.INTERNAL and "aborted" in str(failed.value)
            # a rendezvous naming an engine not simulated here is only checked for presence
            elsewhere = sglang_request("r2", 8, 1)
            assert len((await sglang_generate(d, elsewhere)).output_ids) == 8

    run(body())


def test_a_decode_leg_cancelled_as_its_room_comes_stays_cancelled() -> None:
    """The cancel and the prefill's KV in one loop pass: the cancel wins, as grpclib needs
    (a handler that carries on after its stream was reset is logged as a failure)."""
    async def body() -> None:
        prefill = SimEngine(EngineConfig("sglang", "m", 500, 2, role="prefill"))
        decode = SimEngine(EngineConfig("sglang", "m", 500, 2, role="decode"))
        disagg.attach(prefill.core, "127.0.0.1")  # what start does, without its sockets
        try:
            request = sglang_request("r", 8, prefill.config.bootstrap_port)
            waiting = asyncio.ensure_future(disagg.sglang_leg(decode.core, request, len(PROMPT)))
            await until(lambda: "r" in decode.stats.kv_params_received)
            await asyncio.sleep(0)  # the leg waits for its room
            handoff = await disagg.sglang_leg(prefill.core, request, len(PROMPT))
            handoff.prefilled()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        finally:
            disagg.detach(prefill.core)

    run(body())
