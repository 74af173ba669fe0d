"""SGLang's SMG contract (``sglang.grpc.scheduler.SglangScheduler``).

Quirks handled here (docs/engine-contracts.md §4): the prompt must be token ids;
``temperature`` and ``max_new_tokens`` are always sent (an unset cap means no
cap at all); chunk counts are cumulative; in streaming mode the terminal
``complete`` repeats the last delta, so its ``output_ids`` are never appended;
``max_context_length`` is the KV pool size, not the model window, so it is not
used as the context length; an engine-side abort ends the stream with status
INTERNAL "Request aborted", classified like the other kinds' in-band aborts.

A leg of a prefill/decode pair carries ``DisaggregatedParams`` (request
field 10: the prefill engine's bootstrap host and port, and a room), the
same on both legs (§9.1).

A request's ``seed`` cannot be sent: ``SamplingParams`` has no seed field
(``custom_params`` feed a custom logit processor, not the sampler), so SGLang
samples unseeded. Stop strings are applied by the frontend, as for every kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from google.protobuf import json_format
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from direct_frontend.engines.dialects.base import (
    FINISH_REASONS,
    Capabilities,
    Dialect,
    HealthResult,
    Rpc,
    StreamDecoder,
    after_terminal,
    classify_exception,
    engine_aborted,
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
from protos import sglang_scheduler_pb2 as pb

SERVICE = "/sglang.grpc.scheduler.SglangScheduler"
ROLES = {"prefill": EngineRole.PREFILL, "decode": EngineRole.DECODE, "null": EngineRole.BOTH}


class SglangStreamDecoder(StreamDecoder):
    """Decoder for one SGLang Generate stream (chunk counts are cumulative)."""

    def __init__(self, stream: bool) -> None:
        self._stream = stream
        self._delivered = 0
        self._last: tuple[int, ...] = ()
        self._prompt = 0
        self._completion = 0
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
            self._completion = max(chunk.completion_tokens, self._delivered)
            self._cached = chunk.cached_tokens
            if not ids:
                return None
            return TokenDelta(ids, self._prompt, self._completion, self._cached)
        if which == "complete":
            done = message.complete
            self.finished = True
            problem = unusual_finish(done.finish_reason)
            if problem is not None:
                raise problem
            # Streaming: output_ids repeat the last chunk. Non-streaming: the whole output.
            if self._stream:
                extra = streamed_tail(self._last, self._delivered, done.output_ids)
            else:
                extra = tuple(done.output_ids)
            completion = max(done.completion_tokens, self._delivered + len(extra))
            stop_token, stop_text = matched_stop(done)
            return Finished(
                reason=FINISH_REASONS.get(done.finish_reason, FinishReason.STOP),
                prompt_tokens=done.prompt_tokens or self._prompt,
                completion_tokens=completion,
                cached_tokens=done.cached_tokens or self._cached,
                token_ids=extra,
                matched_token_id=stop_token,
                matched_stop_str=stop_text,
            )
        raise EngineError(ErrorKind.PROTOCOL, "GenerateResponse with neither chunk nor complete")


class SglangDialect(Dialect):
    kind: ClassVar[str] = "sglang"
    capabilities: ClassVar[Capabilities] = Capabilities(prefill_decode=True, bootstrap_server=True)

    def generate(self, call: GenerateCall) -> Rpc:
        s = call.sampling
        # Sub-messages as dicts: protobuf builds them in place instead of copying.
        request = pb.GenerateRequest(
            request_id=call.request_id,
            tokenized={"original_text": call.original_text, "input_ids": call.input_ids},
            sampling_params={
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k if s.top_k > 0 else -1,
                "min_p": s.min_p,
                "frequency_penalty": s.frequency_penalty,
                "presence_penalty": s.presence_penalty,
                "repetition_penalty": s.repetition_penalty,
                "max_new_tokens": s.max_tokens,
                "stop_token_ids": s.stop_token_ids,
                "min_new_tokens": s.min_tokens,
                "ignore_eos": s.ignore_eos,
                "skip_special_tokens": True,
            },
            stream=call.stream,
        )
        pd = call.disaggregation
        if pd is not None and pd.bootstrap_room is not None:
            # The same rendezvous goes on both legs of a P/D pair (§9.1).
            request.disaggregated_params.bootstrap_host = pd.bootstrap_host
            request.disaggregated_params.bootstrap_port = pd.bootstrap_port
            request.disaggregated_params.bootstrap_room = pd.bootstrap_room
        return Rpc(f"{SERVICE}/Generate", request, pb.GenerateResponse)

    def stream_decoder(self, call: GenerateCall) -> StreamDecoder:
        return SglangStreamDecoder(call.stream)

    def abort(self, request_id: str, reason: str = "") -> Rpc:
        request = pb.AbortRequest(request_id=request_id, reason=reason or "client cancelled")
        return Rpc(f"{SERVICE}/Abort", request, pb.AbortResponse)

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
        has_args = server.HasField("server_args")
        args = json_format.MessageToDict(server.server_args) if has_args else {}
        role = ROLES.get(str(args.get("disaggregation_mode", "null")), EngineRole.BOTH)
        bootstrap = args.get("disaggregation_bootstrap_port")
        bootstrap_port = int(bootstrap) if isinstance(bootstrap, (int, float)) else 0
        window = args.get("context_length")
        page = args.get("page_size")
        started = server.HasField("start_time")
        incarnation = server.start_time.ToJsonString() if started else ""
        return EngineInfo(
            served_model_name=model.served_model_name,
            model_path=model.model_path,
            # max_context_length is the KV pool size; only server_args has the window.
            context_length=int(window) if isinstance(window, (int, float)) and window else None,
            max_input_length=model.max_req_input_len or None,
            eos_token_ids=tuple(model.eos_token_ids),
            block_size=int(page) if isinstance(page, (int, float)) and page else None,
            role=role,
            data_parallel_size=int(args.get("dp_size", 1) or 1),
            incarnation=incarnation,
            started_at=server.start_time.ToNanoseconds() / 1e9 if started else None,
            bootstrap_port=bootstrap_port or None,
            details=(
                ("kv_pool_tokens", str(model.max_context_length)),
                ("bootstrap_port", str(args.get("disaggregation_bootstrap_port", ""))),
                ("sglang_version", server.sglang_version),
            ),
        )

    def classify(self, exc: BaseException) -> EngineError:
        """SGLang reports an engine-side abort as INTERNAL; read it as the others' abort."""
        if (
            isinstance(exc, GRPCError)
            and exc.status is Status.INTERNAL
            and "abort" in (exc.message or "").lower()
        ):
            return engine_aborted()
        return classify_exception(exc)
