"""The admin surface: ``GET /fleet``, ``POST /fleet/reload``, the ``/fleet/events`` WebSocket.

Also the bearer checks both surfaces share. The event broadcast is built so
the control plane never waits for a viewer: every subscriber has a bounded
queue and ``publish`` only ever does ``send_nowait``. A subscriber that falls
behind loses events and is marked; its writer then discards the stale queue
and sends a fresh snapshot carrying the number dropped, so a slow viewer
ends up right, just later.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Sequence

import trio

from direct_frontend.fleet.schema import FrontendConfig, TenantsConfig
from direct_frontend.http import rate_limits
from direct_frontend.http.asgi import Receive, Scope, Send, send_body
from direct_frontend.http.control_view import ControlView, Event, EventFeed
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.pipeline.ratelimit import RateLimiter

log = logging.getLogger("direct_frontend.admin")

LOAD_TICK_S = 1.0  # the events stream reports in-flight and request counts this often


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


def api_key(scope: Scope) -> str | None:
    """The ``x-api-key`` credential of a request (how Anthropic's clients send theirs)."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        if name.lower() == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


def credential_ok(scope: Scope, accepted: Sequence[str], *, api_key_header: bool = False) -> bool:
    """Whether the request's bearer credential is one of ``accepted`` (constant time).

    ``api_key_header``: an ``x-api-key`` header counts too (the API keys, not the admin token).
    """
    given = bearer(scope)
    if given is None and api_key_header:
        given = api_key(scope)
    if given is None:
        return False
    found = False
    for secret in accepted:  # no early exit: timing says nothing about which key matched
        found |= hmac.compare_digest(given.encode(), secret.encode())
    return found


#: vLLM's tokenizer endpoints, outside /v1 as vLLM serves them; the API keys cover them too
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})


def denied(frontend: FrontendConfig, scope: Scope) -> OpenAIHTTPError | None:
    """401 unless the request carries the credential its endpoint needs (if any): an API
    key for the OpenAI endpoints, the admin token for the fleet view and the metrics."""
    path = scope["path"]
    if path.startswith("/v1/") or path in TOKENIZER_PATHS:
        keys = frontend.auth.api_keys
        if keys and not credential_ok(scope, keys, api_key_header=True):
            return unauthorized()
    elif path.startswith("/fleet") or path == "/metrics":
        token = frontend.admin.token
        if token is not None and not credential_ok(scope, (token,)):
            return unauthorized("admin token")
    return None


def unauthorized(what: str = "API key") -> OpenAIHTTPError:
    """401 in OpenAI's shape; the credential given is never echoed."""
    return OpenAIHTTPError(
        401,
        f"Missing or incorrect {what}. Send it as 'Authorization: Bearer <{what.lower()}>'"
        + (" (or as 'x-api-key')." if what == "API key" else "."),
        "invalid_request_error",
        None,
        "invalid_api_key",
        headers=((b"www-authenticate", b'Bearer realm="direct-frontend"'),),
    )


# -- endpoints ----------------------------------------------------------------------------


# -- the endpoints ---------------------------------------------------------------------


async def respond_fleet(control: ControlView, limiter: RateLimiter, tenants: TenantsConfig,
                        send: Send) -> int:
    """``GET /fleet``: engines, the running config, the last reload, the rate limits."""
    status = control.status()
    status["rate_limits"] = rate_limits.view(limiter, tenants, trio.current_time())
    await send_body(send, 200, json.dumps(status, separators=(",", ":")).encode())
    return 200


async def respond_reload(control: ControlView, send: Send) -> int:
    """``POST /fleet/reload``: the reload's result (422 when it was refused)."""
    result = await control.reload("api")
    status = 200 if result.get("ok") else 422
    await send_body(send, status, json.dumps(result, separators=(",", ":")).encode())
    return status


async def websocket(control: ControlView, frontend: FrontendConfig, scope: Scope,
                    receive: Receive, send: Send) -> None:
    """A WebSocket: ``/fleet/events`` when the admin surface is on, else closed (1008)."""
    if scope["path"] != "/fleet/events" or not frontend.admin.enabled:
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008})
        return
    token = frontend.admin.token
    authorized = token is None or credential_ok(scope, (token,))
    await events_socket(control, scope, receive, send, authorized)


def encode(event: Event) -> str:
    return json.dumps(event, separators=(",", ":"))


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
    with control.subscribe() as sub:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_ws_disconnect, receive, nursery.cancel_scope)
            await _write_events(control, sub, send)
            nursery.cancel_scope.cancel()


async def _write_events(control: ControlView, sub: EventFeed, send: Send) -> None:
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
            # each engine's in flight, and its requests so far: they change with no state change
            await emit({"type": "load", "engines": control.loads(),
                        "requests": control.request_counts()})


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
