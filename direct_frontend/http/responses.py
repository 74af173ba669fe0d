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
from collections.abc import Sequence
from typing import Any

import trio

from direct_frontend.engines.neutral import TokenLogprob
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
from direct_frontend.http.logprobs import ChoiceLogprobs, prompt_offsets
from direct_frontend.http.render import ChunkRenderer, Usage, render_full
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import OpenAIHTTPError, internal_error
from direct_frontend.openai.types import CompletionRequest
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
    echo = _echo(relay, state)
    choice_logprobs = _logprobs(relay, state, echo)

    async def emit(
        text: str, tokens: int, finished: bool, logprobs: Sequence[TokenLogprob]
    ) -> None:
        nonlocal started
        if not started:
            await send({
                "type": "http.response.start", "status": 200,
                "headers": [*SSE_HEADERS, *headers],
            })
            started = True
            out.extend(renderer.role_chunk())
            if echo is not None:
                out.extend(_echo_chunk(renderer, relay, state, echo, choice_logprobs))
        if choice_logprobs is not None and logprobs:
            out.extend(renderer.text_with_logprobs(text, choice_logprobs.batch(logprobs)))
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
    echo = _echo(relay, state)
    choice_logprobs = _logprobs(relay, state, echo)

    async def emit(
        text: str, tokens: int, finished: bool, logprobs: Sequence[TokenLogprob]
    ) -> None:
        pieces.append(text)
        if choice_logprobs is not None and logprobs:
            choice_logprobs.batch(logprobs)

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
    if echo is not None:
        pieces.insert(0, echo)
        if choice_logprobs is not None:
            _prompt_logprobs(relay, state, choice_logprobs)
    body = render_full(
        prepared.kind, prepared.request_id, state.request.model, int(time.time()),
        "".join(pieces), final.finish_reason or "stop", final.stop_reason, usage,
        None if choice_logprobs is None else choice_logprobs.whole(),
    )
    await send_body(send, 200, body, JSON, headers)
    return 200


def _echo(relay: Relay, state: RelayState) -> str | None:
    """The prompt text a completions ``echo`` leads the choice with (None: no echo)."""
    request = state.request
    if not isinstance(request, CompletionRequest) or not request.echo:
        return None
    if isinstance(request.prompt, str):
        return request.prompt
    return relay.text_model.decode(request.prompt, request.skip_special_tokens)


def _logprobs(relay: Relay, state: RelayState, echo: str | None) -> ChoiceLogprobs | None:
    """The choice's logprobs builder when the request asked for logprobs."""
    if state.request.logprobs is None:
        return None
    return ChoiceLogprobs(
        state.prepared.kind == "chat", relay.text_model.token_bytes,
        state.processor.token_start, len(echo or ""),
    )


def _prompt_logprobs(
    relay: Relay, state: RelayState, logprobs: ChoiceLogprobs
) -> dict[str, Any]:
    """The echoed prompt's logprobs, from what the engine sent with its first output."""
    ids = state.prepared.input_ids
    push = relay.text_model.new_detokenizer(
        skip_special_tokens=state.request.skip_special_tokens
    ).push
    return logprobs.prompt(ids, state.prompt_logprobs, prompt_offsets(push, ids))


def _echo_chunk(
    renderer: ChunkRenderer, relay: Relay, state: RelayState, echo: str,
    logprobs: ChoiceLogprobs | None,
) -> bytes:
    """The first chunk of an echoing stream: the prompt (with its logprobs if asked for)."""
    if logprobs is None:
        return renderer.text(echo)
    return renderer.text_with_logprobs(echo, _prompt_logprobs(relay, state, logprobs))
