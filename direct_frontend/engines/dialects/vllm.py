"""vLLM's SMG contract (``vllm.grpc.engine.VllmEngine``).

Quirks handled here (docs/engine-contracts.md §5): the response oneof numbers
chunk/complete 1/2 and carries no ``request_id`` (the generated class knows
the numbers; nothing here may reuse another kind's messages); ``temperature``
is optional and unset means 1.0, and ``max_tokens`` unset means "up to
max_model_len", so both are always sent; chunk ``completion_tokens`` is this
chunk's own count, summed here; in streaming mode the terminal ``complete``
repeats the last delta with ``completion_tokens`` = its length, so neither
its tokens nor its count are added again, while in non-streaming mode it is
the only message and holds every token. ``finish_reason`` may be "abort" or
"error" (engine-side failures). ``max_context_length`` is ``max_model_len``,
the real window.

A leg of a prefill/decode pair carries ``kv_transfer_params_json`` (request
field 8, a JSON object passed verbatim); a prefill leg's handoff comes back
in the complete's field 12 and is surfaced on :class:`Finished` (§9.2).

``seed`` is an int32 here while OpenAI allows int64: a seed outside int32 is
folded to its low 32 bits (two's complement), so a given seed still always
reproduces the same output. Stop strings are applied by the frontend, as for
every kind, so ``stop`` is never sent (it would also switch on the servicer's
detokenizer for nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

from direct_frontend.engines.dialects.base import (
    FINISH_REASONS,
    Capabilities,
    Dialect,
    HealthResult,
    Rpc,
    StreamDecoder,
    after_terminal,
    matched_stop,
    streamed_tail,
    unusual_finish,
)
from direct_frontend.engines.neutral import (
    EngineEvent,
    EngineInfo,
    EngineRole,
    Finished,
    FinishReason,
    GenerateCall,
    TokenDelta,
)
from direct_frontend.errors import EngineError, ErrorKind
from protos import vllm_engine_pb2 as pb

SERVICE = "/vllm.grpc.engine.VllmEngine"
ROLES = {
    "kv_producer": EngineRole.PREFILL,
    "kv_consumer": EngineRole.DECODE,
    "kv_both": EngineRole.BOTH,
    "": EngineRole.BOTH,
}


def int32_seed(seed: int) -> int:
    """Fold any integer seed into int32 deterministically (identity within range)."""
    low = seed & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


class VllmStreamDecoder(StreamDecoder):
    """Decoder for one vLLM Generate stream (chunk counts are per-chunk deltas)."""

    def __init__(self, stream: bool) -> None:
        self._stream = stream
        self._delivered = 0
        self._last: tuple[int, ...] = ()
        self._prompt = 0
        self._completion = 0  # the sum of chunk counts
        self._cached = 0
        self.finished = False

    def feed(self, message: Any) -> EngineEvent | None:
        if self.finished:
            raise after_terminal()
        which = message.WhichOneof("response")
        if which == "chunk":
            chunk = message.chunk
            ids = tuple(chunk.token_ids)
            self._delivered += len(ids)
            self._last = ids
            self._prompt = chunk.prompt_tokens
            self._completion = max(self._completion + chunk.completion_tokens, self._delivered)
            self._cached = chunk.cached_tokens
            if not ids:  # e.g. the empty output vLLM sends before an abort
                return None
            return TokenDelta(ids, self._prompt, self._completion, self._cached)
        if which == "complete":
            done = message.complete
            self.finished = True
            problem = unusual_finish(done.finish_reason)
            if problem is not None:
                raise problem
            if self._stream:
                # output_ids and completion_tokens describe the last delta only.
                extra = streamed_tail(self._last, self._delivered, done.output_ids)
                completion = self._completion + len(extra)
            else:
                extra = tuple(done.output_ids)
                completion = max(done.completion_tokens, len(extra))
            stop_token, stop_text = matched_stop(done)
            return Finished(
                reason=FINISH_REASONS.get(done.finish_reason, FinishReason.STOP),
                prompt_tokens=done.prompt_tokens or self._prompt,
                completion_tokens=completion,
                cached_tokens=done.cached_tokens or self._cached,
                token_ids=extra,
                matched_token_id=stop_token,
                matched_stop_str=stop_text,
                kv_transfer_params_json=(
                    done.kv_transfer_params_json
                    if done.HasField("kv_transfer_params_json") else None
                ),
            )
        raise EngineError(ErrorKind.PROTOCOL, "GenerateResponse with neither chunk nor complete")


class VllmDialect(Dialect):
    kind: ClassVar[str] = "vllm"
    capabilities: ClassVar[Capabilities] = Capabilities(prefill_decode=True, text_input=True)

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall clock, to turn the reported uptime into a start time

    def generate(self, call: GenerateCall) -> Rpc:
        s = call.sampling
        params: dict[str, Any] = {
            "temperature": s.temperature,  # unset would mean 1.0, not our value
            "top_p": s.top_p,
            "top_k": s.top_k,  # 0 = disabled
            "min_p": s.min_p,
            "frequency_penalty": s.frequency_penalty,
            "presence_penalty": s.presence_penalty,
            "repetition_penalty": s.repetition_penalty,
            "max_tokens": s.max_tokens,  # unset would mean up to max_model_len
            "min_tokens": s.min_tokens,
            "stop_token_ids": s.stop_token_ids,
            "ignore_eos": s.ignore_eos,
        }
        if s.seed is not None:
            params["seed"] = int32_seed(s.seed)
        request = pb.GenerateRequest(
            request_id=call.request_id,
            tokenized={"original_text": call.original_text, "input_ids": call.input_ids},
            sampling_params=params,
            stream=call.stream,
        )
        pd = call.disaggregation
        if pd is not None and pd.kv_transfer_params_json is not None:
            request.kv_transfer_params_json = pd.kv_transfer_params_json  # verbatim (§9.2)
        return Rpc(f"{SERVICE}/Generate", request, pb.GenerateResponse)

    def stream_decoder(self, call: GenerateCall) -> StreamDecoder:
        return VllmStreamDecoder(call.stream)

    def abort(self, request_id: str, reason: str = "") -> Rpc:
        # The contract takes a list and no reason; the reply is empty (errors are statuses).
        return Rpc(f"{SERVICE}/Abort", pb.AbortRequest(request_ids=[request_id]), pb.AbortResponse)

    def health(self) -> Rpc:
        return Rpc(f"{SERVICE}/HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse)

    def health_result(self, response: Any) -> HealthResult:
        return HealthResult(bool(response.healthy), response.message)

    def discovery(self) -> Sequence[Rpc]:
        return (
            Rpc(f"{SERVICE}/GetModelInfo", pb.GetModelInfoRequest(), pb.GetModelInfoResponse),
            Rpc(f"{SERVICE}/GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse),
        )

    def engine_info(self, responses: Sequence[Any]) -> EngineInfo:
        model, server = responses
        # Only the uptime is reported: the start it implies is stable across calls to
        # within the call latency, so whole seconds name one incarnation. A stock
        # servicer (0.14.1) leaves uptime at 0: then the restart is unknowable here
        # (the KV-event sequence reset still reveals it) and the incarnation is empty.
        if server.uptime_seconds > 0:
            started = self._clock() - server.uptime_seconds
            incarnation = datetime.fromtimestamp(round(started), UTC).isoformat()
        else:
            started, incarnation = None, ""
        return EngineInfo(
            served_model_name=model.served_model_name,
            model_path=model.model_path,
            context_length=model.max_context_length or None,  # max_model_len: the window
            max_input_length=model.max_req_input_len or None,
            eos_token_ids=tuple(model.eos_token_ids),
            block_size=server.block_size or None,  # 0 until the engine resolved it
            role=ROLES.get(server.kv_role),
            data_parallel_size=server.data_parallel_size or 1,
            incarnation=incarnation,
            started_at=started,
            details=(
                ("kv_role", server.kv_role),
                ("kv_connector", server.kv_connector),
                ("kv_engine_id", server.kv_engine_id),
                ("kv_cache_dtype", server.kv_cache_dtype),
                ("model_dtype", server.model_dtype),
                ("server_type", server.server_type),
            ),
        )
