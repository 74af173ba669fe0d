"""The servicers' side RPCs over a real socket: what each kind answers besides Generate.

The RPCs written once in ``servicers/common.py`` (the refusals, FlushCache, the
profile pair, SubscribeKvEvents) must still answer as each stock servicer does,
kind by kind; Generate, health, discovery and the tokenizer bundle are covered
in test_engine.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from grpclib import GRPCError, Status

from direct_frontend.simulator import EngineKind, SimEngine
from direct_frontend.simulator.servicers import (
    SglangServicer,
    TrtllmServicer,
    VllmServicer,
    servicer_for,
)
from protos import common_pb2, sglang_scheduler_pb2, trtllm_service_pb2, vllm_engine_pb2
from protos.sglang_scheduler_grpc import SglangSchedulerStub
from protos.trtllm_service_grpc import TrtllmServiceStub
from protos.vllm_engine_grpc import VllmEngineStub
from tests.support.sim import EOS, VOCAB, run, serving

STUBS: dict[EngineKind, Any] = {
    "sglang": SglangSchedulerStub,
    "vllm": VllmEngineStub,
    "trtllm": TrtllmServiceStub,
}
PB: dict[EngineKind, Any] = {
    "sglang": sglang_scheduler_pb2,
    "vllm": vllm_engine_pb2,
    "trtllm": trtllm_service_pb2,
}
NO_KV_EVENTS = "KV events are not enabled (the engine has no --kv-events-config)"


async def refused(call: Any) -> str:
    """The message of the ``UNIMPLEMENTED`` a call must end with."""
    with pytest.raises(GRPCError) as error:
        await call
    assert error.value.status is Status.UNIMPLEMENTED
    return str(error.value.message)


def test_each_kind_gets_its_own_servicer() -> None:
    expected = {"sglang": SglangServicer, "vllm": VllmServicer, "trtllm": TrtllmServicer}
    for kind, servicer in expected.items():
        engine = SimEngine(kind, served_model_name="m", vocab_size=VOCAB, eos_token_id=EOS)
        assert type(servicer_for(engine.core)) is servicer


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_smg_servicers_answer_the_side_rpcs_alike(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind) as (_, channel):
            stub = STUBS[kind](channel)
            embed = stub.Embed(PB[kind].EmbedRequest())
            assert await refused(embed) == "The simulated model is not an embedding model"
            flushed = await stub.FlushCache(common_pb2.FlushCacheRequest())
            assert (flushed.success, flushed.message) == (True, "Cache flushed")
            started = await stub.StartProfile(common_pb2.StartProfileRequest())
            stopped = await stub.StopProfile(common_pb2.StopProfileRequest())
            assert (started.success, started.message) == (stopped.success, stopped.message)
            assert (started.success, started.message) == (True, "OK")
            tokenizer = stub.GetTokenizer(common_pb2.GetTokenizerRequest())
            assert await refused(tokenizer) == "The simulator was started without a tokenizer"
            events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            assert await refused(events) == NO_KV_EVENTS

    run(body())


def test_sglang_refuses_lora_and_lists_no_adapters() -> None:
    async def body() -> None:
        async with serving("sglang") as (_, channel):
            stub = SglangSchedulerStub(channel)
            load = stub.LoadLoRAAdapter(sglang_scheduler_pb2.LoadLoRAAdapterRequest())
            unload = stub.UnloadLoRAAdapter(sglang_scheduler_pb2.UnloadLoRAAdapterRequest())
            assert await refused(load) == "The simulator has no LoRA support"
            assert await refused(unload) == "The simulator has no LoRA support"
            listed = await stub.ListLoadedLoRAAdapters(
                sglang_scheduler_pb2.ListLoadedLoRAAdaptersRequest()
            )
            assert listed == sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse()

    run(body())


def test_trtllm_adapter_refuses_what_it_does_not_serve() -> None:
    async def body() -> None:
        async with serving("trtllm") as (_, channel):
            stub = TrtllmServiceStub(channel)
            embed = stub.Embed(trtllm_service_pb2.EmbedRequest())
            assert await refused(embed) == "Embed RPC not yet implemented"
            tokenizer = stub.GetTokenizer(common_pb2.GetTokenizerRequest())
            assert await refused(tokenizer) == "GetTokenizer is not served by the TRT-LLM adapter"
            events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            assert await refused(events) == NO_KV_EVENTS

    run(body())


@pytest.mark.parametrize("kind", ["sglang", "trtllm"])
def test_a_one_id_abort_says_whether_it_found_the_request(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind) as (engine, channel):
            reply = await STUBS[kind](channel).Abort(PB[kind].AbortRequest(request_id="nobody"))
            assert (reply.success, reply.message) == (False, "Request nobody not found")
            assert engine.stats.abort_request_ids == ["nobody"]

    run(body())
