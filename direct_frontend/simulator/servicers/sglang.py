"""SGLang's ``SglangScheduler`` as smg-grpc-servicer 0.14.1 serves it.

``request_id`` on every message; chunk counts are cumulative; the last delta is
sent as a chunk *and again* as the streaming ``complete``; an aborted request
ends in an error status, never a complete (docs/engine-contracts.md §4).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpclib.server
from google.protobuf import struct_pb2, timestamp_pb2
from grpclib import GRPCError, Status

from direct_frontend.protos import sglang_scheduler_pb2
from direct_frontend.protos.sglang_scheduler_grpc import SglangSchedulerBase
from direct_frontend.simulator import disagg
from direct_frontend.simulator.core import SimCore
from direct_frontend.simulator.kvcache import SimPrefixCache
from direct_frontend.simulator.lora import LoraSlots
from direct_frontend.simulator.model import Finish, StopCriteria
from direct_frontend.simulator.multimodal import check_inputs
from direct_frontend.simulator.servicers.common import (
    SIM_VERSION,
    AbortsOne,
    SmgServicer,
    admit_media,
    capped,
    check_prompt,
    constrained_output,
    generate_request,
    now_iso,
    refuse,
    refuse_n,
    smg_filler,
)

_ROLE = {"both": "null", "prefill": "prefill", "decode": "decode"}  # disaggregation_mode


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _struct(values: dict[str, str | int | float | bool | None]) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(values)
    return result


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


class SglangServicer(SmgServicer, AbortsOne, SglangSchedulerBase):
    """``sglang.grpc.scheduler.SglangScheduler`` as smg-grpc-servicer 0.14.1 serves it."""

    embed_response = sglang_scheduler_pb2.EmbedResponse
    abort_response = sglang_scheduler_pb2.AbortResponse

    @property
    def prompt_limit(self) -> int:
        return self.core.config.sglang_max_req_input_len

    async def Generate(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.GenerateRequest, sglang_scheduler_pb2.GenerateResponse
        ],
    ) -> None:
        core, config = self.core, self.core.config
        request = await generate_request(core, stream)
        request_id = request.request_id
        if not request.HasField("tokenized"):
            raise GRPCError(Status.INVALID_ARGUMENT, "Tokenized input must be provided")
        prompt = list(request.tokenized.input_ids)
        check_prompt(core, prompt, self.prompt_limit)
        media = (check_inputs(request.mm_inputs, prompt, inline=False)
                 if request.HasField("mm_inputs") else ())
        params = request.sampling_params
        refuse_n(params.n)
        handoff = await disagg.sglang_leg(core, request, len(prompt))  # P/D roles
        # Unset max_new_tokens means no cap: only the window stops it.
        requested = params.max_new_tokens if params.HasField("max_new_tokens") else None
        criteria = StopCriteria(
            max_tokens=handoff.cap(capped(requested, config.sglang_max_req_len - len(prompt))),
            min_tokens=params.min_new_tokens,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
        )
        which = params.WhichOneof("constraint")
        constraint = None if which is None else (which, getattr(params, which))
        forced = constrained_output(core, constraint, prompt)
        job = core.new_job(request_id, prompt, criteria, forced=forced)
        admit_media(core, job, media)
        if request.lora_id:
            job.cache = adapter_cache(core, request.lora_id)  # per adapter, not per rank
        job.cached_tokens = handoff.transferred
        # Its rank stays unpinned: the stock servicer (smg-grpc-servicer 0.14.1, Python) does not
        # pass the contract's data_parallel_rank on; SGLang's DP controller places every request.
        output = job.generation.output_ids
        prompt_tokens = len(prompt)
        # top_logprobs_num serves output and prompt; a start of -1 means no prompt logprobs
        top = request.top_logprobs_num if request.return_logprob else None
        prompt_top = top if request.return_logprob and request.logprob_start_len >= 0 else None
        logprobs = core.logprobs(job, top, prompt_top)

        fill = smg_filler(sglang_scheduler_pb2, logprobs, output, vllm=False)
        first = True

        async def emit(delta: Sequence[int], finish: Finish | None) -> None:
            nonlocal first
            chunk = sglang_scheduler_pb2.GenerateStreamChunk(
                token_ids=delta,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(output),
                cached_tokens=job.cached_tokens,
            )
            # incremental: this delta's logprobs; the prompt's in the first chunk only
            start = len(output) - len(delta)
            fill(chunk, start, first)
            with_prompt, first = first, False
            await stream.send_message(
                sglang_scheduler_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
            )
            if finish is not None:  # the final delta goes out again as the complete
                done = _complete(
                    request_id, delta, finish, prompt_tokens, len(output), job.cached_tokens
                )
                fill(done.complete, start, with_prompt)
                await stream.send_message(done)

        finish = await core.run(job, emit if request.stream else None)
        if finish is None:
            # The servicer turns a scheduler abort into an error status, never a complete.
            raise GRPCError(Status.INTERNAL, "Request aborted")
        handoff.prefilled()  # a prefill leg's KV is ready for its decode leg
        if not request.stream:
            done = _complete(
                request_id, output, finish, prompt_tokens, len(output), job.cached_tokens
            )
            fill(done.complete, 0, True)  # cumulative
            await stream.send_message(done)

    async def health(self) -> sglang_scheduler_pb2.HealthCheckResponse:
        core = self.core
        if core.closing:
            return sglang_scheduler_pb2.HealthCheckResponse(
                healthy=False, message="Server is shutting down"
            )
        if not core.healthy:
            return sglang_scheduler_pb2.HealthCheckResponse(
                healthy=False, message="Health check failed"
            )
        if await core.probe():  # a real 1-token generation, queued like any other
            return sglang_scheduler_pb2.HealthCheckResponse(healthy=True, message="OK")
        timeout = core.config.health_timeout
        return sglang_scheduler_pb2.HealthCheckResponse(
            healthy=False, message=f"Health check timeout after {timeout:g}s"
        )

    def model_info(self) -> sglang_scheduler_pb2.GetModelInfoResponse:
        config = self.core.config
        return sglang_scheduler_pb2.GetModelInfoResponse(
            model_path=config.model_path,
            tokenizer_path=config.tokenizer_path,
            is_generation=config.is_generation,
            preferred_sampling_params="",
            weight_version="default",
            served_model_name=config.served_model_name,
            # The KV pool size, not the window: the stock server's quirk.
            max_context_length=config.pool_tokens,
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

    def server_info(self) -> sglang_scheduler_pb2.GetServerInfoResponse:
        core, config = self.core, self.core.config
        server_args = _struct(
            {
                "model_path": config.model_path,
                "tokenizer_path": config.tokenizer_path,
                "served_model_name": config.served_model_name,
                "context_length": config.context_length,
                "page_size": config.page_size,
                "disaggregation_mode": _ROLE[config.role],
                "disaggregation_bootstrap_port": config.bootstrap_port,
                "max_running_requests": core.timing.max_running,
                "tp_size": 1,
                "dp_size": config.dp_size,
                "skip_tokenizer_init": True,
                "kv_events_config": None,
                "pairing_protocol": "",
            }
        )
        scheduler_info = _struct(
            {
                "max_total_num_tokens": config.kv_reported_capacity,
                "max_req_input_len": config.sglang_max_req_input_len,
                "is_generation": config.is_generation,
            }
        )
        return sglang_scheduler_pb2.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=core.stats.running + core.stats.waiting,
            is_paused=False,
            last_receive_timestamp=core.last_receive_time,
            uptime_seconds=core.uptime,
            sglang_version=SIM_VERSION,
            server_type="grpc",
            start_time=_timestamp(core.start_time),
            max_total_num_tokens=config.kv_reported_capacity,
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
        capacity, max_running = config.kv_reported_capacity, core.timing.max_running  # per rank
        sections = set(request.include) or {"all"}
        loads = []
        for rank, rank_load in enumerate(core.loads()):
            running, waiting = rank_load.running, rank_load.waiting
            load = sglang_scheduler_pb2.SchedulerLoad(
                dp_rank=rank,
                num_running_reqs=running,
                num_waiting_reqs=waiting,
                num_total_reqs=running + waiting,
                num_used_tokens=rank_load.used_tokens,
                max_total_num_tokens=capacity,
                token_usage=rank_load.used_tokens / capacity,
                utilization=running / max_running,
                max_running_requests=max_running,
                num_waiting_uncached_tokens=rank_load.waiting_tokens,
            )
            if sections & {"all", "memory"}:
                load.memory.token_capacity = capacity
            if sections & {"all", "disagg"}:
                load.disaggregation.mode = _ROLE[config.role]
            if sections & {"all", "queues"}:
                load.queues.waiting = waiting
            loads.append(load)
        # The aggregate covers every rank; the entries only the one asked for, if any.
        aggregate = sglang_scheduler_pb2.AggregateMetrics(
            total_running_reqs=sum(load.num_running_reqs for load in loads),
            total_waiting_reqs=sum(load.num_waiting_reqs for load in loads),
            total_reqs=sum(load.num_total_reqs for load in loads),
            avg_token_usage=sum(load.token_usage for load in loads) / len(loads),
            avg_utilization=sum(load.utilization for load in loads) / len(loads),
        )
        if request.HasField("dp_rank"):
            loads = [load for load in loads if load.dp_rank == request.dp_rank]
        await stream.send_message(
            sglang_scheduler_pb2.GetLoadsResponse(
                timestamp=now_iso(),
                version=SIM_VERSION,
                dp_rank_count=config.dp_size,
                loads=loads,
                aggregate=aggregate,
            )
        )

    async def LoadLoRAAdapter(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.LoadLoRAAdapterRequest,
            sglang_scheduler_pb2.LoadLoRAAdapterResponse,
        ],
    ) -> None:
        async def load(loras: LoraSlots, request: Any) -> str:
            return await loras.load(request.lora_id, request.lora_name, request.lora_path)

        await self._lora_change(stream, load, sglang_scheduler_pb2.LoadLoRAAdapterResponse)

    async def UnloadLoRAAdapter(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.UnloadLoRAAdapterRequest,
            sglang_scheduler_pb2.UnloadLoRAAdapterResponse,
        ],
    ) -> None:
        async def unload(loras: LoraSlots, request: Any) -> str:
            return loras.unload(request.lora_id, request.lora_name)

        await self._lora_change(stream, unload, sglang_scheduler_pb2.UnloadLoRAAdapterResponse)

    async def _lora_change(
        self,
        stream: grpclib.server.Stream[Any, Any],
        change: Callable[[LoraSlots, Any], Awaitable[str]],
        reply: type[Any],
    ) -> None:
        """A load or unload: refused without LoRA support; else done, and what is held now."""
        loras = self.core.loras
        if loras is None:
            await refuse(stream, "The simulator has no LoRA support")
            return
        request = await stream.recv_message()
        assert request is not None
        problem = await change(loras, request)
        await stream.send_message(reply(success=not problem, message=problem,
                                        loaded_lora_ids=loras.ids))

    async def ListLoadedLoRAAdapters(
        self,
        stream: grpclib.server.Stream[
            sglang_scheduler_pb2.ListLoadedLoRAAdaptersRequest,
            sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse,
        ],
    ) -> None:
        await stream.recv_message()
        loaded = [] if self.core.loras is None else [
            sglang_scheduler_pb2.LoadedLoRAAdapter(lora_id=a.lora_id, lora_name=a.name,
                                                   lora_path=a.path)
            for a in self.core.loras.loaded.values()
        ]
        await stream.send_message(
            sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse(loaded_adapters=loaded)
        )


def adapter_cache(core: SimCore, lora_id: str) -> SimPrefixCache:
    """The prefix cache of the adapter a request names; a request for one not loaded is refused."""
    cache = None if core.loras is None else core.loras.cache_of(lora_id)
    if cache is None:
        raise GRPCError(Status.INVALID_ARGUMENT, f"LoRA adapter {lora_id!r} is not loaded")
    return cache
