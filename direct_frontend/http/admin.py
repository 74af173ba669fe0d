"""The admin surface: ``GET /fleet``, ``POST /fleet/reload``, the ``/fleet/events`` WebSocket.

Also the bearer checks both surfaces share. The event broadcast is built so
the control plane never waits for a viewer: every subscriber has a bounded
queue and ``publish`` only ever does ``send_nowait``. A subscriber that falls
behind loses events and is marked; its writer then discards the stale queue
and sends a fresh snapshot carrying the number dropped, so a slow viewer
ends up right, just later.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from typing import Any, Protocol

import trio

from direct_frontend.engines.child import EngineChild
from direct_frontend.fleet.describe import JsonValue
from direct_frontend.http.openai_schema import OpenAIHTTPError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Event = dict[str, JsonValue]

log = logging.getLogger("direct_frontend.admin")

SUBSCRIBER_BUFFER = 256
LOAD_TICK_S = 1.0  # the events stream reports in-flight counts this often


# -- bearer checks ------------------------------------------------------------------------


def bearer(scope: Scope) -> str | None:
    """The ``Authorization: Bearer`` credential of a request, if any."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, credential = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and credential.strip():
                return credential.strip()
    return None


def credential_ok(scope: Scope, accepted: Sequence[str]) -> bool:
    """Whether the request's bearer credential is one of ``accepted`` (constant time)."""
    given = bearer(scope)
    if given is None:
        return False
    found = False
    for secret in accepted:  # no early exit: timing says nothing about which key matched
        found |= hmac.compare_digest(given.encode(), secret.encode())
    return found


def unauthorized(what: str = "API key") -> OpenAIHTTPError:
    """401 in OpenAI's shape; the credential given is never echoed."""
    return OpenAIHTTPError(
        401,
        f"Missing or incorrect {what}. Send it as 'Authorization: Bearer <{what.lower()}>'.",
        "invalid_request_error",
        None,
        "invalid_api_key",
        headers=((b"www-authenticate", b'Bearer realm="direct-frontend"'),),
    )


# -- the broadcast ------------------------------------------------------------------------


class Subscriber:
    """One viewer's bounded queue; ``dropped`` counts events it missed."""

    def __init__(self, buffer: int) -> None:
        self._tx, self.rx = trio.open_memory_channel[Event](buffer)
        self.dropped = 0
        self.lagging = False

    def offer(self, event: Event) -> bool:
        """Queue ``event`` without waiting; False if it was dropped because we are behind."""
        try:
            self._tx.send_nowait(event)
        except trio.WouldBlock:
            self.dropped += 1
            self.lagging = True
            return False
        except trio.ClosedResourceError:
            pass  # the viewer is leaving
        return True

    def close(self) -> None:
        self._tx.close()

    def take_lag(self) -> int | None:
        """If events were dropped since the last call: discard the stale queue, return the count."""
        if not self.lagging:
            return None
        self.lagging = False
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
            while True:
                self.rx.receive_nowait()
        return self.dropped


class EventHub:
    """Fan-out of control-plane events to any number of viewers, never blocking."""

    def __init__(self, buffer: int = SUBSCRIBER_BUFFER) -> None:
        self.buffer = buffer
        self.subscribers: set[Subscriber] = set()
        self.dropped_total = 0
        self.closed = False

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[Subscriber]:
        sub = Subscriber(self.buffer)
        if self.closed:
            sub.close()
        self.subscribers.add(sub)
        try:
            yield sub
        finally:
            self.subscribers.discard(sub)
            sub.close()

    def publish(self, event: Event) -> None:
        for sub in list(self.subscribers):
            if not sub.offer(event):
                self.dropped_total += 1

    def close(self) -> None:
        """Shutdown: every viewer's stream ends (so HTTP shutdown does not wait for them)."""
        self.closed = True
        for sub in self.subscribers:
            sub.close()


# -- what the endpoints show --------------------------------------------------------------


class ControlView(Protocol):
    """What the admin endpoints need from the daemon's control plane."""

    hub: EventHub

    def status(self) -> dict[str, JsonValue]: ...

    def loads(self) -> dict[str, JsonValue]: ...

    async def reload(self, trigger: str) -> dict[str, JsonValue]: ...


def engine_status(child: EngineChild) -> dict[str, JsonValue]:
    """One incarnation for ``/fleet`` and the events stream (no secrets here)."""
    probe = child.last_probe
    handle = child.handle
    channel = child.channel
    return {
        "name": child.name,
        "id": child.id,
        "url": child.cfg.url,
        "kind": child.cfg.kind,
        "role": (handle.role if handle is not None else child.cfg.role).value,
        "state": child.state.value,
        "generation": child.generation,
        "model": child.info.served_model_name if child.info is not None else None,
        "load": child.in_flight,
        "requests": child.load.requests_total,
        "last_probe": None if probe is None else {
            "ok": probe.ok, "message": probe.message, "at": probe.at,
        },
        "last_error": child.last_error or None,
        "since": child.since,
        "restarts": child.restarts,
        "connections_opened": channel.connections_opened if channel is not None else 0,
        "simulated": child.cfg.simulate,
    }


def encode(event: Event) -> str:
    return json.dumps(event, separators=(",", ":"))


# -- endpoints ----------------------------------------------------------------------------


async def events_socket(
    control: ControlView, scope: Scope, receive: Receive, send: Send,
    authorized: bool,
) -> None:
    """``/fleet/events``: a snapshot, then every state change and reload, then load ticks."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if not authorized:
        await _deny(scope, send)
        return
    await send({"type": "websocket.accept"})
    with control.hub.subscribe() as sub:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_ws_disconnect, receive, nursery.cancel_scope)
            await _write_events(control, sub, send)
            nursery.cancel_scope.cancel()


async def _write_events(control: ControlView, sub: Subscriber, send: Send) -> None:
    async def emit(event: Event) -> None:
        await send({"type": "websocket.send", "text": encode(event)})

    await emit({"type": "snapshot", "fleet": control.status()})
    while True:
        event: Event | None = None
        with trio.move_on_after(LOAD_TICK_S):
            try:
                event = await sub.rx.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                await send({"type": "websocket.close", "code": 1001})  # going away
                return
        dropped = sub.take_lag()
        if dropped is not None:
            await emit({"type": "snapshot", "fleet": control.status(), "dropped": dropped})
        elif event is not None:
            await emit(event)
        else:
            await emit({"type": "load", "engines": control.loads()})


async def _watch_ws_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "websocket.disconnect":
        pass  # viewers have nothing to say; their messages are ignored
    scope.cancel()


async def _deny(scope: Scope, send: Send) -> None:
    """Refuse a WebSocket handshake with a real 401 where the server allows it."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body = b'{"error":{"message":"Missing or incorrect admin token.",' \
               b'"type":"invalid_request_error","param":null,"code":"invalid_api_key"}}'
        await send({
            "type": "websocket.http.response.start", "status": 401,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b'Bearer realm="direct-frontend"')],
        })
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})  # policy violation
