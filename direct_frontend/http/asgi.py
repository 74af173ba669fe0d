"""The ASGI plumbing every endpoint shares: types, body reading and writing, lifespan.

Also the guard that keeps the ``http.disconnect`` hypercorn sends while
recycling a finished connection from looking like a client that left, and
the last resort that answers a request whose handler failed unexpectedly.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any, Final

import msgspec
import trio

from direct_frontend.fleet.schema import FrontendConfig
from direct_frontend.observability.logging import current_request_id, new_request_id
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    body_timeout,
    error_body,
    internal_error,
    request_too_large,
)
from direct_frontend.pipeline.settings import Settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
#: an endpoint: the request's settings snapshot and its ASGI triple in, the HTTP status out
Handler = Callable[[Settings, Scope, Receive, Send], Awaitable[int]]

JSON = b"application/json"

#: the HTTP shell's log (the request log's name)
log: Final = logging.getLogger("direct_frontend.http")
#: JSON bodies: one encoder for the shell, which reuses its buffer between calls
encode_json: Final = msgspec.json.Encoder().encode

#: what the app's ``receive`` gives instead of the ``http.disconnect`` hypercorn
#: sends once the response is complete (see :meth:`ResponseProgress.receiving`)
RESPONSE_DONE = "direct_frontend.response_done"
_REQUEST_ID: Final = b"x-request-id"
_NAME: Final = operator.itemgetter(0)  # a header's name


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


class ResponseProgress:
    """How far a response got: one wrapper around a request's ``send`` (and its ``receive``).

    ``send`` is the wrapped send the handler uses. Knowing whether the response
    started lets a handler that failed unexpectedly still be answered
    (:meth:`fail`); knowing whether it finished keeps the ``http.disconnect``
    hypercorn sends *during* our last ``send`` from the app (:meth:`receiving`).
    """

    __slots__ = ("_send", "finished", "replace", "request_id", "started")

    def __init__(self, send: Send, request_id: bytes, *, replace: bool = False) -> None:
        self._send = send
        #: the ``x-request-id`` every answer carries: ours, or (``replace``) the client's own,
        #: which takes the place of ours wherever a handler wrote that
        self.request_id = request_id
        self.replace = replace
        self.started = False
        self.finished = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = list(message.get("headers", ()))
            # a handler's own x-request-id stays, unless the client's replaces it (the names
            # are looked through in C: every response starts here)
            if self.replace or _REQUEST_ID not in map(_NAME, headers):
                message = {**message, "headers": self._with_id(headers)}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    def _with_id(self, headers: Headers) -> list[tuple[bytes, bytes]]:
        """``headers`` with :attr:`request_id` as their only ``x-request-id``."""
        out = [header for header in headers if header[0] != _REQUEST_ID]
        out.append((_REQUEST_ID, self.request_id))
        return out

    def receiving(self, receive: Receive) -> Receive:
        """``receive``, with the disconnect that follows a finished response hidden.

        Hypercorn recycles (or, shutting down, closes) the connection inside the
        final body ``send`` and tells the app ``http.disconnect`` as part of it.
        A disconnect watcher woken by that would count a finished response as
        abandoned, and cancel the rest of hypercorn's work in our task: the
        connection would then stay open until the shutdown grace period ends.
        After the last body a disconnect is not the client leaving, so it is
        never delivered as one: it comes as a ``RESPONSE_DONE`` message, on
        which the watcher simply ends. (:meth:`send` marks the response finished
        before passing the last body on: the disconnect arrives inside it.)
        """

        async def tracked_receive() -> Message:
            message = await receive()
            if self.finished and message["type"] == "http.disconnect":
                return {"type": RESPONSE_DONE}
            return message

        return tracked_receive

    async def fail(self, headers: Headers) -> None:
        """End the response after an unexpected error: a 500 if nothing was sent yet.

        Never the empty 500 the server would write: an OpenAI error with
        ``headers`` (the request id). A response already under way is ended
        as it stands; a stream writes its own error event before getting here.
        """
        if not self.started:
            await send_error(self._send, internal_error(), headers)
        elif not self.finished:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        self.started = self.finished = True


def header(scope: Scope, name: bytes) -> bytes:
    """A request header's value (``name`` in lower case), stripped; empty when absent."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).strip()
    return b""


async def read_body(receive: Receive, limit: int, timeout_s: float = math.inf) -> bytes:
    """The whole request body; a 413 past ``limit`` (counted as it arrives), a 408 after
    ``timeout_s`` (a client trickling its body would hold the connection forever)."""
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise request_too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise body_timeout(timeout_s)


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: Headers | tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body, "more_body": False})


#: how the request being served shapes an error body: OpenAI's, or the Messages API's
#: (Anthropic's), set once per request by the app so every layer's error speaks its client's
error_shape: ContextVar[Callable[[OpenAIHTTPError], bytes]] = ContextVar(
    "error_shape", default=error_body)


async def send_error(send: Send, err: OpenAIHTTPError, headers: Headers | None = None) -> None:
    await send_body(send, err.status, error_shape.get()(err), JSON,
                    [*err.headers, *(headers or [])])


async def from_body(frontend: FrontendConfig, receive: Receive, send: Send,
                    answer: Callable[[bytes, Headers], Awaitable[int]],
                    gone: Callable[[], None]) -> int:
    """Read the body and ``answer`` it; a refusal on the way is its HTTP error (``gone``
    hears of a client that left while it sent the body: 499)."""
    request_id = current_request_id.get() or new_request_id()
    headers: Headers = [(b"x-request-id", request_id.encode())]
    try:
        body = await read_body(receive, frontend.max_body_bytes, frontend.body_timeout_s)
        return await answer(body, headers)
    except OpenAIHTTPError as err:
        await send_error(send, err, headers)
        return err.status
    except ClientGone:
        gone()
        return 499


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
