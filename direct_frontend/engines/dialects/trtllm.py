"""TensorRT-LLM's SMG contract (``trtllm.TrtllmService``).

Quirks handled here (docs/engine-contracts.md §6): the prompt goes in
``tokenized.input_token_ids``; ``max_tokens`` is required; the stream flag is
``streaming``; sampling fields are optional and the adapter defaults unset
ones, so ours are sent explicitly (a ``seed`` is uint64 here: a negative one
is sent as its two's complement, so it still always reproduces the same
output). Chunk counts are cumulative. The terminal ``complete`` carries the
whole output (cumulative), in both modes: only tokens no chunk delivered are
emitted from it (normally none when streaming), and it is cross-checked
against what was delivered. ``finish_reason`` is TensorRT-LLM's own string
or "": an empty one is derived (a matched stop, else the budget used up,
else a stop); "cancelled" (an abort), "abort", "error" and "timeout" are
engine-side failures.

Structured outputs go in ``guided_decoding`` (field 11: a guide type and
its text). ``json_object`` is sent as the schema ``{"type":"object"}``
(``GUIDE_TYPE_JSON`` would allow any JSON value, not only an object), and a
choice as the regex of its alternatives; the engine must run with a guided
decoding backend (``guided_decoding_backend: xgrammar``) or it refuses them.
"Tools or the response format" (a request with tools and a response format)
is sent with no guide at all: the structural tag that says it is xgrammar's
newer format, which a TensorRT-LLM release compiles only with a recent
xgrammar, and older gRPC servers dropped a ``STRUCTURAL_TAG`` guide without
a word; the schema alone would keep the model from calling its tools. So the
tools stay callable and the answer's JSON is the model's own, unchecked.
``logit_bias`` has no place here (``embedding_bias`` is a whole-vocabulary
tensor), so it is a missing capability: such requests go to other kinds.

Stop strings (field 21) are never sent: the frontend applies stop strings
itself for every engine kind, so all kinds stop at the same place and
TensorRT-LLM's own tokenization of them never matters.

Discovery: the contract reports no served model name, only ``model_id``,
the model path or name the engine was started with: it fills
``served_model_name`` with ``served_name_known=False``, so the fleet file,
not the engine, vouches for the model. ``max_seq_len``/``max_input_len`` are
flag defaults (1024 on the PyTorch path, whatever the model), so they are
kept in the details only and the context length must come from the fleet
file. There is no disaggregation role, no start time and no EOS ids, and
prefill/decode is not possible through this contract.

Logprobs: ``output_config.logprobs`` (at least 1); chunks carry a
``TokenLogprob`` per token, the complete all of them (only those no chunk
delivered are read). Prompt logprobs are refused: this contract returns them
in the terminal message only, after the echo they belong to.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar

from direct_frontend.engines.dialects.base import (
    ANY_OBJECT_SCHEMA,
    Capabilities,
    DiscoverySources,
    HealthResult,
    Rpc,
    Source,
    StreamDecoder,
    choice_regex,
)
from direct_frontend.engines.dialects.ids import fill_prompt
from direct_frontend.engines.dialects.smg import (
    LOGPROB_FLOOR,
    SmgDialect,
    after_terminal,
    matched_stop,
    ranked,
    unusual_finish,
)
from direct_frontend.engines.neutral import (
    INT32_MAX,
    Constraint,
    ConstraintKind,
    EmbedCall,
    EngineEvent,
    EngineInfo,
    EngineRole,
    Finished,
    FinishReason,
    GenerateCall,
    TokenDelta,
    TokenLogprob,
)
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.protos import trtllm_service_pb2 as pb

SERVICE = "/trtllm.TrtllmService"
_GUIDES = pb.GuidedDecodingParams
GUIDE_TYPES = {
    ConstraintKind.JSON_SCHEMA: _GUIDES.GUIDE_TYPE_JSON_SCHEMA,
    ConstraintKind.JSON_OBJECT: _GUIDES.GUIDE_TYPE_JSON_SCHEMA,
    ConstraintKind.REGEX: _GUIDES.GUIDE_TYPE_REGEX,
    ConstraintKind.CHOICE: _GUIDES.GUIDE_TYPE_REGEX,
    ConstraintKind.GRAMMAR: _GUIDES.GUIDE_TYPE_EBNF_GRAMMAR,
    ConstraintKind.STRUCTURAL_TAG: _GUIDES.GUIDE_TYPE_STRUCTURAL_TAG,
}


def guided_decoding(
    constraint: Constraint,
) -> tuple[pb.GuidedDecodingParams.GuideType, str] | None:
    """The ``GuidedDecodingParams`` guide type and guide for a neutral constraint.

    None for "tools or the response format": no guide is sent (module docstring).
    """
    kind = constraint.kind
    if kind is ConstraintKind.TOOLS_OR_FORMAT:
        return None
    if kind is ConstraintKind.JSON_OBJECT:
        guide = ANY_OBJECT_SCHEMA
    elif kind is ConstraintKind.CHOICE:
        guide = choice_regex(constraint.choices)
    else:
        guide = constraint.text
    return GUIDE_TYPES[kind], guide


NORMAL_FINISHES = {"stop": FinishReason.STOP, "stop_word": FinishReason.STOP,
                   "length": FinishReason.LENGTH}


def finish_reason(reason: str, matched: bool, completion: int, max_tokens: int) -> FinishReason:
    """TensorRT-LLM's finish string as ours; an empty (or unknown) one is derived."""
    problem = unusual_finish(reason)
    if problem is not None:
        raise problem
    if reason == "timeout":
        raise EngineError(ErrorKind.INTERNAL, "the engine timed the request out")
    known = NORMAL_FINISHES.get(reason)
    if known is not None:
        return known
    if matched:
        return FinishReason.STOP
    return FinishReason.LENGTH if completion >= max_tokens else FinishReason.STOP


def token_logprobs(entries: Any, ids: Sequence[int], n: int) -> tuple[TokenLogprob, ...]:
    """TensorRT-LLM's ``TokenLogprob`` list for ``ids``: one entry per token, or a fault."""
    if len(entries) != len(ids) or any(e.token_id != t for e, t in zip(entries, ids, strict=True)):
        raise EngineError(
            ErrorKind.PROTOCOL, f"logprobs for {len(entries)} tokens came with {len(ids)} tokens"
        )
    return tuple(
        TokenLogprob(
            e.token_id, max(e.logprob, LOGPROB_FLOOR),
            ranked([t.token_id for t in e.top_logprobs], [t.logprob for t in e.top_logprobs], n),
        )
        for e in entries
    )


class TrtllmStreamDecoder(StreamDecoder):
    """Decoder for one TensorRT-LLM Generate stream (the complete is cumulative)."""

    def __init__(self, max_tokens: int, logprobs: int | None = None) -> None:
        self._max_tokens = max_tokens
        self._top = logprobs
        self._delivered: list[int] = []
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
            self._delivered.extend(ids)
            self._prompt = chunk.prompt_tokens
            self._completion = max(chunk.completion_tokens, len(self._delivered))
            self._cached = chunk.cached_tokens
            if not ids:  # the adapter may send an empty chunk before the first output
                return None
            if self._top is None:
                return TokenDelta(ids, self._prompt, self._completion, self._cached)
            return TokenDelta(
                ids, self._prompt, self._completion, self._cached,
                token_logprobs(chunk.logprobs, ids, self._top),
            )
        if which == "complete":
            done = message.complete
            self.finished = True
            output = tuple(done.output_token_ids)
            delivered = len(self._delivered)
            stop_token, stop_text = matched_stop(done)
            reason = finish_reason(
                done.finish_reason,
                stop_token is not None or stop_text is not None,
                max(done.completion_tokens, len(output)),
                self._max_tokens,
            )
            if len(output) < delivered or list(output[:delivered]) != self._delivered:
                raise EngineError(
                    ErrorKind.PROTOCOL,
                    f"the terminal output ({len(output)} tokens) does not extend the "
                    f"{delivered} tokens streamed",
                )
            extra = output[delivered:]
            logprobs: tuple[TokenLogprob, ...] = ()
            if self._top is not None and extra:
                # cumulative like the ids; a complete holding only its new tokens' is read too
                wire = done.logprobs
                tail = wire[delivered:] if len(wire) == len(output) else wire
                logprobs = token_logprobs(tail, extra, self._top)
            return Finished(
                reason=reason,
                prompt_tokens=done.prompt_tokens or self._prompt,
                completion_tokens=max(done.completion_tokens, len(output)),
                cached_tokens=done.cached_tokens or self._cached,
                token_ids=extra,
                matched_token_id=stop_token,
                matched_stop_str=stop_text,
                logprobs=logprobs,
            )
        raise EngineError(ErrorKind.PROTOCOL, "GenerateResponse with neither chunk nor complete")


class TrtllmDialect(SmgDialect):
    kind: ClassVar[str] = "trtllm"
    #: prompt logprobs come only in the terminal message, after the text they would lead
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_decode=False, prompt_logprobs=False, optional=frozenset({"seed"}),
        reports_model=False,
    )
    service: ClassVar[str] = SERVICE
    pb: ClassVar[ModuleType] = pb

    def build(self, call: GenerateCall) -> Rpc:
        s = call.sampling
        # Unset temperature/top_p/repetition_penalty default to 1.0 on the adapter:
        # always send ours. The others are sent only when they do something.
        config: dict[str, Any] = {
            "beam_width": 1,
            "num_return_sequences": 1,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "repetition_penalty": s.repetition_penalty,
        }
        if 0 < s.top_k <= INT32_MAX:  # beyond int32 keeps every token: unset does too
            config["top_k"] = s.top_k
        if s.min_p > 0:
            config["min_p"] = s.min_p
        if s.presence_penalty:
            config["presence_penalty"] = s.presence_penalty
        if s.frequency_penalty:
            config["frequency_penalty"] = s.frequency_penalty
        if s.min_tokens > 0:
            config["min_tokens"] = s.min_tokens
        if s.seed is not None:
            config["seed"] = s.seed & 0xFFFFFFFFFFFFFFFF  # uint64
        request = pb.GenerateRequest(
            request_id=call.request_id,
            sampling_config=config,
            # at least 1: whether 0 returns the sampled token's logprob is unconfirmed
            output_config=None if s.logprobs is None else {"logprobs": max(1, s.logprobs)},
            max_tokens=s.max_tokens,
            streaming=call.stream,
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
        )
        runs = fill_prompt(request.tokenized, "input_token_ids", call.original_text,
                           call.input_ids)
        guided = None if s.constraint is None else guided_decoding(s.constraint)
        if guided is not None:
            request.guided_decoding.guide_type, request.guided_decoding.guide = guided
        return Rpc(f"{SERVICE}/Generate", request, pb.GenerateResponse, runs=runs)

    def stream_decoder(self, call: GenerateCall) -> StreamDecoder:
        return TrtllmStreamDecoder(call.sampling.max_tokens, call.sampling.logprobs)

    def abort(self, request_id: str, reason: str = "") -> Rpc:
        # Whether a cancelled RPC aborts on TensorRT-LLM is unconfirmed: always send this.
        return Rpc(f"{SERVICE}/Abort", pb.AbortRequest(request_id=request_id), pb.AbortResponse)

    def health_result(self, response: Any) -> HealthResult:
        status = response.status
        return HealthResult(status == "OK", status)

    def loads(self) -> Rpc | None:
        return None  # the contract has no GetLoads

    def embed(self, call: EmbedCall) -> Rpc:
        # the contract has an Embed (its TokenizedInput names input_token_ids); the servicer
        # does not implement it
        raise NotImplementedError("trtllm engines serve no embeddings")

    discovers: ClassVar[DiscoverySources] = DiscoverySources(
        model=Source("not reported (GetModelInfo.model_id is the launch path)"),
        context_length=Source("not read (max_seq_len is a flag default)", "set context_length"),
        block_size=Source("tokens_per_block, not reported", "set block_size for KV routing"),
        kv_capacity=Source("not reported", "KV routing measures against the fullest engine seen"),
        data_parallel=Source("not reported", "never pinned to a rank: its contract names none"),
        serves=Source("generation only (its servicer does not implement Embed)"),
        role=Source("none (no P/D)"),
        restarts=Source("not reported: a new connection after an outage"),
    )

    def engine_info(self, responses: Sequence[Any]) -> EngineInfo:
        model, server = responses
        return EngineInfo(
            served_model_name=model.model_id,
            served_name_known=False,  # model_id is whatever path trtllm-serve was given
            model_path=model.model_id,
            context_length=None,  # max_seq_len is a flag default, never the window
            max_input_length=None,
            role=EngineRole.BOTH,  # aggregated only: no P/D through this contract
            details=(
                ("reported_max_seq_len", str(model.max_seq_len)),
                ("reported_max_input_len", str(model.max_input_len)),
                ("vocab_size", str(model.vocab_size)),
                ("backend", server.backend),
                ("version", server.version),
                ("tensor_parallel_size", str(server.tensor_parallel_size)),
                ("pipeline_parallel_size", str(server.pipeline_parallel_size)),
            ),
        )
