"""TensorRT-LLM's ``TrtllmService`` as its smg adapter (``tensorrt_llm/grpc/smg``) serves it.

Chunk counts are cumulative; empty deltas are skipped; the ``complete``
carries the whole output (cumulative) after the final delta chunk; an aborted
request ends with a "cancelled" complete; no disaggregation role, no tokenizer
download (docs/engine-contracts.md §6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpclib.server
from grpclib import GRPCError, Status

from direct_frontend.protos import common_pb2, trtllm_service_pb2
from direct_frontend.protos.trtllm_service_grpc import TrtllmServiceBase
from direct_frontend.simulator.core import Job
from direct_frontend.simulator.logprobs import RequestLogprobs, trtllm_output
from direct_frontend.simulator.model import Finish, StopCriteria
from direct_frontend.simulator.servicers.common import (
    SIM_VERSION,
    AbortsOne,
    capped,
    check_prompt,
    constrained_output,
    generate_request,
    matched_stop_token,
    refuse,
    sample_seed,
)

_GUIDES = trtllm_service_pb2.GuidedDecodingParams
#: a guide type as the simulator's constraint kind (any JSON: an object is some)
_GUIDE_KINDS = {
    _GUIDES.GUIDE_TYPE_JSON: "json_object",
    _GUIDES.GUIDE_TYPE_JSON_SCHEMA: "json_schema",
    _GUIDES.GUIDE_TYPE_REGEX: "regex",
    _GUIDES.GUIDE_TYPE_EBNF_GRAMMAR: "ebnf_grammar",
    _GUIDES.GUIDE_TYPE_STRUCTURAL_TAG: "structural_tag",
}


def _add_logprobs(message: Any, logprobs: RequestLogprobs, start: int, top: int | None) -> None:
    """The output tokens' logprobs from ``start`` on, when the request asked (``top``)."""
    if top is not None:
        message.logprobs.extend(
            trtllm_service_pb2.TokenLogprob(**e) for e in trtllm_output(logprobs.output(start), top)
        )


class TrtllmServicer(AbortsOne, TrtllmServiceBase):
    """``trtllm.TrtllmService`` as TRT-LLM's smg adapter (``tensorrt_llm/grpc/smg``) serves it."""

    abort_response = trtllm_service_pb2.AbortResponse

    async def Generate(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.GenerateRequest, trtllm_service_pb2.GenerateResponse
        ],
    ) -> None:
        core, config = self.core, self.core.config
        request = await generate_request(core, stream)
        if not request.HasField("tokenized"):
            raise GRPCError(Status.INVALID_ARGUMENT, "Missing tokenized input")
        prompt = list(request.tokenized.input_token_ids)
        check_prompt(core, prompt, config.context_length)
        if request.max_tokens < 1:  # required by this contract
            raise GRPCError(Status.INVALID_ARGUMENT, "max_tokens must be at least 1")
        sampling = request.sampling_config
        if sampling.beam_width > 1 or sampling.num_return_sequences > 1:
            raise GRPCError(Status.UNIMPLEMENTED, "The simulator does not support beams or n > 1")
        criteria = StopCriteria(
            max_tokens=capped(request.max_tokens, config.context_length - len(prompt)),
            min_tokens=sampling.min_tokens if sampling.HasField("min_tokens") else 0,
            stop_token_ids=frozenset(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
        )
        constraint = None
        if request.HasField("guided_decoding"):
            guide = request.guided_decoding
            constraint = (_GUIDE_KINDS.get(guide.guide_type, "unspecified"), guide.guide)
        job = core.new_job(
            request.request_id, prompt, criteria, sample_seed=sample_seed(sampling),
            forced=constrained_output(core, constraint, prompt),
        )
        await self._respond(stream, request, job)

    async def _respond(
        self,
        stream: grpclib.server.Stream[
            trtllm_service_pb2.GenerateRequest, trtllm_service_pb2.GenerateResponse
        ],
        request: trtllm_service_pb2.GenerateRequest,
        job: Job,
    ) -> None:
        """Run ``job`` and send its chunks and its cumulative ``complete``."""
        core, config = self.core, self.core.config
        request_id = request.request_id
        output = job.generation.output_ids
        prompt_tokens = job.generation.prompt_len
        config_out = request.output_config
        top = config_out.logprobs if config_out.HasField("logprobs") else None
        logprobs = core.logprobs(job, top, None)  # prompt logprobs are not simulated here

        def complete(reason: str, finish: Finish | None) -> trtllm_service_pb2.GenerateResponse:
            message = trtllm_service_pb2.GenerateComplete(
                output_token_ids=output,  # cumulative: the whole sequence
                sequence_index=0,
                finish_reason=reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(output),
                cached_tokens=job.cached_tokens,
            )
            _add_logprobs(message, logprobs, 0, top)  # cumulative, as the ids are
            matched = matched_stop_token(finish)
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
                if top is not None:
                    _add_logprobs(chunk, logprobs, len(output) - len(delta), top)
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
        await refuse(stream, "Embed RPC not yet implemented")

    async def health(self) -> trtllm_service_pb2.HealthCheckResponse:
        healthy = self.core.healthy and not self.core.closing
        return trtllm_service_pb2.HealthCheckResponse(
            status="OK" if healthy else "Executor is unhealthy"
        )

    def model_info(self) -> trtllm_service_pb2.GetModelInfoResponse:
        config = self.core.config
        # The adapter reports its max_input_len default (1024) for both lengths,
        # whatever the model's window: routers must not trust it.
        return trtllm_service_pb2.GetModelInfoResponse(
            model_id=config.model_path,
            max_input_len=config.trtllm_reported_max_len,
            max_seq_len=config.trtllm_reported_max_len,
            vocab_size=config.vocab_size,
        )

    def server_info(self) -> trtllm_service_pb2.GetServerInfoResponse:
        return trtllm_service_pb2.GetServerInfoResponse(
            version=SIM_VERSION,
            backend="tensorrt-llm",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            context_parallel_size=1,
            world_size=1,
        )

    async def GetTokenizer(
        self,
        stream: grpclib.server.Stream[common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk],
    ) -> None:
        await refuse(stream, "GetTokenizer is not served by the TRT-LLM adapter")
