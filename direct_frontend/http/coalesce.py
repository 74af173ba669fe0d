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
(:func:`~direct_frontend.http.app.send_body`, the relay's first output), so
nothing is delayed. Only HTTP/1.1 is affected (hypercorn's h2 protocol is
left alone), and :func:`install` does nothing on a hypercorn release other
than the one this was checked against (:data:`CHECKED`).
"""

from __future__ import annotations

import importlib.metadata

import hypercorn.protocol
from hypercorn.events import Event, RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol

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


def install() -> bool:
    """Make hypercorn serve HTTP/1.1 with :class:`CoalescingH11Protocol` (process-wide).

    Returns whether it is in use: not on a hypercorn release outside :data:`CHECKED`.
    Idempotent.
    """
    if importlib.metadata.version("hypercorn") not in CHECKED:
        return False
    hypercorn.protocol.H11Protocol = CoalescingH11Protocol  # type: ignore[attr-defined]
    return True
