"""Fault injection: make a simulated engine die, hang, slow down or fail on cue.

Fault-tolerance tests need engines that misbehave the way real ones do: a
process that dies mid-stream (the connection drops, no terminal message), a
scheduler that stops producing tokens but keeps the connection open, an
overloaded engine answering ``RESOURCE_EXHAUSTED``. A :class:`FaultPlan` says
what goes wrong; ``SimEngine.faults`` holds the live plan, which is read
afresh at every step so a test (even from another thread) can flip a fault
while streams run.

The faults sit between grpclib and the servicers (a ``RecvRequest`` event
listener wraps each ``Generate`` and ``Embed`` call), so every engine kind gets them
without knowing, and what reaches the wire is exactly what the servicer
would have sent, cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, cast

import grpclib.events
import grpclib.server
from grpclib import GRPCError, Status

_GENERATE_SUFFIX = "/Generate"
_EMBED_SUFFIX = "/Embed"
_Handler = Callable[[grpclib.server.Stream[Any, Any]], Coroutine[Any, Any, None]]


@dataclasses.dataclass(slots=True)
class FaultPlan:
    """What goes wrong on ``Generate`` and ``Embed`` calls; mutable, and read at every step.

    Token thresholds count the tokens already sent to the client on that
    call (a non-streaming call "sends" all of its tokens with its one
    complete, so the fault acts only once its sequence has finished, and the
    engine's stats count that sequence as completed). A threshold of N lets
    the client receive at most N tokens and never the terminal message once
    N are out; a call that finishes with fewer tokens is not affected. When
    several faults are due at once, die wins over status, and status over hang.
    An Embed call sends no tokens, so only thresholds of 0 act on it (die,
    fail or hang before its one reply).

    - ``die_after_tokens``: drop the connection as a dying process would (no
      trailers, no GOAWAY; other calls on the same connection break too).
      0 drops it as soon as the request arrives.
    - ``hang_after_tokens``: stop sending but keep the call and connection
      open (and the sequence's batch slot held) until the client cancels or
      the engine closes. 0 hangs before the first token.
    - ``status``: end the call with this gRPC status once
      ``status_after_tokens`` tokens are out; 0 (the default) refuses the call
      before it is admitted, as an overloaded or failing engine does.
    - ``token_delay_s``: extra time before every token of every sequence
      (health-probe generations included), on top of the timing model.
    - ``only_request``: apply the die/hang/status faults only to the Nth
      ``Generate`` or ``Embed`` call (1-based, both counted together) since
      this plan was assigned to the engine.
    """

    die_after_tokens: int | None = None
    hang_after_tokens: int | None = None
    status: Status | None = None
    status_after_tokens: int = 0
    status_message: str = "Injected fault"
    token_delay_s: float = 0.0
    only_request: int | None = None

    def __post_init__(self) -> None:
        for name in ("die_after_tokens", "hang_after_tokens", "only_request"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative")
        if self.status_after_tokens < 0 or self.token_delay_s < 0:
            raise ValueError("status_after_tokens and token_delay_s must not be negative")
        if self.status is Status.OK:
            raise ValueError("an injected status must be an error, not OK")


def parse_status(name: str) -> Status:
    """A gRPC status by name (``UNAVAILABLE``, ``resource_exhausted``) or number."""
    text = name.strip()
    try:
        status = Status(int(text)) if text.isdigit() else Status[text.upper()]
    except (KeyError, ValueError):
        raise ValueError(f"unknown gRPC status {name!r}") from None
    if status is Status.OK:
        raise ValueError("an injected status must be an error, not OK")
    return status


@dataclasses.dataclass(slots=True)
class FaultStats:
    """Which calls a fault hit, by request id, so tests can wait for it to happen."""

    generate_calls: int = 0
    embed_calls: int = 0
    died: list[str] = dataclasses.field(default_factory=list)
    hung: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)

    @property
    def calls(self) -> int:
        """The calls faults can hit, as ``only_request`` numbers them."""
        return self.generate_calls + self.embed_calls


class _Died(Exception):
    """Unwinds a call whose connection was dropped, without an error status."""


class Faulted(Protocol):
    """The engine core a :class:`FaultInjector` serves (simulator/core.py ``SimCore``): its
    live plan, and the ids of the requests it was sent."""

    faults: FaultPlan

    def note_request(self, request_id: str) -> None: ...


class FaultInjector:
    """Wraps every ``Generate`` and ``Embed`` call of one engine in the live :class:`FaultPlan`."""

    def __init__(self, core: Faulted) -> None:
        self.core = core
        self.stats = FaultStats()
        self._base = 0  # calls when the current plan was installed

    def install(self, plan: FaultPlan) -> None:
        """Make ``plan`` the live plan; ``only_request`` counts calls from now on."""
        self._base = self.stats.calls
        self.core.faults = plan

    def attach(self, server: grpclib.server.Server) -> None:
        """Hook into a freshly built grpclib server, before it accepts calls."""
        grpclib.events.listen(server, grpclib.events.RecvRequest, self._on_request)

    async def _on_request(self, event: grpclib.events.RecvRequest) -> None:
        name = event.method_name
        if name.endswith((_GENERATE_SUFFIX, _EMBED_SUFFIX)):
            handler: _Handler = event.method_func
            embed = name.endswith(_EMBED_SUFFIX)

            async def faulty(stream: grpclib.server.Stream[Any, Any]) -> None:
                await self._call(handler, stream, embed=embed)

            event.method_func = faulty

    async def _call(
        self, handler: _Handler, stream: grpclib.server.Stream[Any, Any], *, embed: bool
    ) -> None:
        request = await stream.recv_message()
        if request is None:
            await handler(stream)  # let the servicer refuse it as it would
            return
        if embed:
            self.stats.embed_calls += 1
        else:
            self.stats.generate_calls += 1
        call = _FaultyCall(self, stream, request, self.stats.calls)
        plan = call.plan()
        if plan is not None:
            if plan.die_after_tokens == 0:
                if not embed:  # the engine's request ids are Generate's
                    self.core.note_request(call.request_id)
                call.die()
                return
            if plan.status is not None and plan.status_after_tokens == 0:
                if not embed:
                    self.core.note_request(call.request_id)
                self.stats.failed.append(call.request_id)
                raise GRPCError(plan.status, plan.status_message)
        with contextlib.suppress(_Died):  # the transport is closing: grpclib sends nothing more
            await handler(call.as_stream())


class _FaultyCall:
    """One ``Generate`` or ``Embed`` call: the servicer's view of its stream, faults applied."""

    def __init__(
        self,
        injector: FaultInjector,
        stream: grpclib.server.Stream[Any, Any],
        request: Any,
        number: int,
    ) -> None:
        self._injector = injector
        self._stream = stream
        self._request: Any = request  # handed to the servicer's first recv_message
        self._number = number
        self.request_id: str = request.request_id
        # SGLang and vLLM name the flag "stream", TRT-LLM "streaming".
        self._streaming = bool(getattr(request, "stream", False)) or bool(
            getattr(request, "streaming", False)
        )
        self._sent = 0

    def plan(self) -> FaultPlan | None:
        """The live plan if it targets this call, else None."""
        plan = self._injector.core.faults
        if plan.only_request is not None and (
            plan.only_request != self._number - self._injector._base
        ):
            return None
        return plan

    def as_stream(self) -> grpclib.server.Stream[Any, Any]:
        """This call, typed as the stream the servicer expects (it duck-types)."""
        return cast("grpclib.server.Stream[Any, Any]", self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def recv_message(self) -> Any:
        request, self._request = self._request, None
        if request is not None:
            return request
        return await self._stream.recv_message()

    async def send_message(self, message: Any) -> None:
        tokens, terminal = self._count(message)
        await self._check(tokens, terminal)
        await self._stream.send_message(message)
        self._sent += tokens
        if not terminal:
            await self._check(0, False)  # a fault due at exactly N tokens acts at once

    def _count(self, message: Any) -> tuple[int, bool]:
        """New tokens in ``message`` and whether it ends the call."""
        if "response" not in message.DESCRIPTOR.oneofs_by_name:
            return 0, True  # an EmbedResponse: the call's one reply, no tokens
        which = message.WhichOneof("response")
        if which == "chunk":
            return len(message.chunk.token_ids), False
        if which == "complete":
            # A streaming complete repeats (SGLang, vLLM) or sums up (TRT-LLM)
            # tokens already sent as chunks; a non-streaming one carries them all.
            return (0 if self._streaming else message.complete.completion_tokens), True
        return 0, False

    async def _check(self, tokens: int, terminal: bool) -> None:
        plan = self.plan()
        if plan is None:
            return

        def due(limit: int | None) -> bool:
            # Past the limit, or at it with nothing further allowed.
            if limit is None:
                return False
            total = self._sent + tokens
            return total > limit or (total == limit and (terminal or tokens == 0))

        if due(plan.die_after_tokens):
            self.die()
            raise _Died
        if plan.status is not None and due(plan.status_after_tokens):
            self._injector.stats.failed.append(self.request_id)
            raise GRPCError(plan.status, plan.status_message)
        if due(plan.hang_after_tokens):
            self._injector.stats.hung.append(self.request_id)
            # Never resolved: only the client's cancel or the engine's close ends it.
            await asyncio.get_running_loop().create_future()

    def die(self) -> None:
        """Close the call's connection like a dying process: what was written goes out, then FIN."""
        self._injector.stats.died.append(self.request_id)
        self._stream._stream.connection.close()


# -- listening on and off -------------------------------------------------------


async def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, non-blocking TCP socket for ``host:port``, reusable across restarts."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, sock_type, proto, _, address = infos[0]
    sock = socket.socket(family, sock_type, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def is_listening(server: grpclib.server.Server) -> bool:
    """Whether the server accepts new connections."""
    listener = server._server
    return listener is not None and listener.is_serving()


def stop_listening(server: grpclib.server.Server) -> None:
    """Close the listening socket (connects are refused) but keep open connections serving."""
    listener = server._server
    if listener is not None:
        listener.close()  # asyncio leaves accepted connections alone


async def resume_listening(server: grpclib.server.Server, host: str, port: int) -> None:
    """Listen again on ``host:port`` with the same grpclib server and handlers."""
    if is_listening(server):
        return
    sock = await listen_socket(host, port)
    try:
        listener = await asyncio.get_running_loop().create_server(
            server._protocol_factory, sock=sock
        )
    except BaseException:
        sock.close()
        raise
    server._server = listener
