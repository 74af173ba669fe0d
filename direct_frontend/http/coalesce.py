"""A shim for hypercorn: write an HTTP/1.1 response head with the first body bytes, and the
last body bytes with the end of the body.

hypercorn writes ``http.response.start`` to the socket at once, on its own.
A streamed response then reaches the client in two writes before its first
token (head, then the first SSE event): two system calls and two wake-ups of
the client, ≈ 0.3 ms of time to first token at concurrency 1 on our cores.
The ASGI spec leaves the server free to hold the head until the first body
message, so this does:
:class:`CoalescingH11Protocol` renders the head at once (h11's state, header
validation and the keep-alive ``connection: close`` are hypercorn's own) but
keeps its bytes until the response's next event, and writes them with that
event's bytes in one send when it is body data or the end of the body.
Anything else (the stream closing without a body, say) writes the held head
first, on its own, exactly as hypercorn would have.

The same holds for the end of a response: hypercorn writes the last body
message's bytes, then the end of the body (a chunked stream's ``0\r\n\r\n``)
in a second send. :class:`FinalBodyHTTPStream` notes when the app's body
message is its last (``more_body`` false), and the protocol then holds those
bytes for the end of the body that hypercorn sends right after, in the same
call: a streamed response of one batch goes out in one write instead of three.

The stream also hands each request a
:class:`~direct_frontend.http.disconnect.Disconnect` in its scope, which it
fires when the connection closes before the last body: the app's writer
watches its client with it instead of with a task reading ``receive``.

Our app always follows ``http.response.start`` with a body message at once
(:func:`~direct_frontend.http.asgi.send_body`, the relay's first output), so
nothing is delayed. Only HTTP/1.1 is affected (hypercorn's h2 protocol is
left alone). :func:`install` does nothing unless hypercorn is a release this
was checked against (:data:`CHECKED`) *and* has the shape it relies on; whether
it is in use is part of :func:`~direct_frontend.observability.shims.shims_active`.
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine
from typing import Any

import hypercorn.protocol
from hypercorn.events import Event, RawData
from hypercorn.protocol.events import Body, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream

from direct_frontend.http.disconnect import DISCONNECT, Disconnect
from direct_frontend.observability.shims import ShimStatus, gate, register

SHIM = "hypercorn_coalesce"
#: hypercorn releases whose ``H11Protocol.stream_send`` this shim was checked against
CHECKED = ("0.18.0",)


class FinalBodyHTTPStream(HTTPStream):
    """hypercorn's HTTP stream, noting when the app sends its last body message; and giving
    the app a :class:`~direct_frontend.http.disconnect.Disconnect` it fires when the
    connection closes before that (so no task of the app's has to wait for it)."""

    #: the body being sent now is the response's last: its end follows in the same call
    final_body = False
    disconnect: Disconnect | None = None

    def handle(self, event: Any) -> Coroutine[Any, Any, None]:
        """hypercorn's own coroutine for ``event`` (a plain function: no coroutine of ours
        in between), but for a request's start; a close before the last body fires the
        request's disconnect first (one after it is no client leaving)."""
        if isinstance(event, Request):
            return self._start(event)
        if isinstance(event, StreamClosed) and self.disconnect is not None and not (
                self.closed or self.final_body):
            self.disconnect.fire()
        return HTTPStream.handle(self, event)

    async def _start(self, event: Request) -> None:
        await HTTPStream.handle(self, event)
        if not self.closed:
            # the app's task is started, not run yet (nothing has yielded since): it finds
            # the extension in its scope
            extensions: dict[str, Any] = self.scope["extensions"]
            extensions[DISCONNECT] = self.disconnect = Disconnect()

    async def app_send(self, message: Any) -> None:
        if (
            message is not None
            and message["type"] == "http.response.body"
            and not message.get("more_body", False)
            and not (getattr(self, "response", None) or {}).get("trailers", False)
        ):
            self.final_body = True
        await super().app_send(message)


class CoalescingH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, writing a response head with the next bytes of its body,
    and a last body with the end of the body."""

    _held: bytes | None = None  # rendered bytes not written yet (a head, a last body)

    async def stream_send(self, event: StreamEvent) -> None:
        held = self._held
        if held is None and isinstance(event, Response) and event.status_code >= 200:
            self._held = await self._render(event)
            return
        if isinstance(event, Body) and getattr(self.stream, "final_body", False):
            self._held = (held or b"") + await self._render(event)  # its end comes next
            return
        if held is None:
            await super().stream_send(event)
            return
        self._held = None
        if isinstance(event, (Body, EndBody)):
            data = held + await self._render(event)
            if data:
                await self.send(RawData(data=data))
            return
        if held:
            await self.send(RawData(data=held))
        await super().stream_send(event)

    async def _render(self, event: StreamEvent) -> bytes:
        """The bytes hypercorn writes for ``event``, rendered through it but not written.

        For a response head, body data and the end of the body hypercorn only
        renders with h11 and calls ``self.send(RawData(...))``: nothing else
        runs (and nothing yields) while ``send`` is swapped.
        """
        rendered: list[bytes] = []
        send = self.send

        async def collect(out: Event) -> None:
            if not isinstance(out, RawData):
                raise RuntimeError(f"hypercorn sent {out!r} while rendering {event!r}")
            rendered.append(out.data)

        self.send = collect
        try:
            await super().stream_send(event)
        finally:
            self.send = send
        return b"".join(rendered)


def _shape_problem() -> str | None:
    """What differs from the hypercorn this shim relies on (``None``: nothing)."""
    if "H11Protocol" not in hypercorn.protocol.ProtocolWrapper.__init__.__code__.co_names:
        return "its ProtocolWrapper no longer builds hypercorn.protocol.H11Protocol"
    if not inspect.iscoroutinefunction(H11Protocol.stream_send):
        return "H11Protocol.stream_send is not a coroutine function"
    if "HTTPStream" not in H11Protocol._create_stream.__code__.co_names:
        return "H11Protocol no longer builds hypercorn.protocol.h11.HTTPStream"
    if not inspect.iscoroutinefunction(HTTPStream.app_send) or not hasattr(
        HTTPStream, "_send_closed"
    ):
        return "HTTPStream.app_send is not a coroutine function, or it has no _send_closed"
    if not inspect.iscoroutinefunction(HTTPStream.handle) or "spawn_app" not in (
            HTTPStream.handle.__code__.co_names):
        return "HTTPStream.handle is not a coroutine function that starts the app"
    if "send" not in inspect.signature(H11Protocol.__init__).parameters:
        return "H11Protocol no longer writes through a send callable"
    return None


def check() -> ShimStatus:
    """The gate, judged on the hypercorn installed now."""
    return gate(SHIM, "hypercorn", CHECKED, _shape_problem)


#: the gate as :func:`install` last judged it (judging reads package metadata: once)
_judged: ShimStatus | None = None


def install() -> bool:
    """Make hypercorn serve HTTP/1.1 with :class:`CoalescingH11Protocol` (process-wide).

    Returns whether it is in use: not where :func:`check` says the shim is off.
    Idempotent.
    """
    global _judged
    _judged = check()
    if not _judged.active:
        return False
    hypercorn.protocol.H11Protocol = CoalescingH11Protocol  # type: ignore[attr-defined]
    hypercorn.protocol.h11.HTTPStream = FinalBodyHTTPStream  # type: ignore[attr-defined]
    return True


def status() -> ShimStatus:
    """Whether hypercorn serves HTTP/1.1 through the shim now, and if not, why (cheap)."""
    if _judged is None:
        return ShimStatus(SHIM, False, "not installed")
    in_use = (
        hypercorn.protocol.H11Protocol is CoalescingH11Protocol  # type: ignore[attr-defined]
        and hypercorn.protocol.h11.HTTPStream is FinalBodyHTTPStream  # type: ignore[attr-defined]
    )
    if _judged.active and not in_use:
        return ShimStatus(SHIM, False, f"{_judged.reason}: replaced since it was installed")
    return _judged


register(SHIM, status)
