"""The ASGI application: OpenAI endpoints, health, readiness and metrics.

A raw ASGI app (no framework) because the relay is the hot path: each
streamed response drains every event already queued from the engine and
writes them in one ``send`` (hypercorn's per-send cost dominates, docs/stack.md §5).
Every engine call runs beside a disconnect watcher: hypercorn drops sends to a
gone client silently, so without it the engine would keep generating.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

from direct_frontend.control.supervisor import Supervisor
from direct_frontend.engines.neutral import Finished, GenerateCall, TokenDelta
from direct_frontend.errors import EngineError, ErrorKind, NoEngineAvailable
from direct_frontend.fleet.schema import FrontendConfig
from direct_frontend.http.admin import (
    ControlView,
    credential_ok,
    events_socket,
    unauthorized,
)
from direct_frontend.http.render import ChunkRenderer, Usage, render_full, render_models
from direct_frontend.observability.logging import current_request_id, new_request_id
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    engine_timeout,
    error_body,
    from_engine_error,
    internal_error,
    method_not_allowed,
    model_not_found,
    no_engine_available,
    rate_limited,
    request_too_large,
    unknown_route,
)
from direct_frontend.openai.parse import (
    parse_chat_request,
    parse_completion_request,
)
from direct_frontend.openai.types import (
    ChatRequest,
    CompletionRequest,
)
from direct_frontend.pipeline.admission import Admission, Rejected, admission_config
from direct_frontend.pipeline.dispatch import Dispatcher, EngineCall
from direct_frontend.pipeline.failover import (
    Decision,
    FailoverConfig,
    FailoverState,
    continuation,
)
from direct_frontend.pipeline.postprocess import OutputProcessor, OutputStep
from direct_frontend.pipeline.preprocess import (
    Kind,
    PreparedRequest,
    build_call,
    prepare,
    token_budget,
)
from direct_frontend.routing.hitrate import HitRateMonitor
from direct_frontend.routing.policies import Placement
from direct_frontend.text.model_dir import TextModel

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("direct_frontend.http")

JSON = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


#: what the app's ``receive`` gives instead of the ``http.disconnect`` hypercorn
#: sends once the response is complete (see :func:`_hide_recycle_disconnect`)
RESPONSE_DONE = "direct_frontend.response_done"


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


class App:
    """One instance per daemon; holds references to the planes, no per-request state."""

    def __init__(
        self,
        frontend: FrontendConfig,
        text_model: TextModel,
        supervisor: Supervisor,
        dispatcher: Dispatcher,
        metrics: Metrics,
        control: ControlView | None = None,
    ) -> None:
        self.frontend = frontend  # replaced whole when a reload changes [frontend]
        self.control = control  # the admin endpoints' view of the control plane
        self.text_model = text_model
        self.supervisor = supervisor
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.failover = FailoverConfig.from_fleet(frontend.faults)
        self.admission = Admission(admission_config(frontend.limits))
        self.hit_rate = HitRateMonitor()
        self._divergence_logged_at = -math.inf
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
            await _lifespan(receive, send)
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
        receive, send = _hide_recycle_disconnect(receive, send)
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

    def record_kv_prediction(self, predicted: int, reported: int) -> None:
        """The hit-rate check: predicted vs engine-reported cached tokens, loud when they drift."""
        self.metrics.kv_predicted_cached_tokens_total.inc(predicted)
        self.metrics.kv_reported_cached_tokens_total.inc(reported)
        divergence = self.hit_rate.record(predicted, reported)
        self.metrics.kv_prediction_diverged.set(1 if divergence else 0)
        now = time.monotonic()
        if divergence is not None and now - self._divergence_logged_at > 60:
            self._divergence_logged_at = now
            log.warning("%s", divergence.message, extra={
                "predicted_tokens": divergence.predicted, "reported_tokens": divergence.actual,
            })

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
        try:
            try:
                body = await read_body(receive, self.frontend.max_body_bytes)
                request: ChatRequest | CompletionRequest = (
                    parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
                )
                if request.model != self.frontend.served_model_name:
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
                async with self.admission.slot():
                    return await self._dispatch(prepared, headers, receive, send)
            except Rejected as rejected:
                refusal = rate_limited(
                    f"The frontend is saturated: {rejected.reason}.", retry_after=1
                )
                await send_error(send, refusal, headers)
                return refusal.status
        finally:
            current_request_id.reset(token)

    async def _dispatch(
        self, prepared: PreparedRequest, headers: list[tuple[bytes, bytes]],
        receive: Receive, send: Send,
    ) -> int:
        """Choose an engine for an admitted request and relay its output."""
        request = prepared.request
        try:
            try:
                placement = self.dispatcher.choose(prepared.input_ids, request.max_tokens or 0)
            except NoEngineAvailable:
                raise no_engine_available(request.model) from None
            if placement.spilled:
                self.metrics.kv_load_guard_spills_total.inc()
            max_tokens = token_budget(
                prepared, placement.engine, self.frontend.max_tokens_default
            )
        except OpenAIHTTPError as err:
            await send_error(send, err, headers)
            return err.status
        # Engine-side stop strings are not used: we stop all engine kinds the same way.
        # A non-streaming request without stop strings lets the engine send one message.
        engine_streams = request.stream or bool(request.stop)
        call = build_call(prepared, max_tokens, stream=engine_streams)
        relay = Relay(self, prepared, placement, call, headers, max_tokens)
        return await relay.run(receive, send)


class Relay:
    """One request from engine events to the client, streaming or not.

    The relay owns the request's output state (detokenizer, stop strings,
    tokens produced), so when an engine fails it can retry the request on
    another engine before the first token, or migrate it after: continue on
    another engine from the tokens already produced. The client sees one
    unbroken stream. Streaming headers are sent with the first output, so a
    request that fails before producing anything still gets a proper HTTP error.
    """

    def __init__(
        self,
        app: App,
        prepared: PreparedRequest,
        placement: Placement,
        call: GenerateCall,
        headers: list[tuple[bytes, bytes]],
        max_tokens: int,
    ) -> None:
        self.app = app
        self.prepared = prepared
        self.request = prepared.request
        self.placement = placement  # the first one's predictions are checked (kv_aware)
        self.call = call
        self.original_call = call  # every continuation starts from the client's own prompt
        self.headers = headers
        eos = () if self.request.ignore_eos else app.text_model.eos_token_ids
        self.processor = OutputProcessor(
            app.text_model.new_detokenizer(skip_special_tokens=self.request.skip_special_tokens),
            self.request.stop,
            max_tokens,
            stop_token_ids=(*eos, *self.request.stop_token_ids),
        )
        self.failover = FailoverState(app.failover)
        self.cached_tokens: int | None = None
        self.final: OutputStep | None = None
        self.started = time.perf_counter()
        # the engine-side time allowed for the whole request ([frontend] request_timeout_s)
        self.deadline = trio.current_time() + app.frontend.request_timeout_s
        self.timed_out = False
        self.last_emit = 0.0
        self.disconnected = False
        self.response_started = False
        self.pending_error: EngineError | None = None
        self.moving = False  # asked to move off a draining engine
        self.awaiting_engine = False

    async def run(self, receive: Receive, send: Send) -> int:
        status = 200
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
            if self.request.stream:
                status = await self._stream(send)
            else:
                status = await self._complete(send)
            nursery.cancel_scope.cancel()
        if self.disconnected:
            self.app.metrics.request_cancelled()
            return 499
        self.app.metrics.add_tokens(len(self.prepared.input_ids), self.processor.completion_tokens)
        if status == 200:
            self.app.dispatcher.complete(
                self.placement, self.prepared.input_ids + self.processor.generated_ids
            )
        predicted = self.placement.predicted_cached_tokens
        if status == 200 and predicted is not None and not self.failover.tried:
            self.app.record_kv_prediction(predicted, self.cached_tokens or 0)
        return status

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while (kind := (await receive())["type"]) != "http.disconnect":
            if kind == RESPONSE_DONE:
                return  # nothing left to watch: ending here is cheaper than being cancelled
        self.disconnected = True
        scope.cancel()

    # -- engine side ------------------------------------------------------------------

    def _note_cached(self, event: TokenDelta | Finished) -> None:
        if self.cached_tokens is None or not self.failover.migrations:
            # The original prompt's cache hits; a continuation's prompt is not the client's.
            self.cached_tokens = event.cached_tokens

    def _take(self, token_ids: list[int], pieces: list[str]) -> bool:
        """Feed merged token ids to the output processor; True once the output is finished."""
        step = self.processor.on_tokens(token_ids)
        if step.text:
            pieces.append(step.text)
        if step.finished:
            self.final = step
        return step.finished

    def _finish(self, event: Finished, pieces: list[str]) -> None:
        if event.token_ids and self._take(list(event.token_ids), pieces):
            return
        step = self.processor.on_finish(
            event.reason, event.matched_token_id, event.matched_stop_str
        )
        if step.text:
            pieces.append(step.text)
        self.final = step

    async def _next_batch(
        self, engine_call: EngineCall, stall: trio.CancelScope
    ) -> tuple[str, int, bool]:
        """Wait for the next event, then take every event already queued.

        Consecutive token deltas are merged into one call of the output
        processor (the per-call cost dominates at high token rates). Returns the
        new text, how many tokens it covers, and whether the output is finished.
        ``stall`` fires if the engine stays silent past the stall timeout.
        """
        receiver = engine_call.events
        if self.pending_error is not None:
            error, self.pending_error = self.pending_error, None
            raise error
        stall.deadline = min(
            trio.current_time() + self.app.failover.stall_timeout_s, self.deadline
        )
        self.awaiting_engine = True
        try:
            event: TokenDelta | Finished | None = await receiver.receive()
        finally:
            self.awaiting_engine = False
        stall.deadline = math.inf
        before = self.processor.completion_tokens
        pieces: list[str] = []
        tokens: list[int] = []
        while event is not None:
            self._note_cached(event)
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
            else:
                if tokens and self._take(tokens, pieces):
                    tokens = []
                    break
                tokens = []
                self._finish(event, pieces)
                break
            try:
                event = receiver.receive_nowait()
            except EngineError as error:  # surfaces after the tokens before it are taken
                self.pending_error = error
                break
        if tokens:
            self._take(tokens, pieces)
        finished = self.final is not None
        return "".join(pieces), self.processor.completion_tokens - before, finished

    def _move_off(self, stall: trio.CancelScope) -> None:
        """A planned migration: leave this engine at the next safe point.

        Only a wait on the engine is interrupted, never a write to the client
        (a write cut short would corrupt the response).
        """
        self.moving = True
        if self.awaiting_engine:
            stall.cancel()

    def _engine_ends_by_itself(self, engine_call: EngineCall) -> bool:
        """Whether the engine stops on its own where the output stopped (no Abort needed)."""
        final = self.final
        if final is None:
            return False
        if final.finish_reason == "length":
            return True  # the engine's budget ends at the same token
        stop = final.stop_reason
        return isinstance(stop, int) and (
            stop in engine_call.engine.info.eos_token_ids or stop in self.request.stop_token_ids
        )

    async def _generate(self, emit: Callable[[str, int, bool], Awaitable[None]]) -> None:
        """Drive the request to its end across engines; ``emit`` gets each batch of output."""
        dispatcher = self.app.dispatcher
        while True:
            engine = self.placement.engine
            try:
                async with dispatcher.run(
                    self.placement, self.call, exclude=self.failover.tried
                ) as engine_call:  # on a decode engine: its prefill leg first (P/D)
                    movers = engine.load.movers
                    with trio.CancelScope() as stall:
                        move = functools.partial(self._move_off, stall)
                        movers.add(move)
                        try:
                            while not self.moving:
                                text, tokens, finished = await self._next_batch(engine_call, stall)
                                self._observe(tokens)
                                if finished:
                                    engine_call.ends_by_itself = self._engine_ends_by_itself(
                                        engine_call
                                    )
                                    self.app.metrics.engine_request(engine.name, "ok")
                                # the final bytes go out before any Abort of the engine call
                                await emit(text, tokens, finished)
                                if finished:
                                    return
                        finally:
                            movers.discard(move)
                    if self.moving:
                        self.moving = False
                        raise EngineError(ErrorKind.DRAINING, "the engine is draining",
                                          engine=engine.name)
                    if trio.current_time() >= self.deadline:
                        self.timed_out = True  # the whole request's time is up: no retry
                        raise EngineError(ErrorKind.CANCELLED, "request_timeout_s passed",
                                          engine=engine.name)
                    raise EngineError(
                        ErrorKind.TIMEOUT, "the stream stalled", engine=engine.name
                    )
            except EngineError as error:
                self.pending_error = None
                self.app.metrics.engine_error(engine.name, error.kind)
                self._next_attempt(error)
                await trio.sleep(self.failover.backoff())

    def _next_attempt(self, error: EngineError) -> None:
        """Pick the engine and call for the next attempt, or re-raise ``error``."""
        engine = self.placement.engine
        error.engine = error.engine or engine.name
        produced = self.processor.generated_ids
        decision = self.failover.decide(error, len(produced))
        if decision is Decision.GIVE_UP:
            raise error
        try:
            placement = self.app.dispatcher.choose(
                self.prepared.input_ids, self.processor.remaining_tokens, self.failover.tried
            )
        except NoEngineAvailable:
            raise error from None
        attempt = self.failover.retries + self.failover.migrations
        call = continuation(self.original_call, produced, attempt)
        to = placement.engine
        limit = to.context_length
        if limit is not None and len(call.input_ids) + call.sampling.max_tokens > limit:
            raise EngineError(
                error.kind, f"{error.message}; cannot resume on {to.name}: context too short",
                engine=error.engine,
            ) from None
        outcome = "retried" if decision is Decision.RETRY else "migrated"
        self.app.metrics.engine_request(engine.name, outcome)
        if error.kind is ErrorKind.DRAINING:
            log.info(
                "moved a stream off draining engine %s to %s after %d tokens",
                error.engine, to.name, len(produced),
                extra={"engine": error.engine, "to_engine": to.name},
            )
        else:
            log.warning(
                "engine %s failed (%s); %s on %s after %d tokens",
                error.engine, error, outcome, to.name, len(produced),
                extra={"engine": error.engine, "to_engine": to.name},
            )
        self.placement = placement
        self.call = call

    def _observe(self, tokens: int) -> None:
        now = time.perf_counter()
        metrics = self.app.metrics
        if self.last_emit == 0.0:
            metrics.observe_ttft(now - self.started)
        elif tokens:
            metrics.observe_inter_token(now - self.last_emit, tokens)
        self.last_emit = now

    def _error_for(self, error: EngineError) -> OpenAIHTTPError:
        if self.timed_out:
            return engine_timeout(
                f"The request did not finish within {self.app.frontend.request_timeout_s:g} s."
            )
        if self.failover.all_overloaded:
            return rate_limited("Every engine is saturated; retry later.", retry_after=1)
        return from_engine_error(error)

    # -- client side ------------------------------------------------------------------

    async def _stream(self, send: Send) -> int:
        renderer = ChunkRenderer(
            self.prepared.kind, self.prepared.request_id, self.request.model,
            int(time.time()), self.request.include_usage,
        )
        out = bytearray()

        async def start() -> None:
            await send({
                "type": "http.response.start", "status": 200,
                "headers": [*SSE_HEADERS, *self.headers],
            })
            self.response_started = True
            out.extend(renderer.role_chunk())

        async def emit(text: str, tokens: int, finished: bool) -> None:
            if not self.response_started:
                await start()
            if text:
                out.extend(renderer.text(text))
            if finished:  # the last text, the finish chunk, usage and [DONE]: one write
                final = self.final
                assert final is not None
                out.extend(renderer.finish(final.finish_reason or "stop", final.stop_reason))
                out.extend(renderer.usage(
                    len(self.prepared.input_ids), self.processor.completion_tokens,
                    self.cached_tokens or 0,
                ))
                out.extend(renderer.done())
                await send({"type": "http.response.body", "body": bytes(out),
                            "more_body": False})
            elif out:
                await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
                out.clear()

        try:
            await self._generate(emit)
        except EngineError as exc:
            log.warning("request failed on engine %s: %s", exc.engine, exc)
            if not self.response_started:
                err = self._error_for(exc)
                await send_error(send, err, self.headers)
                return err.status
            out += renderer.error(self._error_for(exc))
            out += renderer.done()
            await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
            return 200
        return 200

    async def _complete(self, send: Send) -> int:
        pieces: list[str] = []

        async def emit(text: str, tokens: int, finished: bool) -> None:
            pieces.append(text)

        try:
            await self._generate(emit)
        except EngineError as exc:
            log.warning("request failed on engine %s: %s", exc.engine, exc)
            err = self._error_for(exc)
            await send_error(send, err, self.headers)
            return err.status
        final = self.final
        assert final is not None
        usage = Usage(
            len(self.prepared.input_ids), self.processor.completion_tokens,
            self.cached_tokens or 0,
        )
        body = render_full(
            self.prepared.kind, self.prepared.request_id, self.request.model, int(time.time()),
            "".join(pieces), final.finish_reason or "stop", final.stop_reason, usage,
        )
        await send_body(send, 200, body, JSON, self.headers)
        return 200


# -- ASGI helpers -----------------------------------------------------------------------


def _hide_recycle_disconnect(receive: Receive, send: Send) -> tuple[Receive, Send]:
    """Keep the ``http.disconnect`` hypercorn sends *during* our last ``send`` from the app.

    Hypercorn recycles (or, shutting down, closes) the connection inside the
    final body ``send`` and tells the app ``http.disconnect`` as part of it.
    A disconnect watcher woken by that would count a finished response as
    abandoned, and cancel the rest of hypercorn's work in our task: the
    connection would then stay open until the shutdown grace period ends.
    After the last body a disconnect is not the client leaving, so it is
    never delivered as one: it comes as a ``RESPONSE_DONE`` message, on
    which the watcher simply ends.
    """
    finished = False

    async def tracked_send(message: Message) -> None:
        nonlocal finished
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished = True  # before the send: the disconnect arrives inside it
        await send(message)

    async def tracked_receive() -> Message:
        message = await receive()
        if finished and message["type"] == "http.disconnect":
            return {"type": RESPONSE_DONE}
        return message

    return tracked_receive, tracked_send


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, or a 413 past ``limit`` (counted as it arrives)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise request_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send, err: OpenAIHTTPError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send_body(send, err.status, error_body(err), JSON, [*err.headers, *(headers or [])])


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


__all__ = ["App", "internal_error"]
