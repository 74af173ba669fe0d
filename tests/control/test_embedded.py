"""The embedded simulator: a fleet file's ``[engine.simulator]`` reaches the engine it starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio_asyncio
from grpclib.client import Channel

from direct_frontend.control.embedded import start_embedded_simulator, stop_embedded_simulator
from direct_frontend.fleet import parse_fleet
from direct_frontend.protos import vllm_engine_pb2
from direct_frontend.protos.vllm_engine_grpc import VllmEngineStub
from tests.support.daemon import fleet_text, sim_engine
from tests.support.sim import run_trio


def test_embedding_dim_makes_the_embedded_engine_an_embedding_model(
    model_dir: Path, tmp_path: Path
) -> None:
    text = fleet_text(model_dir, [sim_engine("emb", "vllm", embedding_dim=8)])
    fleet = parse_fleet(text, tmp_path / "fleet.toml")
    (cfg,) = fleet.engines
    assert cfg.simulator.embedding_dim == 8

    async def ask(port: int) -> tuple[vllm_engine_pb2.GetModelInfoResponse, Any]:
        async with Channel("127.0.0.1", port) as channel:
            stub = VllmEngineStub(channel)
            info = await stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
            reply = await stub.Embed(
                vllm_engine_pb2.EmbedRequest(
                    request_id="e", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6])
                )
            )
            return info, reply

    async def body() -> None:
        engine = await start_embedded_simulator(fleet, cfg)
        try:
            info, reply = await trio_asyncio.aio_as_trio(ask)(engine.port)
        finally:
            await stop_embedded_simulator(engine)
        assert info.is_generation is False
        assert (reply.embedding_dim, len(reply.embedding), reply.prompt_tokens) == (8, 8, 2)

    run_trio(body)
