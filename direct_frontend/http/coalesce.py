"""A shim for hypercorn: write an HTTP/1.1 response head together with the first body bytes.

hypercorn writes ``http.response.start`` to the socket at once, on its own.
A streamed response then reaches the client in two writes before its first
token (head, then the first SSE event): two system calls and two wake-ups of
the client, ≈ 0.3 ms of time to first token at concurrency 1 on our cores.
The ASGI spec leaves the server free to hold the head until the first body
message (it was once required to: django/asgiref#138, #388), so this does:
:class:`CoalescingH11Protocol` renders the head at once (h11's state, header
validation and the keep-alive ``connection: close`` are hypercorn's own) but
keeps its bytes until the response's next event, and writes them with that
event's bytes in one send when it is body data or the end of the body.
Anything else (the stream closing without a body, say) writes the held head
first, on its own, exactly as hypercorn would have.

Our app always follows ``http.response.start`` with a body message at once
(:func:`~direct_frontend.http.asgi.send_body`, the relay's first output), so
nothing is delayed. Only HTTP/1.1 is affected (hypercorn's h2 protocol is
left alone). :func:`install` does nothing unless hypercorn is a release this
was checked against (:data:`CHECKED`) *and* has the shape it relies on; whether
it is in use is part of :func:`~direct_frontend.observability.shims.shims_active`.
"""

from __future__ import annotations

import inspect

import hypercorn.protocol
from hypercorn.events import Event, RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol

from direct_frontend.observability.shims import ShimStatus, gate, register

SHIM = "hypercorn_coalesce"
#: hypercorn releases whose ``H11Protocol.stream_send`` this shim was checked against
CHECKED = ("0.18.0",)


class CoalescingH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, writing a response head with the next bytes of its body."""

    _head: bytes | None = None  # a rendered final response head, not written yet

    async def stream_send(self, event: StreamEvent) -> None:
        head = self._head
        if head is None:
            if isinstance(event, Response) and event.status_code >= 200:
                self._head = await self._render(event)
            else:
                await super().stream_send(event)
            return
        self._head = None
        if isinstance(event, (Body, EndBody)):
            data = head + await self._render(event)
            if data:
                await self.send(RawData(data=data))
            return
        if head:
            await self.send(RawData(data=head))
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
    return True


def status() -> ShimStatus:
    """Whether hypercorn serves HTTP/1.1 through the shim now, and if not, why (cheap)."""
    if _judged is None:
        return ShimStatus(SHIM, False, "not installed")
    in_use = hypercorn.protocol.H11Protocol is CoalescingH11Protocol  # type: ignore[attr-defined]
    if _judged.active and not in_use:
        return ShimStatus(SHIM, False, f"{_judged.reason}: replaced since it was installed")
    return _judged


register(SHIM, status)
