"""The dialect seam: what every engine kind must provide, and shared status mapping.

A dialect is sans-IO. It builds request messages, decodes response messages
into neutral events (one decoder per stream, because engines differ in whether
counts are cumulative and whether the terminal message repeats tokens) and
classifies failures into :class:`~direct_frontend.errors.ErrorKind` once, so
the layers above never see a gRPC status code.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from direct_frontend.engines.neutral import (
    EngineEvent,
    EngineInfo,
    FinishReason,
    GenerateCall,
)
from direct_frontend.errors import EngineError, ErrorKind


@dataclasses.dataclass(frozen=True, slots=True)
class Rpc:
    """One gRPC call, ready for the transport: method path, request, reply type."""

    path: str
    request: Any
    response_type: type[Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine kind can do through its contract, so routing never asks for more."""

    prefill_decode: bool
    text_input: bool = False
    #: the fleet file may name a prefill engine's bootstrap server port (SGLang)
    bootstrap_server: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class HealthResult:
    healthy: bool
    message: str


STATUS_KINDS: dict[Status, ErrorKind] = {
    Status.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    Status.DEADLINE_EXCEEDED: ErrorKind.TIMEOUT,
    Status.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED,
    Status.CANCELLED: ErrorKind.CANCELLED,
    Status.INVALID_ARGUMENT: ErrorKind.BAD_REQUEST,
    Status.OUT_OF_RANGE: ErrorKind.BAD_REQUEST,
    Status.FAILED_PRECONDITION: ErrorKind.BAD_REQUEST,
    Status.NOT_FOUND: ErrorKind.BAD_REQUEST,
    Status.ALREADY_EXISTS: ErrorKind.BAD_REQUEST,
    Status.UNIMPLEMENTED: ErrorKind.BAD_REQUEST,
    Status.PERMISSION_DENIED: ErrorKind.BAD_REQUEST,
    Status.UNAUTHENTICATED: ErrorKind.BAD_REQUEST,
    Status.ABORTED: ErrorKind.INTERNAL,
    Status.DATA_LOSS: ErrorKind.INTERNAL,
    Status.INTERNAL: ErrorKind.INTERNAL,
    Status.UNKNOWN: ErrorKind.INTERNAL,
}

FINISH_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "stop_word": FinishReason.STOP,  # TensorRT-LLM's spelling
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


def classify_exception(exc: BaseException) -> EngineError:
    """Map a transport fault or gRPC status to our error kind (shared by all dialects)."""
    if isinstance(exc, EngineError):
        return exc
    if isinstance(exc, GRPCError):
        kind = STATUS_KINDS.get(exc.status, ErrorKind.INTERNAL)
        return EngineError(kind, f"{exc.status.name}: {exc.message or ''}".rstrip(": "))
    if isinstance(exc, TimeoutError):  # grpclib's timeout= raises the builtin
        return EngineError(ErrorKind.TIMEOUT, "deadline exceeded")
    if isinstance(exc, (OSError, StreamTerminatedError, ProtocolError, EOFError)):
        return EngineError(ErrorKind.UNAVAILABLE, f"transport: {exc!r}")
    return EngineError(ErrorKind.INTERNAL, f"unexpected: {exc!r}")


ENGINE_ABORTED = "the engine aborted the request"


def engine_aborted() -> EngineError:
    """The one error every kind reports for an abort seen on the stream.

    SGLang ends an aborted stream with a status, vLLM with finish_reason
    "abort", TRT-LLM with "cancelled": the layers above see one error for all
    three. Our own aborts are sent after the stream is dropped, so an abort
    seen here was the engine's (or another client's): a 500, not a cancel.
    """
    return EngineError(ErrorKind.INTERNAL, ENGINE_ABORTED)


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


class StreamDecoder(abc.ABC):
    """Turns one Generate stream's messages into neutral events, in order.

    ``feed`` returns ``None`` for a message that carries nothing new (e.g. a
    terminal message that only repeats the last delta). ``end`` is called when
    the transport closes the stream: a stream without a terminal message is a
    protocol fault (the engine died mid-stream).
    """

    finished: bool = False

    @abc.abstractmethod
    def feed(self, message: Any) -> EngineEvent | None: ...

    def end(self) -> None:
        if not self.finished:
            raise EngineError(ErrorKind.PROTOCOL, "stream ended without a terminal message")


class Dialect(abc.ABC):
    """One engine kind's side of the seam."""

    kind: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @abc.abstractmethod
    def generate(self, call: GenerateCall) -> Rpc: ...

    @abc.abstractmethod
    def stream_decoder(self, call: GenerateCall) -> StreamDecoder: ...

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str = "") -> Rpc: ...

    @abc.abstractmethod
    def health(self) -> Rpc: ...

    @abc.abstractmethod
    def health_result(self, response: Any) -> HealthResult: ...

    @abc.abstractmethod
    def discovery(self) -> Sequence[Rpc]: ...

    @abc.abstractmethod
    def engine_info(self, responses: Sequence[Any]) -> EngineInfo:
        """Build :class:`EngineInfo` from the replies to :meth:`discovery`, in order."""

    def classify(self, exc: BaseException) -> EngineError:
        return classify_exception(exc)
