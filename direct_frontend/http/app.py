"""The ASGI application: routes, auth, and the small endpoints (health, readiness, metrics).

A raw ASGI app (no framework) because the relay is the hot path. A
generation request is parsed here, then walks the pipeline
(:mod:`direct_frontend.pipeline.relay`) while
:mod:`~direct_frontend.http.responses` writes its output.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Literal

import msgspec
import trio

from direct_frontend.fleet.describe import JsonValue
from direct_frontend.fleet.schema import FrontendConfig
from direct_frontend.http import access_log, conversations, files, rate_limits
from direct_frontend.http.access_log import MODEL_KEY
from direct_frontend.http.admin import credential_ok, denied, events_socket
from direct_frontend.http.asgi import (
    JSON,
    ClientGone,
    Headers,
    Receive,
    ResponseProgress,
    Scope,
    Send,
    error_shape,
    lifespan,
    read_body,
    send_body,
    send_error,
)
from direct_frontend.http.background import BackgroundResponses, follow, follow_cursor
from direct_frontend.http.batch_runner import BatchRunner
from direct_frontend.http.batches import Batches
from direct_frontend.http.control_view import ControlView
from direct_frontend.http.embeddings import respond_embeddings
from direct_frontend.http.files import ApiCall
from direct_frontend.http.identity import (
    Caller,
    caller_of,
    client_request_id,
    named_in_body,
    owner_of,
)
from direct_frontend.http.internal import Answer, Exchange
from direct_frontend.http.messages_api import anthropic_page, from_anthropic, respond_messages
from direct_frontend.http.render import (
    render_anthropic_model,
    render_anthropic_models,
    render_model,
    render_models,
)
from direct_frontend.http.responses import respond
from direct_frontend.http.responses_api import respond_responses
from direct_frontend.http.stored_responses import (
    CANCEL,
    INPUT_ITEMS,
    RESPONSE_PATH,
    find,
    respond_cancel,
    respond_delete,
    respond_input_items,
    respond_retrieve,
)
from direct_frontend.http.tokenize import respond_detokenize, respond_tokenize
from direct_frontend.observability.logging import current_request_id, new_request_id
from direct_frontend.observability.metrics import Metrics
from direct_frontend.observability.tracing import RequestTrace, Tracing
from direct_frontend.openai.conversations import conversation_id_of
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    error_body,
    internal_error,
    invalid_request,
    method_not_allowed,
    model_not_found,
    previous_response_not_found,
    response_not_found,
    unknown_route,
)
from direct_frontend.openai.messages_api import anthropic_error_body, parse_messages_request
from direct_frontend.openai.parse import (
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_embedding_request,
    parse_tokenize_request,
    read_json_object,
)
from direct_frontend.openai.response_store import ResponseStore, StoredResponse, decode_items
from direct_frontend.openai.responses_api import (
    ResponsesRequest,
    parse_responses_request,
    previous_response_id,
)
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.admission import Rejected, saturated, served_tier
from direct_frontend.pipeline.models import ServedModel
from direct_frontend.pipeline.preprocess import (
    Kind,
    PreparedRequest,
    chat_prompt_ids,
    prepare_each,
    truncated_to_fit,
)
from direct_frontend.pipeline.ratelimit import Charge, RateLimiter
from direct_frontend.pipeline.relay import Relay
from direct_frontend.pipeline.settings import Settings
from direct_frontend.pipeline.tokenizing import PARSE_INLINE_BYTES, new_tokenize_limiter
from direct_frontend.routing.affinity import routing_key
from direct_frontend.state.batch_store import BatchStore
from direct_frontend.state.shell import Durable

log = logging.getLogger("direct_frontend.http")

_encode = msgspec.json.Encoder().encode

#: ``GET /v1/models/{model}``: the rest of the path is the id (which may hold slashes)
MODEL_PATH = "/v1/models/"

#: Anthropic's Messages API: its errors go out in Anthropic's shape
MESSAGES_PATH = "/v1/messages"

#: an endpoint: the request's settings snapshot and its ASGI triple in, the HTTP status out
Handler = Callable[[Settings, Scope, Receive, Send], Awaitable[int]]

#: the generation endpoints a batch line may name, and the walk each takes
LINE_KINDS: dict[str, Kind | Literal["responses"]] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completion",
    "/v1/responses": "responses",
}


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
        if responses is not None:
            responses.conversations = durable
        #: files and batches, in the durable store (None: the server keeps nothing), and the
        #: runner of batches (its nursery runs beside the HTTP server's)
        self.batch_store = None if durable is None else BatchStore(durable)
        self.batch_runner = None if self.batch_store is None else BatchRunner(
            self.batch_store, lambda: self.control.settings.frontend.batches, self.serve_line,
            metrics, config.sweep_interval_s)
        self.batches = Batches(self.batch_runner)
        self.metrics = metrics
        self.bound_urls: list[str] = []
        #: ``run --workers``: every worker's metrics as one scrape, from this one's text
        self.metrics_view: Callable[[bytes], Awaitable[bytes]] | None = None
        self.http_stopped = trio.Event()
        #: large bodies are parsed in worker threads, one per core at a time (more would only
        #: queue the event loop behind them for the GIL)
        self.parsing = new_tokenize_limiter()
        self.started_at = int(time.time())
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": partial(self._generate, "chat")},
            "/v1/completions": {"POST": partial(self._generate, "completion")},
            "/v1/responses": {"POST": partial(self._generate, "responses")},
            "/v1/responses/input_tokens": {"POST": self._input_tokens},
            MESSAGES_PATH: {"POST": partial(self._generate, "messages")},
            MESSAGES_PATH + "/count_tokens": {"POST": self._count_tokens},
            "/v1/embeddings": {"POST": self._embeddings},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
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
        settings = self.control.settings
        if scope["type"] == "websocket":
            await self._websocket(settings.frontend, scope, receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if not (path.startswith(MESSAGES_PATH) or (
                path.startswith("/v1/models") and from_anthropic(scope))):
            await self._http(settings, scope, receive, send)
            return
        shape = error_shape.set(anthropic_error_body)  # every error of it, 401 included
        try:
            await self._http(settings, scope, receive, send)
        finally:
            error_shape.reset(shape)

    async def _http(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        started = time.perf_counter()
        methods = self._routes.get(path)
        route = path  # the metrics' label: one per route, not per model id
        if methods is None and path.startswith(MODEL_PATH) and len(path) > len(MODEL_PATH):
            methods, route = {"GET": self._model}, MODEL_PATH + "{model}"
        elif methods is None and path.startswith(RESPONSE_PATH) and len(path) > len(
                RESPONSE_PATH):
            if path.endswith(INPUT_ITEMS) and len(path) > len(RESPONSE_PATH + INPUT_ITEMS):
                methods, route = {"GET": self._input_items}, RESPONSE_PATH + "{id}" + INPUT_ITEMS
            elif path.endswith(CANCEL) and len(path) > len(RESPONSE_PATH + CANCEL):
                methods, route = {"POST": self._cancel}, RESPONSE_PATH + "{id}" + CANCEL
            else:
                methods = {"GET": self._retrieve, "DELETE": self._delete}
                route = RESPONSE_PATH + "{id}"
        elif methods is None and (found := conversations.route(path)) is not None:
            methods = {verb: partial(self._conversation, call) for verb, call in found[0].items()}
            route = found[1]
        elif methods is None and (api := files.route(path) or self.batches.route(path)):
            methods = {verb: partial(self._batch_api, call, api[2])
                       for verb, call in api[0].items()}
            route = api[1]
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

    # -- admin -------------------------------------------------------------------------

    async def _fleet(self, settings: Settings, scope: Scope, receive: Receive, send: Send) -> int:
        status = self.control.status()
        status["rate_limits"] = self._rate_limits(settings)
        body = json.dumps(status, separators=(",", ":")).encode()
        await send_body(send, 200, body)
        return 200

    async def _fleet_reload(
        self, settings: Settings, scope: Scope, receive: Receive, send: Send
    ) -> int:
        result = await self.control.reload("api")
        status = 200 if result.get("ok") else 422
        await send_body(send, status, json.dumps(result, separators=(",", ":")).encode())
        return status

    async def _websocket(
        self, frontend: FrontendConfig, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if scope["path"] != "/fleet/events" or not frontend.admin.enabled:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        token = frontend.admin.token
        authorized = token is None or credential_ok(scope, (token,))
        await events_socket(self.control, scope, receive, send, authorized)

    def _rate_limits(self, settings: Settings) -> dict[str, JsonValue]:
        """``/fleet``'s view of the rate limits: buckets held, and each named tenant's limits
        as this process sees them now (what its siblings spent included, as far as heard)."""
        limiter = self.limiter
        limiter.configure(settings.frontend.tenants)
        now = trio.current_time()
        named: dict[str, JsonValue] = {
            label: rate_limits.windows_json(limiter.standing(flow, now))
            for flow, label in limiter.table.named().items()}
        return {"buckets": len(limiter), "heard": limiter.heard_count, "tenants": named}

    def _limit(self, settings: Settings, tenant: str, prompt_tokens: int, headers: Headers,
               *, anthropic: bool = False) -> Charge | None:
        """Admit a request of ``tenant`` against its rate limits (http/rate_limits.py)."""
        return rate_limits.limit(self.limiter, settings.frontend.tenants, tenant, prompt_tokens,
                                 headers, anthropic=anthropic, refused=self.metrics.rate_limited)

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

    # -- stored responses ------------------------------------------------------------

    async def _retrieve(self, settings: Settings, scope: Scope, receive: Receive,
                        send: Send) -> int:
        query = scope.get("query_string", b"")

        async def answer(store: ResponseStore, response_id: str, owner: str, send: Send,
                         headers: Headers) -> int:
            after = follow_cursor(query)  # None: a snapshot, not its events
            if after is None:
                return await respond_retrieve(store, response_id, owner, send, headers)
            assert self.background is not None  # there is a store, so it runs
            return await follow(self.background, response_id, owner, after, receive, send,
                                headers)

        return await self._stored(settings, scope, receive, send, answer)

    async def _cancel(self, settings: Settings, scope: Scope, receive: Receive,
                      send: Send) -> int:
        return await self._stored(settings, scope, receive, send, respond_cancel, CANCEL)

    async def _delete(self, settings: Settings, scope: Scope, receive: Receive,
                      send: Send) -> int:
        return await self._stored(settings, scope, receive, send, respond_delete)

    async def _input_items(self, settings: Settings, scope: Scope, receive: Receive,
                           send: Send) -> int:
        query = scope.get("query_string", b"")

        async def answer(store: ResponseStore, response_id: str, owner: str, send: Send,
                         headers: Headers) -> int:
            return await respond_input_items(store, response_id, owner, query, send, headers)

        return await self._stored(settings, scope, receive, send, answer, INPUT_ITEMS)

    async def _stored(
        self, settings: Settings, scope: Scope, receive: Receive, send: Send,
        answer: Callable[[ResponseStore, str, str, Send, Headers], Awaitable[int]],
        suffix: str = "",
    ) -> int:
        """A stored response's endpoint; its id is the path between the prefix and ``suffix``.

        Answered for the request's owner only (http/identity.py).
        """
        path: str = scope["path"]
        response_id = path[len(RESPONSE_PATH):len(path) - len(suffix)]
        owner = owner_of(settings.frontend.auth, scope)

        async def held(body: bytes, headers: Headers) -> int:
            if self.responses is None:
                raise response_not_found(response_id)
            return await answer(self.responses, response_id, owner, send, headers)

        return await self._from_body(settings, receive, send, held)

    async def _conversation(self, call: conversations.Call, settings: Settings, scope: Scope,
                            receive: Receive, send: Send) -> int:
        """A Conversations API call for the request's owner (http/conversations.py)."""
        owner = owner_of(settings.frontend.auth, scope)

        async def answer(body: bytes, headers: Headers) -> int:
            out = await conversations.answer(call, self.conversations, owner, scope, body)
            await send_body(send, 200, out, JSON, headers)
            return 200

        return await self._from_body(settings, receive, send, answer)

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

    async def serve_line(self, path: str, body: bytes, caller: Caller) -> Answer:
        """One batch line through its endpoint's own handler, in this process (http/internal.py),
        as ``caller`` (its rate limits, its share of the admission queue). Never raises but
        its cancellation (an unexpected error is the 500 a client would get)."""
        exchange = Exchange(body)
        scope = exchange.scope(path)
        request_id = new_request_id()
        token = current_request_id.set(request_id)
        settings = self.control.settings
        try:
            if path == "/v1/embeddings":
                status = await self._embed(settings, scope, exchange.receive, exchange.send,
                                           caller.tenant)
            else:
                kind = LINE_KINDS[path]

                async def walk(request_id: str, trace: RequestTrace | None,
                               found: list[ServedModel]) -> int:
                    return await self._walk(kind, settings, exchange.receive, exchange.send,
                                            request_id, trace, found, (), caller)

                status = await self._traced(scope, walk)
        except Exception:
            log.exception("unexpected error serving a batch line to %s", path)
            return Answer(500, error_body(internal_error()), request_id)
        finally:
            current_request_id.reset(token)
        return Answer(exchange.status or status, exchange.body, request_id,
                      exchange.retry_after_s)

    async def _responses_request(self, body: bytes, owner: str) -> ResponsesRequest:
        """A Responses body read with the history it continues, if any: the response it
        names, or the conversation (``owner``'s: another's is not found)."""
        raw = read_json_object(body)
        previous = previous_response_id(raw)
        conversation = conversation_id_of(raw)
        history: tuple[bytes, ...] = ()
        upto = 0
        if previous is not None:
            history = (await self._previous(previous, owner)).history()
        elif conversation is not None:
            upto, history = await conversations.history(self.conversations, conversation, owner)
        request = parse_responses_request(raw, history, decode_items(history), conversation)
        return dataclasses.replace(request, conversation_upto=upto) if upto else request

    async def _previous(self, response_id: str, owner: str) -> StoredResponse:
        """``owner``'s stored response a Responses request continues; a 400 if none is held."""
        if self.responses is None:
            raise invalid_request(
                "previous_response_id needs a stored response, and this server keeps none "
                "([frontend.responses] store = false): send the whole conversation in 'input'.",
                "previous_response_id",
            )
        record = await find(self.responses, response_id, owner)
        if record is None:
            raise previous_response_not_found(response_id)
        if record.running:  # its output is not all there yet
            raise invalid_request(f"Response '{response_id}' is still {record.status}: "
                                  "continue it once it has ended.", "previous_response_id")
        return record


    async def _count_tokens(self, settings: Settings, scope: Scope, receive: Receive,
                            send: Send) -> int:
        """Anthropic's ``count_tokens``: the prompt a Messages request would send, counted."""
        async def answer(body: bytes, headers: Headers) -> int:
            count = await self._prompt_tokens(parse_messages_request(body, counting=True))
            await send_body(send, 200, b'{"input_tokens":%d}' % count, JSON, headers)
            return 200

        return await self._from_body(settings, receive, send, answer)

    async def _input_tokens(self, settings: Settings, scope: Scope, receive: Receive,
                            send: Send) -> int:
        """OpenAI's ``/v1/responses/input_tokens``: a Responses request's prompt, counted."""
        owner = owner_of(settings.frontend.auth, scope)

        async def answer(body: bytes, headers: Headers) -> int:
            count = await self._prompt_tokens((await self._responses_request(body, owner)).chat)
            await send_body(send, 200, b'{"object":"response.input_tokens","input_tokens":%d}'
                            % count, JSON, headers)
            return 200

        return await self._from_body(settings, receive, send, answer)

    async def _prompt_tokens(self, chat: ChatRequest) -> int:
        """The tokens of the prompt ``chat`` would send its model (no engine asked)."""
        served = self._model_of(chat.model)
        prepared = served.prepare_request(chat)
        assert isinstance(prepared, ChatRequest)
        _, ids = await chat_prompt_ids(prepared, served.tokenizing)
        return len(ids)

    async def _tokenize(self, settings: Settings, scope: Scope, receive: Receive,
                        send: Send) -> int:
        async def answer(body: bytes, headers: Headers) -> int:
            request = parse_tokenize_request(body)
            return await respond_tokenize(self._model_of(request.model), request, send, headers)

        return await self._from_body(settings, receive, send, answer)

    async def _detokenize(self, settings: Settings, scope: Scope, receive: Receive,
                          send: Send) -> int:
        async def answer(body: bytes, headers: Headers) -> int:
            request = parse_detokenize_request(body)
            return await respond_detokenize(self._model_of(request.model), request, send,
                                            headers)

        return await self._from_body(settings, receive, send, answer)

    async def _background(self, relay: Relay, settings: Settings, prepared: PreparedRequest,
                          request: ResponsesRequest, caller: Caller, receive: Receive, send: Send,
                          headers: Headers) -> int:
        """Start a ``background: true`` response; its queued object, or its events."""
        background = self.background  # None exactly when the server keeps no responses
        if background is None:
            raise invalid_request(
                "A background response is kept to be polled, and this server keeps none "
                "([frontend.responses] store = false).", "background",
            )
        response_id = background.store.new_id()
        queued = await background.start(relay, settings, prepared, request, response_id, caller)
        if not request.chat.stream:
            await send_body(send, 200, _encode(queued), JSON, headers)
            return 200
        return await follow(background, response_id, caller.owner, -1, receive, send, headers)

    def _model_of(self, model: str) -> ServedModel:
        served = self.control.models.get(model)
        if served is None:
            raise model_not_found(model)
        return served

    async def _from_body(
        self, settings: Settings, receive: Receive, send: Send,
        answer: Callable[[bytes, Headers], Awaitable[int]],
    ) -> int:
        """Read the body and ``answer`` it; a refusal on the way is its HTTP error."""
        request_id = current_request_id.get() or new_request_id()
        headers: Headers = [(b"x-request-id", request_id.encode())]
        frontend = settings.frontend
        try:
            body = await read_body(receive, frontend.max_body_bytes, frontend.body_timeout_s)
            return await answer(body, headers)
        except OpenAIHTTPError as err:
            await send_error(send, err, headers)
            return err.status
        except ClientGone:
            self.metrics.request_cancelled()
            return 499
        except Rejected as rejected:  # the admission queue's (embeddings)
            refusal = saturated(rejected)
            await send_error(send, refusal, headers)
            return refusal.status

    async def _embeddings(
        self, settings: Settings, scope: Scope, receive: Receive, send: Send
    ) -> int:
        tenant = caller_of(settings.frontend, scope).tenant
        return await self._embed(settings, scope, receive, send, tenant)

    async def _embed(self, settings: Settings, scope: Scope, receive: Receive, send: Send,
                     tenant: str) -> int:
        """An embeddings request, queued as ``tenant``."""
        async def walk(request_id: str, trace: RequestTrace | None,
                       found: list[ServedModel]) -> int:
            async def answer(body: bytes, headers: Headers) -> int:
                request = parse_embedding_request(body)
                if trace is not None:
                    trace.model(request.model)
                served = self._model_of(request.model)
                found.append(served)
                key = routing_key(served.settings.frontend.routing.session_key,
                                  scope["headers"], request.user)
                named = named_in_body(settings.frontend.tenants, tenant, request.user)
                return await respond_embeddings(
                    served, request, request_id, key, named, receive, send, headers, trace,
                    limit=partial(self._limit, settings, named, headers=headers))

            return await self._from_body(settings, receive, send, answer)

        return await self._traced(scope, walk)

    # -- generation (chat, completions, Responses, Messages: the routes bind ``kind``) ----

    async def _generate(
        self, kind: Kind | Literal["responses", "messages"], settings: Settings, scope: Scope,
        receive: Receive, send: Send,
    ) -> int:
        async def walk(request_id: str, trace: RequestTrace | None,
                       found: list[ServedModel]) -> int:
            return await self._walk(
                kind, settings, receive, send, request_id, trace, found, scope["headers"],
                caller_of(settings.frontend, scope),
            )

        return await self._traced(scope, walk)

    async def _traced(
        self, scope: Scope,
        walk: Callable[[str, RequestTrace | None, list[ServedModel]], Awaitable[int]],
    ) -> int:
        """A model's request under its id and trace; ``walk`` puts the model in ``found``.

        The trace ends, and the model's series counts the request, with its status.
        """
        request_id = current_request_id.get() or new_request_id()  # set on arrival
        token = current_request_id.set(request_id)
        tracing = self.tracing
        trace = None if tracing is None else tracing.begin(
            scope["path"], scope["headers"], request_id
        )
        status = 500
        found: list[ServedModel] = []  # the model the request asked for, once resolved
        try:
            status = await walk(request_id, trace, found)
            return status
        finally:
            current_request_id.reset(token)
            if found:
                found[0].series.request(status)
                scope[MODEL_KEY] = found[0].name  # the access log's
            if trace is not None:
                trace.end(status)

    async def _walk(
        self,
        kind: Kind | Literal["responses", "messages"],
        settings: Settings,
        receive: Receive,
        send: Send,
        request_id: str,
        trace: RequestTrace | None,
        found: list[ServedModel],
        headers_in: Iterable[tuple[bytes, bytes]],
        caller: Caller,
    ) -> int:
        """One generation request from its body to its last byte; returns the HTTP status.

        The model it asks for goes into ``found`` as soon as it is known; what
        it stores belongs to ``caller.owner``, and it queues as ``caller.tenant``.
        """
        headers = [(b"x-request-id", request_id.encode())]
        frontend = settings.frontend
        try:
            body = await read_body(receive, frontend.max_body_bytes, frontend.body_timeout_s)
            responses = (await self._responses_request(body, caller.owner) if kind == "responses"
                         else None)
            parse = (parse_messages_request if kind == "messages"
                     else parse_chat_request if kind == "chat" else parse_completion_request)
            request: ChatRequest | CompletionRequest = (
                responses.chat if responses is not None
                else parse(body) if len(body) < PARSE_INLINE_BYTES
                # a large body is read in a worker thread (≈ 8 ms per MB), off the loop
                else await trio.to_thread.run_sync(parse, body, limiter=self.parsing)
            )
            served = self.control.models.get(request.model)
            if served is None:
                raise model_not_found(request.model)
            found.append(served)
            request = served.prepare_request(request)  # the model's sampling defaults
            settings = served.settings  # the model's policy, queue and limits from here on
            caller = dataclasses.replace(caller, tenant=named_in_body(
                settings.frontend.tenants, caller.tenant, request.user,
                request.safety_identifier))
            # the tier it is served at (what its response reports): its tenant's to have
            request = msgspec.structs.replace(request, service_tier=settings.admission.tier(
                caller.tenant, request.service_tier))
            if trace is not None:
                trace.model(request.model)
                trace.enter("preprocess")
            key = routing_key(settings.frontend.routing.session_key, headers_in, request.user,
                              request.prompt_cache_key)
            prompts = await prepare_each("completion" if kind == "completion" else "chat",
                                         request, request_id, served.tokenizing, key)
            prepared = prompts[0]
            limit = served.context_length
            if responses is not None and responses.truncation == "auto" and limit is not None:
                prepared = await truncated_to_fit(prepared, served.tokenizing, limit,
                                                  prepared.request.max_tokens or 1)
                prompts = (prepared,)
            prompt_tokens = sum(len(p.input_ids) for p in prompts)
            if trace is not None:
                trace.leave(prompt_tokens=prompt_tokens)
            # over its tenant's rate limit: refused here, before it queues or reaches an engine
            charge = self._limit(settings, caller.tenant, prompt_tokens, headers,
                                 anthropic=kind == "messages")
            if charge is not None:  # the relay counts each choice's output into it
                prompts = tuple(dataclasses.replace(p, charge=charge) for p in prompts)
                prepared = prompts[0]
            if responses is not None and responses.background:
                assert isinstance(prepared.request, ChatRequest)
                return await self._background(
                    found[0].relay, settings, prepared,
                    dataclasses.replace(responses, chat=prepared.request), caller, receive,
                    send, headers,
                )
        except OpenAIHTTPError as err:
            await send_error(send, err, headers)
            return err.status
        except ClientGone:
            self.metrics.request_cancelled()
            return 499
        if trace is not None:
            trace.enter("admission")
        try:
            # Admitted before an engine is chosen, so a request that waited in the
            # queue is placed on the fleet as it is when it leaves the queue.
            # a slot per choice (n per prompt)
            async with settings.admission.slot(prepared.request.n * len(prompts), caller.tenant,
                                               served_tier(prepared.request)):
                if trace is not None:
                    trace.leave()
                if responses is not None:
                    assert isinstance(prepared.request, ChatRequest)
                    return await respond_responses(
                        found[0].relay, settings, prepared,
                        dataclasses.replace(responses, chat=prepared.request),
                        receive, send, headers, trace, self.responses, caller.owner,
                    )
                if kind == "messages":
                    return await respond_messages(found[0].relay, settings, prepared, receive,
                                                  send, headers, trace)
                return await respond(
                    found[0].relay, settings, prompts, receive, send, headers, trace
                )
        except Rejected as rejected:
            refusal = saturated(rejected)
            await send_error(send, refusal, headers)
            return refusal.status
        finally:
            if charge is not None:  # what it generated, whatever its end
                charge.settle(trio.current_time())
