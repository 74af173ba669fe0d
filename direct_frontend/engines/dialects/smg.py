"""The SMG gRPC contracts (SGLang's, vLLM's, TensorRT-LLM's): what their messages share.

Each contract has its own service and messages, but they name their
terminal message's fields alike (``finish_reason``, the ``matched_stop``
oneof) and share the health and discovery calls; SGLang's and vLLM's share
GetLoads and Embed too. Their Generate streams read alike, but for how they
count tokens (:class:`SmgStreamDecoder`); TensorRT-LLM's has a decoder of
its own.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar

from direct_frontend.engines.dialects.base import (
    Dialect,
    HealthResult,
    Rpc,
    StreamDecoder,
    engine_aborted,
)
from direct_frontend.engines.neutral import (
    EmbedCall,
    Embedding,
    EngineEvent,
    Finished,
    FinishReason,
    GenerateCall,
    PromptLogprobs,
    SamplingOptions,
    TokenDelta,
    TokenLogprob,
)
from direct_frontend.errors import EngineError, ErrorKind

FINISH_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "stop_word": FinishReason.STOP,  # TensorRT-LLM's spelling
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


def matched_stop(complete: Any) -> tuple[int | None, str | None]:
    """A terminal message's ``matched_stop`` oneof (the same names in every contract).

    Returns the stop token id or the stop string that ended the output, or neither.
    """
    which = complete.WhichOneof("matched_stop")
    return (
        complete.matched_token_id if which == "matched_token_id" else None,
        complete.matched_stop_str if which == "matched_stop_str" else None,
    )


def unusual_finish(reason: str) -> EngineError | None:
    """An engine-side abort or error ends a stream without a usable result."""
    if reason in ("abort", "cancelled"):  # "cancelled" is TensorRT-LLM's spelling
        return engine_aborted()
    if reason == "error":
        return EngineError(ErrorKind.INTERNAL, "the engine failed the request")
    return None


def streamed_tail(
    last_delta: Sequence[int], delivered: int, output_ids: Sequence[int]
) -> tuple[int, ...]:
    """Tokens of a streaming terminal ``complete`` that no chunk delivered yet.

    SGLang and vLLM repeat the last chunk's delta in the complete, so normally
    nothing is new. A complete with no chunk before it carries new tokens; any
    other difference would silently drop or duplicate output, so it is a
    protocol fault.
    """
    ids = tuple(output_ids)
    if not ids or ids == tuple(last_delta):
        return ()
    if delivered == 0:
        return ids
    raise EngineError(
        ErrorKind.PROTOCOL,
        f"the terminal message's {len(ids)} tokens do not repeat the last delta "
        f"({len(last_delta)} tokens)",
    )


def after_terminal() -> EngineError:
    """A message after the terminal one: the stream no longer matches its contract."""
    return EngineError(ErrorKind.PROTOCOL, "a message arrived after the terminal message")


#: what stands for -inf (a token the sampler masked out), as vLLM's OpenAI server writes it
LOGPROB_FLOOR = -9999.0


def ranked(ids: Sequence[int], values: Sequence[float], n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely of a position's alternatives, highest first (floored)."""
    pairs = sorted(zip(ids, values, strict=False), key=lambda pair: -pair[1])[:n]
    return tuple((token, max(value, LOGPROB_FLOOR)) for token, value in pairs)


def smg_output_logprobs(wire: Any, ids: Sequence[int], n: int) -> tuple[TokenLogprob, ...]:
    """SGLang's or vLLM's ``OutputLogProbs`` for the tokens ``ids`` (same shape in both).

    One entry per token is the contract; a message that breaks it would shift
    every later position, so it is a protocol fault (the stream migrates).
    """
    values, wire_ids, tops = wire.token_logprobs, wire.token_ids, wire.top_logprobs
    if len(values) != len(ids) or list(wire_ids) != list(ids):
        raise EngineError(
            ErrorKind.PROTOCOL,
            f"logprobs for {len(wire_ids)} tokens came with {len(ids)} tokens",
        )
    return tuple(
        TokenLogprob(
            token, max(value, LOGPROB_FLOOR),
            ranked(tops[i].token_ids, tops[i].values, n) if i < len(tops) else (),
        )
        for i, (token, value) in enumerate(zip(ids, values, strict=True))
    )


def smg_prompt_logprobs(wire: Any, prompt_len: int, n: int) -> PromptLogprobs:
    """SGLang's or vLLM's ``InputLogProbs``, one entry per prompt token.

    The first token has no value; an engine that starts later (SGLang's
    ``logprob_start_len``) leaves the leading positions without one too.
    """
    tops = wire.top_logprobs
    entries: list[TokenLogprob | None] = []
    for i, (token, value) in enumerate(zip(wire.token_ids, wire.token_logprobs, strict=False)):
        if not value.HasField("value"):
            entries.append(None)
            continue
        top = ranked(tops[i].token_ids, tops[i].values, n) if i < len(tops) else ()
        entries.append(TokenLogprob(token, max(value.value, LOGPROB_FLOOR), top))
    missing = max(0, prompt_len - len(entries))
    return (None,) * missing + tuple(entries[-prompt_len:] if prompt_len else entries)


class SmgStreamDecoder(StreamDecoder):
    """One Generate stream of SGLang's or vLLM's contract, which read alike but for counts.

    Chunk ``completion_tokens`` are cumulative, or each chunk's own count when
    :attr:`counts_per_chunk` (summed here); a kind's terminal count and any
    extra field of its terminal message are its subclass's
    (:meth:`_final_count`, :meth:`_handoff`). In streaming mode the terminal
    ``complete`` repeats the last delta, so its ``output_ids`` are never
    appended; in non-streaming mode it is the whole output.
    """

    counts_per_chunk: ClassVar[bool] = False

    def __init__(
        self, stream: bool, *, logprobs: int | None = None, prompt_logprobs: int | None = None,
        prompt_len: int = 0,
    ) -> None:
        self._stream = stream
        self._top = logprobs  # None: the call asked for no logprobs
        self._prompt_top = prompt_logprobs
        self._prompt_len = prompt_len
        self._prompt_pending: PromptLogprobs | None = None  # read, not yet on an event
        self._delivered = 0
        self._last: tuple[int, ...] = ()
        self._prompt = 0
        self._completion = 0
        self._cached = 0
        self._summed = self.counts_per_chunk  # per message, an instance read is the cheaper
        self.finished = False

    def feed(self, message: Any) -> EngineEvent | None:
        if self.finished:
            raise after_terminal()
        which = message.WhichOneof("response")
        if which == "chunk":
            chunk = message.chunk
            ids = tuple(chunk.token_ids)
            self._delivered = delivered = self._delivered + len(ids)
            self._last = ids
            self._prompt = prompt = chunk.prompt_tokens
            counted = chunk.completion_tokens
            if self._summed:
                counted += self._completion
            self._completion = completion = max(counted, delivered)
            self._cached = cached = chunk.cached_tokens
            if self._prompt_top is not None:
                self._read_prompt(chunk)
            if not ids:  # e.g. the empty output vLLM sends before an abort
                return None
            if self._top is None and self._prompt_pending is None:
                return TokenDelta(ids, prompt, completion, cached)
            logprobs = (
                () if self._top is None
                else smg_output_logprobs(chunk.output_logprobs, ids, self._top)
            )
            return TokenDelta(ids, prompt, completion, cached, logprobs, self._take_prompt())
        if which == "complete":
            return self._finish(message.complete)
        raise EngineError(ErrorKind.PROTOCOL, "GenerateResponse with neither chunk nor complete")

    def _finish(self, done: Any) -> Finished:
        self.finished = True
        problem = unusual_finish(done.finish_reason)
        if problem is not None:
            raise problem
        if self._stream:
            extra = streamed_tail(self._last, self._delivered, done.output_ids)
        else:
            extra = tuple(done.output_ids)
        stop_token, stop_text = matched_stop(done)
        # Streaming, the complete's logprobs repeat the last delta's, as its ids do.
        logprobs = (
            smg_output_logprobs(done.output_logprobs, extra, self._top)
            if self._top is not None and extra else ()
        )
        if self._prompt_top is not None:
            self._read_prompt(done)
        return Finished(
            reason=FINISH_REASONS.get(done.finish_reason, FinishReason.STOP),
            prompt_tokens=done.prompt_tokens or self._prompt,
            completion_tokens=self._final_count(done, extra),
            cached_tokens=done.cached_tokens or self._cached,
            token_ids=extra,
            matched_token_id=stop_token,
            matched_stop_str=stop_text,
            kv_transfer_params_json=self._handoff(done),
            logprobs=logprobs,
            prompt_logprobs=self._take_prompt(),
        )

    def _read_prompt(self, message: Any) -> None:
        """Keep the first prompt logprobs a message carries (later copies repeat them)."""
        if self._prompt_top is not None and message.HasField("input_logprobs"):
            self._prompt_pending = smg_prompt_logprobs(
                message.input_logprobs, self._prompt_len, self._prompt_top
            )
            self._prompt_top = None  # read once

    def _take_prompt(self) -> PromptLogprobs | None:
        pending, self._prompt_pending = self._prompt_pending, None
        return pending

    @abc.abstractmethod
    def _final_count(self, done: Any, extra: tuple[int, ...]) -> int:
        """The whole output's token count, given the terminal message and its new tokens."""

    def _handoff(self, done: Any) -> str | None:
        """What a prefill leg's terminal message hands to the decode leg (vLLM)."""
        return None


def smg_sampling(s: SamplingOptions, **own: Any) -> dict[str, Any]:
    """The ``SamplingParams`` fields SGLang's and vLLM's contracts name alike, and ``own``
    (the kind's names for the rest), as the dict protobuf builds the message from.

    The temperature is always sent: unset would mean 1.0 in both, not the request's.
    """
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty,
        "stop_token_ids": s.stop_token_ids,
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": s.skip_special_tokens,
        **own,
    }


class SmgDialect(Dialect):
    """A dialect over one of the SMG gRPC contracts, which share health and discovery.

    Each contract has its own service and messages (never another kind's,
    even where they look alike): :attr:`service` and :attr:`pb` name them.
    """

    service: ClassVar[str]  # the gRPC service path, e.g. "/vllm.grpc.engine.VllmEngine"
    pb: ClassVar[ModuleType]  # the contract's generated message classes
    #: SGLang's and vLLM's decoder (TensorRT-LLM's dialect builds its own in stream_decoder)
    decoder: ClassVar[type[SmgStreamDecoder]]

    def stream_decoder(self, call: GenerateCall) -> StreamDecoder:
        s = call.sampling
        return self.decoder(
            call.stream, logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
            prompt_len=len(call.input_ids),
        )

    def health(self) -> Rpc:
        pb = self.pb
        return Rpc(f"{self.service}/HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse)

    def health_result(self, response: Any) -> HealthResult:
        return HealthResult(bool(response.healthy), response.message)

    def get_loads(self) -> Rpc:
        """GetLoads (SGLang, vLLM); optional, as not every servicer version serves it."""
        pb = self.pb
        return Rpc(f"{self.service}/GetLoads", pb.GetLoadsRequest(include=["core"]),
                   pb.GetLoadsResponse, optional=True)

    def loads(self) -> Rpc | None:
        return self.get_loads()

    def engine_requests(self, response: Any) -> int:
        """Running and waiting requests on every rank (SGLang and vLLM share ``SchedulerLoad``)."""
        return sum(load.num_running_reqs + load.num_waiting_reqs for load in response.loads)

    def rank_requests(self, response: Any) -> dict[int, int]:
        return {load.dp_rank: load.num_running_reqs + load.num_waiting_reqs
                for load in response.loads}

    def embed(self, call: EmbedCall) -> Rpc:
        # SGLang's and vLLM's requests differ in their other fields, which stay unset here
        pb = self.pb
        request = pb.EmbedRequest(
            request_id=call.request_id,
            tokenized={"original_text": call.original_text, "input_ids": call.input_ids},
        )
        return Rpc(f"{self.service}/Embed", request, pb.EmbedResponse)

    def embedding(self, reply: Any) -> Embedding:
        vector = reply.embedding
        if not vector or (reply.embedding_dim and reply.embedding_dim != len(vector)):
            raise EngineError(
                ErrorKind.PROTOCOL,
                f"Embed returned {len(vector)} values, its embedding_dim says "
                f"{reply.embedding_dim}",
            )
        return Embedding(vector, reply.prompt_tokens)

    def discovery(self) -> Sequence[Rpc]:
        pb, service = self.pb, self.service
        return (
            Rpc(f"{service}/GetModelInfo", pb.GetModelInfoRequest(), pb.GetModelInfoResponse),
            Rpc(f"{service}/GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse),
        )
