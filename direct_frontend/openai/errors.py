"""OpenAI-shaped errors: what a client sees for a bad request or a failed engine.

Every failure is an :class:`OpenAIHTTPError` with its HTTP status and, where a
field is to blame, ``param`` naming its path as the OpenAI API does.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import msgspec

from direct_frontend.errors import EngineError, ErrorKind


@dataclasses.dataclass(eq=False, repr=False)
class OpenAIHTTPError(Exception):
    """An error the client sees as an OpenAI error body with an HTTP status.

    ``headers`` are extra ASGI response headers (``Allow`` for 405,
    ``Retry-After`` for 429/503).
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    _: dataclasses.KW_ONLY
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def __post_init__(self) -> None:
        super().__init__(self.message)  # ``str(err)`` is the message

    def __repr__(self) -> str:
        return (
            f"OpenAIHTTPError({self.status}, {self.message!r}, type={self.type!r}, "
            f"param={self.param!r}, code={self.code!r})"
        )


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorEnvelope(msgspec.Struct):
    error: _ErrorDetail


_encode: Final = msgspec.json.Encoder().encode


def error_body(err: OpenAIHTTPError) -> bytes:
    """The OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return _encode(_ErrorEnvelope(_ErrorDetail(err.message, err.type, err.param, err.code)))


def _retry_after(seconds: int | None) -> tuple[tuple[bytes, bytes], ...]:
    return () if seconds is None else ((b"retry-after", str(seconds).encode()),)


def invalid_request(message: str, param: str | None = None) -> OpenAIHTTPError:
    """400: the request body is wrong or asks for something unsupported."""
    return OpenAIHTTPError(400, message, "invalid_request_error", param)


def model_not_found(model: str) -> OpenAIHTTPError:
    """404 for a model no engine serves; same wording and code as OpenAI."""
    return OpenAIHTTPError(
        404,
        f"The model '{model}' does not exist or is not served here.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def previous_response_not_found(response_id: str) -> OpenAIHTTPError:
    """400 for a ``previous_response_id`` nothing holds; OpenAI's wording and code."""
    return OpenAIHTTPError(
        400, f"Previous response with id '{response_id}' not found.", "invalid_request_error",
        "previous_response_id", "previous_response_not_found",
    )


def response_not_found(response_id: str) -> OpenAIHTTPError:
    """404 for ``/v1/responses/{id}`` when no response by that id is held."""
    return OpenAIHTTPError(404, f"Response with id '{response_id}' not found.",
                           "invalid_request_error")


def not_cancellable(response_id: str) -> OpenAIHTTPError:
    """400 for a cancel of a response that was not run in the background."""
    return OpenAIHTTPError(
        400, f"Response '{response_id}' was not created with background=true: only a "
        "background response can be cancelled.", "invalid_request_error", "response_id",
    )


def response_too_large(limit: int) -> OpenAIHTTPError:
    """What ends a background response whose event log outgrew what its owner may keep."""
    return OpenAIHTTPError(
        413, f"The response grew past what one API key may keep stored ({limit} bytes, "
        "[frontend.responses]): it was stopped. Ask for less output, or end older "
        "background responses.", "invalid_request_error", None, "response_too_large",
    )


def shutting_down() -> OpenAIHTTPError:
    """503 for work that would outlive the process: it is shutting down."""
    return OpenAIHTTPError(503, "The server is shutting down; retry on another.",
                           "server_error", None, "shutting_down", headers=_retry_after(1))


def store_unavailable() -> OpenAIHTTPError:
    """503: the database of stored responses and conversations did not answer (why is
    logged, not told: it may name the database's host)."""
    return OpenAIHTTPError(503, "The store of responses and conversations is unavailable; "
                           "retry.", "server_error", None, "store_unavailable",
                           headers=_retry_after(1))


def request_too_large(limit_bytes: int) -> OpenAIHTTPError:
    """413 when the body exceeds the configured cap (checked before parsing)."""
    return OpenAIHTTPError(
        413,
        f"Request body too large; the limit is {limit_bytes} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def context_length_exceeded(
    prompt_tokens: int, limit: int, param: str, *, at_least: bool = False
) -> OpenAIHTTPError:
    """400 for a prompt that leaves no room to generate; OpenAI's code for it.

    ``at_least``: ``prompt_tokens`` is a lower bound (the prompt was refused untokenized).
    """
    return OpenAIHTTPError(
        400,
        f"This model's maximum context length is {limit} tokens, "
        f"but the prompt has {'at least ' if at_least else ''}{prompt_tokens} tokens.",
        "invalid_request_error",
        param,
        "context_length_exceeded",
    )


def rate_limited(
    message: str = "Too many requests.", retry_after: int | None = None
) -> OpenAIHTTPError:
    """429: admission control refused the request; clients back off and retry."""
    return OpenAIHTTPError(
        429,
        message,
        "rate_limit_exceeded",
        None,
        "rate_limit_exceeded",
        headers=_retry_after(retry_after),
    )


def rate_limit_exceeded(
    message: str, limit: str, headers: tuple[tuple[bytes, bytes], ...]
) -> OpenAIHTTPError:
    """429 for a tenant over its rate limit: OpenAI's shape, whose ``type`` names the limit
    (``requests`` or ``tokens``); ``headers`` carry ``retry-after`` and the limits."""
    return OpenAIHTTPError(429, message, limit, None, "rate_limit_exceeded", headers=headers)


def no_engine_available(model: str, retry_after: int | None = 1) -> OpenAIHTTPError:
    """503: the model is known but no engine can serve it right now."""
    return OpenAIHTTPError(
        503,
        f"No engine is available to serve model '{model}' right now; retry shortly.",
        "server_error",
        None,
        "no_engine_available",
        headers=_retry_after(retry_after),
    )


def internal_error(message: str = "Internal server error.") -> OpenAIHTTPError:
    """500: a bug or unexpected failure in the frontend itself."""
    return OpenAIHTTPError(500, message, "server_error", None, "internal_error")


def engine_failed(message: str) -> OpenAIHTTPError:
    """502: the engine failed or broke its protocol."""
    return OpenAIHTTPError(502, message, "server_error", None, "engine_error")


def body_timeout(timeout_s: float) -> OpenAIHTTPError:
    """408: the request body did not arrive within ``body_timeout_s``; the connection closes."""
    return OpenAIHTTPError(
        408,
        f"The request body did not arrive within {timeout_s:g} s.",
        "invalid_request_error",
        None,
        "request_timeout",
        headers=((b"connection", b"close"),),
    )


def engine_timeout(message: str = "The inference engine timed out.") -> OpenAIHTTPError:
    """504: the engine did not answer (or stalled) within its deadline."""
    return OpenAIHTTPError(504, message, "server_error", None, "engine_timeout")


def method_not_allowed(method: str, path: str, allowed: tuple[str, ...]) -> OpenAIHTTPError:
    """405 with the ``Allow`` header HTTP requires."""
    return OpenAIHTTPError(
        405,
        f"Method {method} is not allowed for {path}; use {', '.join(allowed)}.",
        "invalid_request_error",
        None,
        "method_not_allowed",
        headers=((b"allow", ", ".join(allowed).encode()),),
    )


def unknown_route(method: str, path: str) -> OpenAIHTTPError:
    """404 for a path we do not serve; OpenAI's wording (``Invalid URL``)."""
    return OpenAIHTTPError(
        404, f"Invalid URL ({method} {path})", "invalid_request_error", None, "unknown_url"
    )


def from_engine_error(err: EngineError) -> OpenAIHTTPError:
    """Map a classified engine failure (after retries gave up) to a client error."""
    match err.kind:
        case ErrorKind.BAD_REQUEST if err.param is not None:  # refused before it was sent
            return invalid_request(err.message, err.param)
        case ErrorKind.BAD_REQUEST:
            return invalid_request(f"The engine rejected the request: {err.message}")
        case ErrorKind.TIMEOUT:
            return engine_timeout(f"The inference engine timed out: {err.message}")
        case ErrorKind.OVERLOADED:
            return OpenAIHTTPError(
                503,
                f"The inference engines are overloaded: {err.message}",
                "server_error",
                None,
                "engine_overloaded",
                headers=_retry_after(1),
            )
        case ErrorKind.INTERNAL:
            return OpenAIHTTPError(
                500,
                f"The inference engine failed: {err.message}",
                "server_error",
                None,
                "engine_error",
            )
        case ErrorKind.CANCELLED:
            return OpenAIHTTPError(
                503,
                f"The request was cancelled: {err.message}",
                "server_error",
                None,
                "cancelled",
            )
        case ErrorKind.UNAVAILABLE | ErrorKind.PROTOCOL | ErrorKind.DRAINING:
            return engine_failed(f"The inference engine failed: {err.message}")


