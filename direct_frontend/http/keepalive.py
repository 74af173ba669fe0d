"""A shim for hypercorn's Trio server: close an idle connection once its peer has, and cap them.

hypercorn's Trio ``TCPServer`` runs each connection in a nursery that also
holds the keep-alive timer (``_idle_timeout``, started whenever the
connection goes idle: after accept, and after each response through an
``Updated(idle=True)`` event). The read loop (``_read_data``) ends when the
peer closes or resets the connection, but the nursery then waits for the
timer, so our side of the socket stays open (CLOSE_WAIT) for the whole
``keep_alive_timeout``:

* when the peer closes an idle connection (the timer is running);
* when the peer resets the connection while a response is being written
  (h11 lets the read loop read on once the request is in, so it sees the
  reset): the finished response then recycles the connection and starts the
  timer anyway, for a connection nobody can use.

A client that opens a connection per request and closes it after the
response (Python's ``http.client``, many health checkers) thus leaves one
descriptor behind per request; at a 1,024-descriptor limit ``accept`` fails
with EMFILE. A bare hypercorn app on Trio does the same; no setting
changes it (``read_timeout`` bounds reads, not this wait).

:class:`PromptClosingTCPServer` stops the timer once the read loop has
ended, and starts none after that. Nothing more can arrive then; a response
being written still finishes (the timer never runs during a request), and
the connection closes when it has.

It also keeps the idle connections (those waiting for a request, new or
kept alive) in one process-wide :class:`IdleConnections` with a cap, like
the descriptor limit it protects: going over the cap closes the connection
that has been idle longest, as the keep-alive timeout would have, only sooner.
That bounds what clients that open connections and leave them open can hold.

A peer's FIN reaches an ASGI app as ``http.disconnect`` whether the client
hung up or only *half-closed* (sent its whole request, then
``shutdown(SHUT_WR)``, and waits for the answer, as ``nc -N`` and some
batch clients do). The generation endpoints cancel on ``http.disconnect``
(so the engine stops), which would leave a half-closing client without an
answer. Only a write can tell the two apart: a socket that was closed
answers data with a reset, a half-closed one acknowledges it. So when the
FIN comes after a complete HTTP/1.1 POST whose response has not started,
the shim writes an interim ``100 Continue`` (every HTTP/1.1 client must
accept 1xx responses before the final one; a stream that had already
started gets an SSE comment line, which every SSE client skips) and watches the socket
(:func:`peer_after_probe`): acknowledged, the request is answered as if
nothing happened, and the connection closes after the response; reset, or
no answer within :data:`PROBE_WAIT_S`, the app hears ``http.disconnect``
as it would without the shim. A FIN during any other response is a hang-up, and a
half-closed client that goes away later is found by the next writes.

:func:`install` does nothing unless hypercorn is a release this was checked
against (:data:`CHECKED`) *and* has the shape it relies on (the gate of
:mod:`direct_frontend.observability.shims`); hypercorn then behaves as it
always did. Whether it is in use is part of ``shims_active()``: logged at
start, exported as ``direct_frontend_shim_active{shim="hypercorn_keepalive"}``.
"""

from __future__ import annotations

import enum
import fcntl
import inspect
import logging
import math
import resource
import socket
import struct
from typing import Any, Final, Protocol

import h11
import hypercorn.trio.run
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.tcp_server import TCPServer

from direct_frontend.observability.shims import ShimStatus, gate, register

log = logging.getLogger(__name__)

SHIM = "hypercorn_keepalive"
#: hypercorn releases whose Trio ``TCPServer`` this shim was checked against
CHECKED = ("0.18.0",)

#: Most idle connections kept, and the share of the descriptor limit they may take.
MAX_IDLE: Final = 4096
IDLE_SHARE_OF_DESCRIPTORS: Final = 4


#: most bytes read from a connection at once: a long conversation's body (tens to hundreds of
#: kB) in one read where hypercorn's 64 KiB took several, each a pass through the server's
#: read loop and the app's receive (≈ 0.1 ms of CPU); what asyncio reads the engines with
READ_BYTES: Final = 256 << 10


#: how long a half-closed peer gets to acknowledge the interim response (then: it left)
PROBE_WAIT_S: Final = 1.0
_TCP_CLOSE: Final = 7  # tcpi_state values (linux/tcp_states.h)
_TCP_CLOSE_WAIT: Final = 8
_SIOCOUTQ: Final = 0x5411  # bytes not yet acknowledged by the peer (linux/sockios.h)


#: what probes a stream that had started when the FIN came: an SSE comment line
SSE_PROBE: Final = b":\n\n"


def _is_event_stream(stream: Any) -> bool:
    """Whether the response being written is Server-Sent Events (so a comment fits in)."""
    start = getattr(stream, "response", None)
    headers = start.get("headers", ()) if isinstance(start, dict) else ()
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in headers
    )


class Peer(enum.Enum):
    """What a peer that sent a FIN did with the bytes written after it."""

    LISTENING = "listening"  # acknowledged them: it half-closed and reads on
    GONE = "gone"  # reset the connection: it closed its socket
    UNKNOWN = "unknown"  # not yet (or this platform cannot tell)


def peer_after_probe(sock: socket.socket) -> Peer:
    """Read the kernel's view of a socket in CLOSE_WAIT after a write (Linux ``TCP_INFO``)."""
    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None:
        return Peer.UNKNOWN
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 8)[0]
        if state == _TCP_CLOSE:
            return Peer.GONE
        if state != _TCP_CLOSE_WAIT:
            return Peer.UNKNOWN
        unacknowledged = struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return Peer.GONE  # the descriptor is gone with the connection
    return Peer.LISTENING if unacknowledged == 0 else Peer.UNKNOWN


class Closable(Protocol):
    """What the idle registry needs of a connection's keep-alive timer (a cancel scope)."""

    def cancel(self) -> None: ...


class IdleConnections:
    """The keep-alive timers of idle connections, oldest first, at most ``cap`` of them.

    Adding one over the cap cancels the oldest timer, which closes that
    connection at once (cancelling the timer is its timeout arriving early).
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._timers: dict[Closable, None] = {}  # insertion-ordered: the oldest first

    def __len__(self) -> int:
        return len(self._timers)

    def add(self, timer: Closable) -> None:
        """A connection went idle; close the longest-idle ones over the cap."""
        self._timers[timer] = None
        while len(self._timers) > self.cap:
            oldest = next(iter(self._timers))
            del self._timers[oldest]
            oldest.cancel()

    def discard(self, timer: Closable) -> None:
        """A connection is no longer idle (a request came, or it closed)."""
        self._timers.pop(timer, None)


#: Every idle HTTP connection of this process (one daemon per process).
IDLE = IdleConnections(MAX_IDLE)


class ServerConfig(HypercornConfig):
    """hypercorn's settings plus what only the shim applies."""

    #: a request head must arrive within this long of its first byte (hypercorn has no such limit)
    header_timeout_s: float = math.inf


class PromptClosingTCPServer(TCPServer):
    """hypercorn's Trio connection, closed as soon as its peer closed it, idle ones capped.

    A request head must arrive within ``header_timeout_s`` of its first byte
    (:class:`ServerConfig`): the keep-alive timer, still running then, is
    brought forward.
    """

    _read_ended = False
    _serving = False
    _idle_timer: trio.CancelScope | None = None

    async def _read_data(self) -> None:
        timeout = self.config.read_timeout  # none by default: then no timeout scope per read
        while True:
            try:
                if timeout:
                    with trio.fail_after(timeout):
                        data = await self.stream.receive_some(READ_BYTES)
                else:
                    data = await self.stream.receive_some(READ_BYTES)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            if data and not self._serving and self._idle_timer is not None:
                # a request has begun: its head gets header_timeout_s, not the keep-alive wait
                head_by = trio.current_time() + getattr(self.config, "header_timeout_s", math.inf)
                self._idle_timer.deadline = min(self._idle_timer.deadline, head_by)
            await self.protocol.handle(RawData(bytes(data)))
            if not data:
                if await self._half_closed():
                    self._read_ended = True
                    await self.idle_task.stop()
                    return  # the response is written; the connection closes after it
                break
        # The peer closed or reset the connection (or the read failed): nothing can come.
        self._read_ended = True
        await self.idle_task.stop()
        await self.protocol.handle(Closed())

    async def _half_closed(self) -> bool:
        """After the peer's FIN: whether it awaits the response of a request it sent whole."""
        h11_protocol: Any = getattr(self.protocol, "protocol", None)
        connection = getattr(h11_protocol, "connection", None)
        stream = getattr(h11_protocol, "stream", None)
        scope = getattr(stream, "scope", None)
        if (
            not isinstance(connection, h11.Connection)
            or connection.their_http_version != b"1.1"
            or connection.their_state not in (h11.DONE, h11.CLOSED)
            or not isinstance(scope, dict)
            or scope.get("method") != "POST"
        ):
            return False
        raw = getattr(self.stream, "socket", None)
        if raw is None:  # TLS: the probe would be encrypted into a record; not attempted
            return False
        # h11 moves on synchronously, so the app cannot write in between.
        if connection.our_state is h11.SEND_RESPONSE:
            interim = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            probe = connection.send(interim)
        elif connection.our_state is h11.SEND_BODY and _is_event_stream(stream):
            probe = connection.send(h11.Data(data=SSE_PROBE))  # a comment: clients skip it
        else:
            return False
        assert probe is not None
        await self.protocol_send(RawData(probe))
        wait = 0.001
        with trio.move_on_after(PROBE_WAIT_S):
            while (peer := peer_after_probe(raw)) is Peer.UNKNOWN:
                await trio.sleep(wait)
                wait = min(wait * 2, 0.05)
            return peer is Peer.LISTENING
        return False

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self._serving = not event.idle
            if self._read_ended and event.idle:
                return  # no keep-alive wait for a request that cannot come: close when done
        await super().protocol_send(event)

    async def _idle_timeout(self) -> None:
        # hypercorn's own, with the timer registered as idle while it runs.
        with trio.move_on_after(self.config.keep_alive_timeout) as timer:
            IDLE.add(timer)
            self._idle_timer = timer
            try:
                await self.context.terminated.wait()
            finally:
                IDLE.discard(timer)
                self._idle_timer = None
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()


def _shape_problem() -> str | None:
    """What differs from the hypercorn this shim relies on (``None``: nothing)."""
    if getattr(hypercorn.trio.run, "TCPServer", None) not in (TCPServer, PromptClosingTCPServer):
        return "hypercorn.trio.run no longer serves with hypercorn.trio.tcp_server.TCPServer"
    for name in ("run", "protocol_send", "_read_data", "_idle_timeout", "_initiate_server_close"):
        if not inspect.iscoroutinefunction(getattr(TCPServer, name, None)):
            return f"TCPServer.{name} is not a coroutine function"
    if "idle_task" not in TCPServer.__init__.__code__.co_names:
        return "TCPServer no longer keeps its keep-alive timer in idle_task"
    return None


def check() -> ShimStatus:
    """The gate, judged on the hypercorn installed now."""
    return gate(SHIM, "hypercorn", CHECKED, _shape_problem)


def idle_cap(descriptor_limit: int) -> int:
    """How many idle connections to keep under a soft descriptor limit."""
    return max(1, min(MAX_IDLE, descriptor_limit // IDLE_SHARE_OF_DESCRIPTORS))


#: the gate as :func:`install` last judged it (judging reads package metadata: once)
_judged: ShimStatus | None = None


def install() -> bool:
    """Make hypercorn's Trio server use :class:`PromptClosingTCPServer` (process-wide).

    Call it after raising the descriptor limit: the idle cap is a share of
    it. Returns whether the shim is in use: not where :func:`check` says it
    is off. Idempotent.
    """
    global _judged
    _judged = check()
    if not _judged.active:
        return False
    IDLE.cap = idle_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    hypercorn.trio.run.TCPServer = PromptClosingTCPServer  # type: ignore[attr-defined]
    log.info("at most %d idle HTTP connections are kept open (the longest idle close first)",
             IDLE.cap)
    return True


def status() -> ShimStatus:
    """Whether hypercorn serves connections through the shim now, and if not, why (cheap)."""
    if _judged is None:
        return ShimStatus(SHIM, False, "not installed")
    in_use = getattr(hypercorn.trio.run, "TCPServer", None) is PromptClosingTCPServer
    if _judged.active and not in_use:
        return ShimStatus(SHIM, False, f"{_judged.reason}: replaced since it was installed")
    return _judged


register(SHIM, status)
