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
NOT_EMBEDDING = "The simulated model is not an embedding model"
NO_TOKENIZER = "The simulator was started without a tokenizer"
NO_LORA = "The simulator has no LoRA support"

#: (kind, RPC, request, the message of its UNIMPLEMENTED)
REFUSALS: list[tuple[EngineKind, str, Any, str]] = [
    ("sglang", "Embed", sglang_scheduler_pb2.EmbedRequest(), NOT_EMBEDDING),
    ("vllm", "Embed", vllm_engine_pb2.EmbedRequest(), NOT_EMBEDDING),
    ("trtllm", "Embed", trtllm_service_pb2.EmbedRequest(), "Embed RPC not yet implemented"),
    ("sglang", "GetTokenizer", common_pb2.GetTokenizerRequest(), NO_TOKENIZER),
    ("vllm", "GetTokenizer", common_pb2.GetTokenizerRequest(), NO_TOKENIZER),
    (
        "trtllm",
        "GetTokenizer",
        common_pb2.GetTokenizerRequest(),
        "GetTokenizer is not served by the TRT-LLM adapter",
    ),
    *(
        (kind, "SubscribeKvEvents", common_pb2.SubscribeKvEventsRequest(), NO_KV_EVENTS)
        for kind in STUBS
    ),
    ("sglang", "LoadLoRAAdapter", sglang_scheduler_pb2.LoadLoRAAdapterRequest(), NO_LORA),
    ("sglang", "UnloadLoRAAdapter", sglang_scheduler_pb2.UnloadLoRAAdapterRequest(), NO_LORA),
]


def test_each_kind_gets_its_own_servicer() -> None:
    expected = {"sglang": SglangServicer, "vllm": VllmServicer, "trtllm": TrtllmServicer}
    for kind, servicer in expected.items():
        engine = SimEngine(kind, served_model_name="m", vocab_size=VOCAB, eos_token_id=EOS)
        assert type(servicer_for(engine.core)) is servicer


@pytest.mark.parametrize(("kind", "rpc", "message_in", "message"), REFUSALS)
def test_what_each_kind_refuses(kind: EngineKind, rpc: str, message_in: Any, message: str) -> None:
    async def body() -> None:
        async with serving(kind) as (_, channel):
            with pytest.raises(GRPCError) as error:
                await getattr(STUBS[kind](channel), rpc)(message_in)
            assert error.value.status is Status.UNIMPLEMENTED
            assert error.value.message == message

    run(body())


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_smg_servicers_flush_and_profile_alike(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind) as (_, channel):
            stub = STUBS[kind](channel)
            flushed = await stub.FlushCache(common_pb2.FlushCacheRequest())
            assert (flushed.success, flushed.message) == (True, "Cache flushed")
            started = await stub.StartProfile(common_pb2.StartProfileRequest())
            stopped = await stub.StopProfile(common_pb2.StopProfileRequest())
            assert (started.success, started.message) == (stopped.success, stopped.message)
            assert (started.success, started.message) == (True, "OK")

    run(body())


def test_sglang_lists_no_lora_adapters() -> None:
    async def body() -> None:
        async with serving("sglang") as (_, channel):
            listed = await SglangSchedulerStub(channel).ListLoadedLoRAAdapters(
                sglang_scheduler_pb2.ListLoadedLoRAAdaptersRequest()
            )
            assert listed == sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse()

    run(body())


@pytest.mark.parametrize("kind", ["sglang", "trtllm"])
def test_a_one_id_abort_says_whether_it_found_the_request(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind) as (engine, channel):
            reply = await STUBS[kind](channel).Abort(PB[kind].AbortRequest(request_id="nobody"))
            assert (reply.success, reply.message) == (False, "Request nobody not found")
            assert engine.stats.abort_request_ids == ["nobody"]

    run(body())
