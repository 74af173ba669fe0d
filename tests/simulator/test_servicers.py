"""The servicers' side RPCs over a real socket: what each kind answers besides Generate.

The RPCs written once in ``servicers/common.py`` (the refusals, FlushCache, the
profile pair, SubscribeKvEvents) must still answer as each stock servicer does,
kind by kind; Generate, health, discovery and the tokenizer bundle are covered
in test_engine.py. An embedding model (``embedding_dim``) answers Embed and
refuses Generate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from grpclib import GRPCError, Status

from direct_frontend.protos import (
    common_pb2,
    sglang_scheduler_pb2,
    trtllm_service_pb2,
    vllm_engine_pb2,
)
from direct_frontend.protos.sglang_scheduler_grpc import SglangSchedulerStub
from direct_frontend.protos.trtllm_service_grpc import TrtllmServiceStub
from direct_frontend.protos.vllm_engine_grpc import VllmEngineStub
from direct_frontend.simulator import EngineConfig, EngineKind, SimEngine
from direct_frontend.simulator.embedding import embedding_of
from direct_frontend.simulator.servicers import (
    SglangServicer,
    TrtllmServicer,
    VllmServicer,
    servicer_for,
)
from direct_frontend.simulator.servicers.common import NOT_EMBEDDING, NOT_GENERATION
from tests.simulator.test_engine import PROMPT, build_request
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
NO_TOKENIZER = "The simulator was started without a tokenizer"
NO_LORA = "The simulator has no LoRA support"

#: (kind, RPC, request, the message of its UNIMPLEMENTED)
REFUSALS: list[tuple[EngineKind, str, Any, str]] = [
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
        engine = SimEngine(EngineConfig(kind, "m", VOCAB, EOS))
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


# -- an embedding model (embedding_dim > 0) ----------------------------------------------

EMBEDDING_KINDS: tuple[EngineKind, ...] = ("sglang", "vllm")
DIM = 16


def embed_request(kind: EngineKind, ids: Sequence[int], request_id: str = "emb-1") -> Any:
    """The contract's EmbedRequest of ``ids`` (tokenized, as the router sends it)."""
    return PB[kind].EmbedRequest(
        request_id=request_id, tokenized=PB[kind].TokenizedInput(input_ids=ids)
    )


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_an_embedding_engine_answers_embed(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind, embedding_dim=DIM) as (engine, channel):
            stub = STUBS[kind](channel)
            first = await stub.Embed(embed_request(kind, (11, 12, 13)))
            again = await stub.Embed(embed_request(kind, (11, 12, 13), "emb-2"))
            other = await stub.Embed(embed_request(kind, (11, 12, 14), "emb-3"))
            assert (first.embedding_dim, first.prompt_tokens) == (DIM, 3)
            assert len(first.embedding) == DIM
            assert math.fsum(x * x for x in first.embedding) == pytest.approx(1.0, abs=1e-5)
            assert list(first.embedding) == list(again.embedding)
            assert list(first.embedding) != list(other.embedding)
            # what went over the wire is the simulator's own function (as float32)
            expected = embedding_of((11, 12, 13), DIM)
            assert list(first.embedding) == pytest.approx(expected, abs=1e-6)
            assert engine.stats.embeds == 3
            assert engine.stats.requests == 0  # no sequence was generated

    run(body())


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_an_embedding_engine_says_it_does_not_generate(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind, embedding_dim=DIM) as (_, embedder), serving(kind) as (
            _,
            generator,
        ):
            for channel, generation in ((embedder, False), (generator, True)):
                info = await STUBS[kind](channel).GetModelInfo(PB[kind].GetModelInfoRequest())
                assert info.is_generation is generation
            if kind == "sglang":
                reply = await SglangSchedulerStub(embedder).GetServerInfo(
                    sglang_scheduler_pb2.GetServerInfoRequest()
                )
                assert reply.scheduler_info["is_generation"] is False

    run(body())


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_an_embedding_engine_refuses_generate(kind: EngineKind) -> None:
    async def body() -> None:
        async with serving(kind, embedding_dim=DIM) as (engine, channel):
            request = build_request(kind, "gen-1", PROMPT, max_tokens=4, stream=False)
            with pytest.raises(GRPCError) as error:
                await STUBS[kind](channel).Generate(request)
            assert error.value.status is Status.INVALID_ARGUMENT
            assert error.value.message == NOT_GENERATION
            assert engine.stats.request_ids == ["gen-1"]  # seen, never run
            assert (engine.stats.requests, engine.stats.embeds) == (0, 0)

    run(body())


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_a_generation_engine_refuses_embed(kind: EngineKind) -> None:
    """As a real vLLM does (docs/real-vllm.md §12): INVALID_ARGUMENT, whatever the input."""
    async def body() -> None:
        async with serving(kind) as (engine, channel):
            with pytest.raises(GRPCError) as error:
                await STUBS[kind](channel).Embed(PB[kind].EmbedRequest())
            assert error.value.status is Status.INVALID_ARGUMENT
            assert error.value.message == NOT_EMBEDDING
            assert engine.stats.embeds == 0

    run(body())


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_embed_refuses_what_generate_refuses(kind: EngineKind) -> None:
    limit = {"sglang": 64 - 1 - 5, "vllm": 64}[kind]  # sglang: min(window, pool) - 1 - 5

    async def body() -> None:
        async with serving(kind, embedding_dim=DIM, context_length=64, kv_pool_tokens=1000) as (
            engine,
            channel,
        ):
            stub = STUBS[kind](channel)
            cases = [
                (PB[kind].EmbedRequest(request_id="none"), "The prompt cannot be empty"),
                (embed_request(kind, ()), "The prompt cannot be empty"),
                (embed_request(kind, (5, VOCAB)), f"Token id {VOCAB} is out of vocabulary"),
                (
                    embed_request(kind, [5] * limit),
                    f"Input length ({limit} tokens) exceeds the maximum allowed length "
                    f"({limit - 1} tokens)",
                ),
            ]
            for request, message in cases:
                with pytest.raises(GRPCError) as error:
                    await stub.Embed(request)
                assert (error.value.status, error.value.message) == (
                    Status.INVALID_ARGUMENT,
                    message,
                )
            longest = await stub.Embed(embed_request(kind, [5] * (limit - 1)))
            assert longest.prompt_tokens == limit - 1
            assert engine.stats.embeds == 1

    run(body())


def test_a_trtllm_engine_cannot_be_an_embedding_model() -> None:
    with pytest.raises(ValueError, match="serves no embeddings"):
        EngineConfig("trtllm", "m", VOCAB, EOS, embedding_dim=DIM)
    with pytest.raises(ValueError, match="must not be negative"):
        EngineConfig("vllm", "m", VOCAB, EOS, embedding_dim=-1)


@pytest.mark.parametrize(("kind", "asked_as"), [("vllm", "sglang"), ("sglang", "trtllm"),
                                                ("trtllm", "vllm")])
def test_a_method_of_another_kind_is_not_found_as_a_stock_engine_says(
    kind: EngineKind, asked_as: EngineKind
) -> None:
    """grpcio's answer, with its content-type: what a client of the wrong kind meets."""
    async def body() -> None:
        async with serving(kind) as (_, channel):
            with pytest.raises(GRPCError) as refused:
                await STUBS[asked_as](channel).GetModelInfo(PB[asked_as].GetModelInfoRequest())
            assert (refused.value.status, refused.value.message) == (
                Status.UNIMPLEMENTED, "Method not found!")

    run(body())
