"""The ASGI application: routes, auth, and the small endpoints (health, readiness, metrics).

A raw ASGI app (no framework) because the relay is the hot path. A model
request goes to its endpoint's handler (:mod:`~direct_frontend.http.endpoints`),
which hands it to the request's stair (:mod:`direct_frontend.pipeline.serve`)
once, while :mod:`~direct_frontend.http.stream` writes its output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from direct_frontend.http import access_log, admin, conversations, files
from direct_frontend.http.admin import denied
from direct_frontend.http.asgi import (
    JSON,
    ClientGone,
    Handler,
    Headers,
    Receive,
    ResponseProgress,
    Scope,
    Send,
    error_shape,
    from_body,
    lifespan,
    log,
    send_body,
    send_error,
)
from direct_frontend.http.background import BackgroundResponses
from direct_frontend.http.batch_runner import BatchRunner
from direct_frontend.http.batches import Batches
from direct_frontend.http.control_view import ControlView
from direct_frontend.http.endpoints import ENDPOINTS, Generation
from direct_frontend.http.files import ApiCall
from direct_frontend.http.identity import caller_of, client_request_id, owner_of
from direct_frontend.http.messages_api import anthropic_page, from_anthropic
from direct_frontend.http.render import (
    render_anthropic_model,
    render_anthropic_models,
    render_model,
    render_models,
)
from direct_frontend.http.stored_routes import StoredRoutes
from direct_frontend.observability.logging import current_request_id, new_request_id
from direct_frontend.observability.metrics import Metrics
from direct_frontend.observability.tracing import Tracing
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    invalid_request,
    method_not_allowed,
    model_not_found,
    unknown_route,
)
from direct_frontend.openai.messages_api import anthropic_error_body
from direct_frontend.openai.response_store import ResponseStore
from direct_frontend.pipeline.ratelimit import RateLimiter
from direct_frontend.pipeline.serve import Stair
from direct_frontend.pipeline.settings import Settings
from direct_frontend.state.batch_store import BatchStore
from direct_frontend.state.shell import Durable

#: ``GET /v1/models/{model}``: the rest of the path is the id (which may hold slashes)
MODEL_PATH = "/v1/models/"

#: Anthropic's Messages API: its errors go out in Anthropic's shape
MESSAGES_PATH = "/v1/messages"


class App:
    """One instance per daemon; holds references to the planes, no per-request state.

    Each request reads the control plane's settings snapshot once, on arrival,
    and keeps it to its end.
    """

    def __init__(
        self,
        control: ControlView,
        metrics: Metrics,
        tracing: Tracing | None = None,
        responses: ResponseStore | None = None,
        durable: Durable | None = None,
        limiter: RateLimiter | None = None,
        metrics_view: Callable[[bytes], Awaitable[bytes]] | None = None,
    ) -> None:
        self.control = control
        #: the tenants' rate limits in this process (their siblings' spending heard by
        #: control/rate_share.py); a request of a limited tenant is admitted against them
        self.limiter = RateLimiter(control.settings.frontend.tenants) if limiter is None \
            else limiter
        self.tracing = tracing  # None: tracing is off, and costs nothing
        #: stored Responses (None: ``[frontend.responses] store = false``, nothing is kept)
        self.responses = responses
        #: the background responses (their nursery runs beside the HTTP server's)
        config = control.settings.frontend.responses
        self.background = None if responses is None else BackgroundResponses(
            responses, metrics, config.max_background_per_owner, config.lease_s)
        #: conversations, in the durable store (None: the server keeps nothing)
        self.conversations = durable
        self.metrics = metrics
        #: every model request's walk (pipeline/serve.py), and the handler that feeds it
        self.stair = Stair(self.limiter, metrics)
        self.generation = Generation(control, self.stair, metrics, tracing, responses, durable,
                                     self.background)
        self.stored = StoredRoutes(responses, self.background, metrics)
        #: files and batches, in the durable store (None: the server keeps nothing), and the
        #: runner of batches (its nursery runs beside the HTTP server's): each line through
        #: its endpoint's own handler (``Generation.serve_line``)
        self.batch_store = None if durable is None else BatchStore(durable)
        self.batch_runner = None if self.batch_store is None else BatchRunner(
            self.batch_store, lambda: self.control.settings.frontend.batches,
            self.generation.serve_line, metrics, config.sweep_interval_s)
        self.batches = Batches(self.batch_runner)
        self.bound_urls: list[str] = []
        #: ``run --workers``: every worker's metrics as one scrape, from this one's text
        self.metrics_view = metrics_view
        self.http_stopped = trio.Event()
        self.started_at = int(time.time())
        self._routes: dict[str, dict[str, Handler]] = {
            **{path: {"POST": partial(self.generation.generate, endpoint)}
               for path, endpoint in ENDPOINTS.items()},
            "/v1/responses/input_tokens": {"POST": self.generation.input_tokens},
            MESSAGES_PATH + "/count_tokens": {"POST": self.generation.count_tokens},
            "/v1/embeddings": {"POST": self.generation.embeddings},
            "/tokenize": {"POST": self.generation.tokenize},
            "/detokenize": {"POST": self.generation.detokenize},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/ready": {"GET": self._ready},
            "/metrics": {"GET": self._metrics},
            "/fleet": {"GET": self._fleet},
            "/fleet/reload": {"POST": self._fleet_reload},
        }

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """The ASGI app: the coroutine that serves ``scope``. A plain function, so that no
        coroutine of ours stands between the server's and the request's for as long as the
        request runs (the server is told this is an ASGI app: daemon.py)."""
        kind = scope["type"]
        if kind == "lifespan":
            return lifespan(receive, send)
        settings = self.control.settings
        if kind == "websocket":
            return admin.websocket(self.control, settings.frontend, scope, receive, send)
        if kind != "http":
            return _ignored()
        path = scope["path"]
        if not (path.startswith(MESSAGES_PATH) or (
                path.startswith("/v1/models") and from_anthropic(scope))):
            return self._http(settings, scope, receive, send)
        return self._anthropic(settings, scope, receive, send)

    async def _anthropic(self, settings: Settings, scope: Scope, receive: Receive,
                         send: Send) -> None:
        """An Anthropic-shaped request: every error of it in Anthropic's shape, 401 included."""
        shape = error_shape.set(anthropic_error_body)
        try:
            await self._http(settings, scope, receive, send)
        finally:
            error_shape.reset(shape)

    async def _http(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        started = time.perf_counter()
        methods, route = self._route(path)
        admin_enabled = settings.frontend.admin.enabled
        if methods is not None and path.startswith("/fleet") and not admin_enabled:
            methods = None  # admin disabled: the routes do not exist
        handler = methods.get(method) if methods else None
        # here, so every answer names it, a refusal's too; a client's own id is answered back
        # and leads ours, which stays unique (the engines' request ids are made from it)
        client_id = client_request_id(scope)
        request_id = new_request_id() if client_id is None else f"{client_id}.{new_request_id()}"
        shown_id = (client_id or request_id).encode()
        access = settings.frontend.access_log
        if handler is None:
            refusal: OpenAIHTTPError | None = (
                method_not_allowed(method, path, tuple(methods))
                if methods else unknown_route(method, path)
            )
            route = route if methods else "other"
        else:
            refusal = denied(settings.frontend, scope)
        if handler is None or refusal is not None:
            assert refusal is not None
            await send_error(send, refusal, [(b"x-request-id", shown_id)])
            self.metrics.request_started()
            self.metrics.request_finished(route, refusal.status, 0.0)
            if access_log.wanted(access, path):
                access_log.write(access, scope, refusal.status, time.perf_counter() - started,
                                 request_id)
            return
        status = 500
        in_flight = path != "/metrics"  # a scrape must not count itself in flight
        if in_flight:
            self.metrics.request_started()
        token = current_request_id.set(request_id)
        progress = ResponseProgress(send, shown_id, replace=client_id is not None)
        receive, send = progress.receiving(receive), progress.send
        try:
            status = await handler(settings, scope, receive, send)
        except Exception:  # a bug: answered and logged here, once, never an empty 500
            log.exception("unexpected error serving %s %s", method, path)
            status = 500
            await progress.fail([(b"x-request-id", shown_id)])
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.request_finished(route, status, elapsed, was_in_flight=in_flight)
            if access_log.wanted(access, path):
                access_log.write(access, scope, status, elapsed, request_id)
            current_request_id.reset(token)

    def _route(self, path: str) -> tuple[dict[str, Handler] | None, str]:
        """The methods of ``path`` (None: no such route), and its metrics label: one per
        route, not per id in it."""
        methods = self._routes.get(path)
        if methods is not None:
            return methods, path
        if path.startswith(MODEL_PATH) and len(path) > len(MODEL_PATH):
            return {"GET": self._model}, MODEL_PATH + "{model}"
        if (stored := self.stored.route(path)) is not None:
            return stored
        if (found := conversations.route(path)) is not None:
            return {verb: partial(self._conversation, call)
                    for verb, call in found[0].items()}, found[1]
        if api := files.route(path) or self.batches.route(path):
            return {verb: partial(self._batch_api, call, api[2])
                    for verb, call in api[0].items()}, api[1]
        return None, path

    async def _fleet(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> int:
        return await admin.respond_fleet(self.control, self.limiter, settings.frontend.tenants,
                                         send)

    async def _fleet_reload(self, settings: Settings, scope: Scope, receive: Receive,
                            send: Send) -> int:
        return await admin.respond_reload(self.control, send)

    # -- small endpoints --------------------------------------------------------------

    async def _models(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> int:
        cards = self.control.models.cards()
        if not from_anthropic(scope):
            await send_body(send, 200, render_models(cards, self.started_at))
            return 200
        try:
            limit, after, before = anthropic_page(scope.get("query_string", b""))
        except OpenAIHTTPError as err:
            await send_error(send, err)
            return err.status
        await send_body(send, 200, render_anthropic_models(cards, self.started_at, limit, after,
                                                           before))
        return 200

    async def _model(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> int:
        """One model, alias or adapter by its id (ids may hold slashes: the rest of the path)."""
        wanted = scope["path"][len(MODEL_PATH):]
        card = next((c for c in self.control.models.cards() if c.id == wanted), None)
        if card is None:
            err = model_not_found(wanted)
            await send_error(send, err)
            return err.status
        render = render_anthropic_model if from_anthropic(scope) else render_model
        await send_body(send, 200, render(card, self.started_at))
        return 200

    async def _health(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> int:
        await send_body(send, 200, b'{"status":"ok"}')
        return 200

    async def _ready(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> int:
        serving, total = self.control.ready()
        waiting = self.control.waiting_for_pools()  # [frontend.kubernetes] wait_for_pods
        ready = bool(serving) and not waiting
        status = 200 if ready else 503
        body = b'{"ready":%s,"serving":%d,"engines":%d,"waiting_for_pools":%s}' % (
            b"true" if ready else b"false", serving, total, json.dumps(waiting).encode(),
        )
        await send_body(send, status, body)
        return status

    async def _metrics(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> int:
        self.control.collect_metrics()
        body, content_type = self.metrics.render()
        if self.metrics_view is not None:
            body = await self.metrics_view(body)
        await send_body(send, 200, body, content_type.encode())
        return 200

    async def _conversation(self, call: conversations.Call, settings: Settings, scope: Scope,
                            receive: Receive, send: Send) -> int:
        """A Conversations API call for the request's owner (http/conversations.py)."""
        owner = owner_of(settings.frontend.auth, scope)

        async def answer(body: bytes, headers: Headers) -> int:
            out = await conversations.answer(call, self.conversations, owner, scope, body)
            await send_body(send, 200, out, JSON, headers)
            return 200

        return await from_body(settings.frontend, receive, send, answer,
                               self.metrics.request_cancelled)

    async def _batch_api(self, call: files.Call, ids: list[str], settings: Settings,
                         scope: Scope, receive: Receive, send: Send) -> int:
        """A Files or Batch API call for the request's owner (http/files.py, batches.py)."""
        request_id = current_request_id.get() or new_request_id()
        headers: Headers = [(b"x-request-id", request_id.encode())]
        if self.batch_store is None:
            err = invalid_request("Files and batches are stored, and this server keeps nothing "
                                  "([frontend.responses] store = false).")
            await send_error(send, err, headers)
            return err.status
        api = ApiCall(self.batch_store, settings.frontend, caller_of(settings.frontend, scope),
                      ids, scope, receive, send, headers)
        try:
            return await files.serve(call, api)
        except ClientGone:
            self.metrics.request_cancelled()
            return 499


async def _ignored() -> None:
    """What a connection of a kind the app does not serve gets: nothing."""
