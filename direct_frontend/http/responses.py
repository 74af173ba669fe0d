"""The generation responses: the relay's batches written as SSE events or as one JSON body.

A streamed response drains every event already queued from the engine and
writes them in one ``send`` (hypercorn's per-send cost dominates,
docs/stack.md §5); its headers go out with the first output, so a request
that fails before producing anything still gets a proper HTTP error. Every
response is written beside a disconnect watcher: hypercorn drops sends to a
gone client silently, so without it the engine would keep generating. The
watcher is on from the placement: a request waiting for an engine to serve
ends at once when its client leaves.
"""

from __future__ import annotations

import logging
import time

import trio

from direct_frontend.errors import EngineError
from direct_frontend.http.asgi import (
    JSON,
    RESPONSE_DONE,
    Headers,
    Receive,
    Send,
    send_body,
    send_error,
)
from direct_frontend.http.render import ChunkRenderer, Usage, render_full
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import OpenAIHTTPError, internal_error
from direct_frontend.pipeline.preprocess import PreparedRequest
from direct_frontend.pipeline.relay import Relay, RelayState
from direct_frontend.pipeline.settings import Settings

log = logging.getLogger("direct_frontend.http")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


async def respond(
    relay: Relay, settings: Settings, prepared: PreparedRequest, receive: Receive, send: Send,
    headers: Headers, trace: RequestTrace | None = None,
) -> int:
    """Place the request and relay it to the client; the HTTP status (499: the client left)."""
    status = 200
    state: RelayState | None = None
    client = _Client()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.watch, receive, nursery.cancel_scope)
        try:
            state = await relay.begin(settings, prepared, trace)
        except OpenAIHTTPError as err:
            await send_error(send, err, headers)
            status = err.status
        else:
            if state.request.stream:
                status = await _stream(relay, state, send, headers)
            else:
                status = await _complete(relay, state, send, headers)
        nursery.cancel_scope.cancel()
    if client.gone:
        relay.metrics.request_cancelled()
        return 499
    if state is not None:
        relay.settle(state, ok=status == 200)
    return status


class _Client:
    __slots__ = ("gone",)

    def __init__(self) -> None:
        self.gone = False

    async def watch(self, receive: Receive, scope: trio.CancelScope) -> None:
        """Cancel the response if the client disconnects before it is complete."""
        while (kind := (await receive())["type"]) != "http.disconnect":
            if kind == RESPONSE_DONE:
                return  # nothing left to watch: ending here is cheaper than being cancelled
        self.gone = True
        scope.cancel()


async def _stream(relay: Relay, state: RelayState, send: Send, headers: Headers) -> int:
    prepared = state.prepared
    renderer = ChunkRenderer(
        prepared.kind, prepared.request_id, state.request.model,
        int(time.time()), state.request.include_usage,
    )
    out = bytearray()
    started = False
    continuous_usage = state.request.include_usage and state.request.continuous_usage_stats

    async def emit(text: str, tokens: int, finished: bool) -> None:
        nonlocal started
        if not started:
            await send({
                "type": "http.response.start", "status": 200,
                "headers": [*SSE_HEADERS, *headers],
            })
            started = True
            out.extend(renderer.role_chunk())
        if text and continuous_usage:
            out.extend(renderer.text_with_usage(
                text, len(prepared.input_ids), state.processor.completion_tokens,
                state.cached_tokens or 0,
            ))
        elif text:
            out.extend(renderer.text(text))
        if finished:  # the last text, the finish chunk, usage and [DONE]: one write
            final = state.final
            assert final is not None
            out.extend(renderer.finish(final.finish_reason or "stop", final.stop_reason))
            out.extend(renderer.usage(
                len(prepared.input_ids), state.processor.completion_tokens,
                state.cached_tokens or 0,
            ))
            out.extend(renderer.done())
            await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
        elif out:
            await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
            out.clear()

    try:
        await relay.run(state, emit)
    except EngineError as exc:
        log.warning("request failed on engine %s: %s", exc.engine, exc)
        if not started:
            err = state.error_for(exc)
            await send_error(send, err, headers)
            return err.status
        out += renderer.error(state.error_for(exc))
        out += renderer.done()
        await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
    except Exception:
        if not started:
            raise  # the app answers it with an OpenAI 500 (and logs it)
        log.exception("unexpected error while streaming")  # the stream ends with an error event
        out += renderer.error(internal_error())
        out += renderer.done()
        await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
        return 500
    return 200


async def _complete(relay: Relay, state: RelayState, send: Send, headers: Headers) -> int:
    pieces: list[str] = []

    async def emit(text: str, tokens: int, finished: bool) -> None:
        pieces.append(text)

    try:
        await relay.run(state, emit)
    except EngineError as exc:
        log.warning("request failed on engine %s: %s", exc.engine, exc)
        err = state.error_for(exc)
        await send_error(send, err, headers)
        return err.status
    final = state.final
    assert final is not None
    prepared = state.prepared
    usage = Usage(
        len(prepared.input_ids), state.processor.completion_tokens, state.cached_tokens or 0
    )
    body = render_full(
        prepared.kind, prepared.request_id, state.request.model, int(time.time()),
        "".join(pieces), final.finish_reason or "stop", final.stop_reason, usage,
    )
    await send_body(send, 200, body, JSON, headers)
    return 200
