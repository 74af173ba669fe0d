"""The ASGI application: routes, auth, and the small endpoints (health, readiness, metrics).

A raw ASGI app (no framework) because the relay is the hot path. A
generation request is parsed here, then walks the pipeline
(:mod:`direct_frontend.pipeline.relay`) while
:mod:`~direct_frontend.http.responses` writes its output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import trio

from direct_frontend.control.supervisor import Supervisor
from direct_frontend.fleet.schema import FrontendConfig
from direct_frontend.http.admin import (
    ControlView,
    credential_ok,
    events_socket,
    unauthorized,
)
from direct_frontend.http.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    hide_recycle_disconnect,
    lifespan,
    read_body,
    send_body,
    send_error,
)
from direct_frontend.http.render import render_models
from direct_frontend.http.responses import respond
from direct_frontend.observability.logging import current_request_id, new_request_id
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    method_not_allowed,
    model_not_found,
    rate_limited,
    unknown_route,
)
from direct_frontend.openai.parse import parse_chat_request, parse_completion_request
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.admission import Admission, Rejected, admission_config
from direct_frontend.pipeline.failover import FailoverConfig
from direct_frontend.pipeline.preprocess import Kind, prepare
from direct_frontend.pipeline.relay import Relay
from direct_frontend.text.model_dir import TextModel


class App:
    """One instance per daemon; holds references to the planes, no per-request state."""

    def __init__(
        self,
        frontend: FrontendConfig,
        text_model: TextModel,
        supervisor: Supervisor,
        relay: Relay,
        metrics: Metrics,
        control: ControlView | None = None,
    ) -> None:
        self.frontend = frontend  # replaced whole when a reload changes [frontend]
        self.control = control  # the admin endpoints' view of the control plane
        self.text_model = text_model
        self.supervisor = supervisor
        self.relay = relay
        self.metrics = metrics
        self.failover = FailoverConfig.from_fleet(frontend.faults)
        self.admission = Admission(admission_config(frontend.limits))
        self.bound_urls: list[str] = []
        self.http_stopped = trio.Event()
        self.started_at = int(time.time())
        self._routes: dict[str, dict[str, Callable[[Scope, Receive, Send], Awaitable[int]]]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/ready": {"GET": self._ready},
            "/metrics": {"GET": self._metrics},
            "/fleet": {"GET": self._fleet},
            "/fleet/reload": {"POST": self._fleet_reload},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        started = time.perf_counter()
        methods = self._routes.get(path)
        if methods is not None and path.startswith("/fleet") and not self._admin_enabled:
            methods = None  # admin disabled: the routes do not exist
        handler = methods.get(method) if methods else None
        if handler is not None and (denied := self._denied(scope)) is not None:
            await send_error(send, denied)
            self.metrics.request_started()
            self.metrics.request_finished(path, denied.status, 0.0)
            return
        if handler is None:
            err = (
                method_not_allowed(method, path, tuple(methods))
                if methods else unknown_route(method, path)
            )
            await send_error(send, err)
            self.metrics.request_started()
            self.metrics.request_finished(path if methods else "other", err.status, 0.0)
            return
        status = 500
        self.metrics.request_started()
        receive, send = hide_recycle_disconnect(receive, send)
        try:
            status = await handler(scope, receive, send)
        finally:
            self.metrics.request_finished(path, status, time.perf_counter() - started)

    # -- auth and admin ---------------------------------------------------------------

    @property
    def _admin_enabled(self) -> bool:
        return self.control is not None and self.frontend.admin.enabled

    def _denied(self, scope: Scope) -> OpenAIHTTPError | None:
        """401 unless the request carries the credential its endpoint needs (if any)."""
        path = scope["path"]
        if path.startswith("/v1/"):
            keys = self.frontend.auth.api_keys
            if keys and not credential_ok(scope, keys):
                return unauthorized()
        elif path.startswith("/fleet"):
            token = self.frontend.admin.token
            if token is not None and not credential_ok(scope, (token,)):
                return unauthorized("admin token")
        return None

    def apply_frontend(self, frontend: FrontendConfig) -> None:
        """Switch to a reloaded ``[frontend]``: later requests see the new limits and keys."""
        if frontend.limits != self.frontend.limits:
            # requests admitted under the old limits finish under them
            self.admission = Admission(admission_config(frontend.limits))
        self.failover = FailoverConfig.from_fleet(frontend.faults)
        self.frontend = frontend

    async def _fleet(self, scope: Scope, receive: Receive, send: Send) -> int:
        assert self.control is not None
        body = json.dumps(self.control.status(), separators=(",", ":")).encode()
        await send_body(send, 200, body)
        return 200

    async def _fleet_reload(self, scope: Scope, receive: Receive, send: Send) -> int:
        assert self.control is not None
        result = await self.control.reload("api")
        status = 200 if result.get("ok") else 422
        await send_body(send, status, json.dumps(result, separators=(",", ":")).encode())
        return status

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] != "/fleet/events" or not self._admin_enabled:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        assert self.control is not None
        token = self.frontend.admin.token
        authorized = token is None or credential_ok(scope, (token,))
        await events_socket(self.control, scope, receive, send, authorized)

    # -- small endpoints --------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> int:
        body = render_models([self.frontend.served_model_name], self.started_at)
        await send_body(send, 200, body)
        return 200

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> int:
        await send_body(send, 200, b'{"status":"ok"}')
        return 200

    async def _ready(self, scope: Scope, receive: Receive, send: Send) -> int:
        serving = self.supervisor.serving_count
        total = len(self.supervisor.children)
        status = 200 if serving else 503
        body = b'{"ready":%s,"serving":%d,"engines":%d}' % (
            b"true" if serving else b"false", serving, total,
        )
        await send_body(send, status, body)
        return status

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> int:
        for name, child in self.supervisor.children.items():
            self.metrics.set_engine_state(name, child.state.value)  # type: ignore[arg-type]
            load = child.handle.load.in_flight if child.handle is not None else 0
            self.metrics.set_engine_in_flight(name, load)
        if self.supervisor.kv is not None:
            self.supervisor.kv.export()
        body, content_type = self.metrics.render()
        await send_body(send, 200, body, content_type.encode())
        return 200

    # -- generation --------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate("chat", scope, receive, send)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate("completion", scope, receive, send)

    async def _generate(self, kind: Kind, scope: Scope, receive: Receive, send: Send) -> int:
        request_id = new_request_id()
        token = current_request_id.set(request_id)
        headers = [(b"x-request-id", request_id.encode())]
        frontend, failover, admission = self.frontend, self.failover, self.admission
        try:
            try:
                body = await read_body(receive, frontend.max_body_bytes)
                request: ChatRequest | CompletionRequest = (
                    parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
                )
                if request.model != frontend.served_model_name:
                    raise model_not_found(request.model)
                prepared = await prepare(kind, request, request_id, self.text_model)
            except OpenAIHTTPError as err:
                await send_error(send, err, headers)
                return err.status
            except ClientGone:
                self.metrics.request_cancelled()
                return 499
            try:
                # Admitted before an engine is chosen, so a request that waited in the
                # queue is placed on the fleet as it is when it leaves the queue.
                async with admission.slot():
                    try:
                        state = self.relay.begin(prepared, frontend, failover)
                    except OpenAIHTTPError as err:
                        await send_error(send, err, headers)
                        return err.status
                    return await respond(self.relay, state, receive, send, headers)
            except Rejected as rejected:
                refusal = rate_limited(
                    f"The frontend is saturated: {rejected.reason}.", retry_after=1
                )
                await send_error(send, refusal, headers)
                return refusal.status
        finally:
            current_request_id.reset(token)
