"""The generation responses: the relay's batches written as SSE events or as one JSON body.

A streamed response drains every event already queued from the engine and
writes them in one ``send`` (hypercorn's per-send cost dominates,
docs/stack.md §5); its headers go out with the first output, so a request
that fails before producing anything still gets a proper HTTP error. Every
response is written beside a disconnect watcher: hypercorn drops sends to a
gone client silently, so without it the engine would keep generating. The
watcher is on from the placement: a request waiting for an engine to serve
ends at once when its client leaves.

A request of several choices (``n > 1``, or a completions batch of prompts)
runs them side by side
(:mod:`direct_frontend.pipeline.choices`): its stream interleaves the
choices' chunks as they come, each carrying its index, and ends once, with
one usage chunk and ``[DONE]``; its full body holds every choice. A choice
that gives up after the stream started ends the whole stream with an error
event (the others are cancelled), as OpenAI-compatible servers do and as
the ``openai`` client expects: it raises at the first error event.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from direct_frontend.http.asgi import (
    JSON,
    RESPONSE_DONE,
    Headers,
    Receive,
    Send,
    send_body,
    send_error,
)
from direct_frontend.http.logprobs import ChoiceLogprobs
from direct_frontend.http.render import ChoiceOutput, ChunkRenderer, render_choices
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import OpenAIHTTPError, internal_error
from direct_frontend.openai.parsers.base import ParsedDelta, collect
from direct_frontend.pipeline.admission import served_tier
from direct_frontend.pipeline.choices import Choices
from direct_frontend.pipeline.preprocess import PreparedRequest
from direct_frontend.pipeline.relay import Relay, RelayState
from direct_frontend.pipeline.relay_events import (
    Batch,
    Echo,
    Failed,
    Finished,
    Opened,
    RelayEvent,
    Usage,
)
from direct_frontend.pipeline.settings import Settings

log = logging.getLogger("direct_frontend.http")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


#: what a response runs: a relay, several choices, or (embeddings) the finished vectors
_Run = TypeVar("_Run")


async def respond(
    relay: Relay, settings: Settings, prompts: Sequence[PreparedRequest], receive: Receive,
    send: Send, headers: Headers, trace: RequestTrace | None = None,
) -> int:
    """Place the request and relay it to the client; the HTTP status (499: the client left).

    ``prompts``: the request's one prompt, or a completions batch's, prepared.
    """
    prepared = prompts[0]
    if prepared.request.n == 1 and len(prompts) == 1:
        write = _stream if prepared.request.stream else _complete
        return await _answer(
            relay, functools.partial(relay.begin, settings, prepared, trace),
            functools.partial(write, relay, prepared=prepared, send=send, headers=headers),
            relay.settle, receive, send, headers,
        )
    several = _stream_choices if prepared.request.stream else _complete_choices
    return await _answer(
        relay, functools.partial(Choices.begin, relay, settings, prompts, trace),
        functools.partial(several, relay, send=send, headers=headers),
        lambda choices, ok: choices.settle(relay, ok), receive, send, headers,
    )


async def _answer(
    relay: Relay, begin: Callable[[], Awaitable[_Run]], write: Callable[[_Run], Awaitable[int]],
    settle: Callable[[_Run, bool], None], receive: Receive, send: Send, headers: Headers,
) -> int:
    """Place (``begin``), ``write`` the response beside the disconnect watcher, ``settle``."""
    status = 200
    run: _Run | None = None
    client = _Client()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.watch, receive, nursery.cancel_scope)
        try:
            run = await begin()
        except OpenAIHTTPError as err:
            await send_error(send, err, headers)
            status = err.status
        else:
            status = await write(run)
        nursery.cancel_scope.cancel()
    if client.gone:
        relay.metrics.request_cancelled()
        return 499
    if run is not None:
        settle(run, status == 200)
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


class _Progress:
    """How far a response got: whether its head is out, the bytes not yet written, and the
    failure that ends it (if one does)."""

    __slots__ = ("failed", "out", "started")

    def __init__(self, out: bytes = b"") -> None:
        self.out = bytearray(out)
        self.started = False
        self.failed: OpenAIHTTPError | None = None


def chat_error_tail(err: OpenAIHTTPError) -> bytes:
    """How a started chat or completions stream ends on a failure: an error event, [DONE]."""
    return ChunkRenderer.error(err) + ChunkRenderer.done()


async def _until_end(
    run: Awaitable[None], progress: _Progress, send: Send, headers: Headers,
    error_tail: Callable[[OpenAIHTTPError], bytes] = chat_error_tail,
) -> int:
    """Await ``run``; its failure is an HTTP error before the head, an error event after.

    ``error_tail`` writes that event in the stream's own shape.
    """
    try:
        await run
    except Exception:
        if not progress.started:
            raise  # the app answers it with an OpenAI 500 (and logs it)
        log.exception("unexpected error while streaming")  # the stream ends with an error event
        await _end_with_error(send, progress.out, error_tail(internal_error()))
        return 500
    err = progress.failed
    if err is None:
        return 200
    if not progress.started:
        await send_error(send, err, headers)
        return err.status
    await _end_with_error(send, progress.out, error_tail(err))
    return 200


async def _end_with_error(send: Send, out: bytearray, tail: bytes) -> None:
    out += tail
    await send({"type": "http.response.body", "body": bytes(out), "more_body": False})


async def _start(send: Send, headers: Headers) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *headers]})


class Collected:
    """A full (non-streamed) answer's events: each batch to ``feed``, and how it ended."""

    __slots__ = ("end", "feed", "opened", "progress")

    def __init__(self, feed: Callable[[Batch], object],
                 opened: Callable[[Opened], object] | None = None) -> None:
        self.feed = feed
        self.opened = opened
        self.progress = _Progress()
        self.end: Finished | None = None

    async def emit(self, event: RelayEvent) -> None:
        if type(event) is Batch:
            self.feed(event)
        elif type(event) is Opened:
            if self.opened is not None:
                self.opened(event)
        elif type(event) is Finished:
            self.feed(event.last)
            self.end = event
        elif type(event) is Failed:
            self.progress.failed = event.error

    async def run(self, relay: Relay, state: RelayState, send: Send, headers: Headers) -> int:
        """Run the answer; its HTTP status (the caller writes the body when it is 200)."""
        status = await _until_end(relay.run(state, self.emit), self.progress, send, headers)
        assert status != 200 or self.end is not None
        return status


async def _event_stream(
    relay: Relay, state: RelayState, send: Send, headers: Headers, *,
    opening: Callable[[Opened], bytes], batch: Callable[[Batch], bytes],
    closing: Callable[[Finished], Awaitable[bytes]],
    error_tail: Callable[[OpenAIHTTPError], bytes],
) -> int:
    """A stream of one choice's events (chat's chunks, or the Responses and Messages APIs'
    events): ``opening`` goes out with the head, the events of each ``batch`` as it comes,
    ``closing`` with the last batch, in one write (awaited: the Responses API stores the
    response before its last event says so)."""
    progress = _Progress()
    out = progress.out

    async def emit(event: RelayEvent) -> None:
        if type(event) is Batch:
            out.extend(batch(event))
            if out:
                await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
                out.clear()
        elif type(event) is Opened:
            await _start(send, headers)
            progress.started = True
            out.extend(opening(event))
        elif type(event) is Finished:
            out.extend(batch(event.last))
            out.extend(await closing(event))
            await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
        elif type(event) is Failed:
            progress.failed = event.error

    return await _until_end(relay.run(state, emit), progress, send, headers, error_tail)


async def _stream(relay: Relay, state: RelayState, *, prepared: PreparedRequest, send: Send,
                  headers: Headers) -> int:
    request = prepared.request
    renderer = ChunkRenderer(
        prepared.kind, prepared.request_id, request.model, int(time.time()),
        request.include_usage, service_tier=served_tier(request),
    )
    choice = _Choice(relay, prepared)
    continuous_usage = request.include_usage and request.continuous_usage_stats

    def opening(opened: Opened) -> bytes:
        return renderer.role_chunk() + choice.opened(opened, renderer)

    async def closing(end: Finished) -> bytes:  # the finish chunk, usage and [DONE]
        usage = end.usage
        return (renderer.finish(end.finish_reason, end.stop_reason)
                + renderer.usage(usage.prompt_tokens, usage.completion_tokens,
                                 usage.cached_tokens)
                + renderer.done())

    return await _event_stream(
        relay, state, send, headers, opening=opening,
        batch=functools.partial(choice.chunk, renderer, continuous_usage), closing=closing,
        error_tail=chat_error_tail,
    )


async def _complete(relay: Relay, state: RelayState, *, prepared: PreparedRequest, send: Send,
                    headers: Headers) -> int:
    choice = _Choice(relay, prepared)
    collected = Collected(choice.collect, choice.opened)
    status = await collected.run(relay, state, send, headers)
    end = collected.end
    if end is None:
        return status
    body = render_choices(
        prepared.kind, prepared.request_id, prepared.request.model, int(time.time()),
        [choice.output(end)], end.usage, served_tier(prepared.request),
    )
    await send_body(send, 200, body, JSON, headers)
    return 200


async def _stream_choices(relay: Relay, choices: Choices, *, send: Send, headers: Headers) -> int:
    prepared = choices.prepared
    request = prepared.request
    created = int(time.time())
    renderers = [
        ChunkRenderer(prepared.kind, prepared.request_id, request.model, created,
                      request.include_usage, index, served_tier(request))
        for index in range(len(choices))
    ]
    # Every choice announces its role first (chat), as a lone choice does.
    progress = _Progress(b"".join(renderer.role_chunk() for renderer in renderers))
    out = progress.out
    writing = trio.Lock()  # one write at a time; a waiting writer may find its bytes sent
    ended = False
    outputs = [_Choice(relay, prepared) for _ in renderers]
    finished = 0
    continuous_usage = request.include_usage and request.continuous_usage_stats

    async def emit(index: int, event: RelayEvent) -> None:
        nonlocal ended, finished
        renderer = renderers[index]
        choice = outputs[index]
        if type(event) is Opened:  # its prompt leads it (echo): out with its first batch
            out.extend(choice.opened(event, renderer))
            return
        if type(event) is Failed:
            progress.failed = event.error
            return
        usage = _triple(choices.usage()) if continuous_usage else None
        if type(event) is Batch:
            out.extend(choice.chunk(renderer, False, event, usage))
        elif type(event) is Finished:
            out.extend(choice.chunk(renderer, False, event.last, usage))
            out.extend(renderer.finish(event.finish_reason, event.stop_reason))
            finished += 1
            if finished == len(renderers):  # the last choice: usage and [DONE] go with it
                out.extend(renderer.usage(*_triple(choices.usage())))
                out.extend(renderer.done())
                ended = True
        async with writing:
            if not progress.started:
                await _start(send, headers)
                progress.started = True
            if out:
                body = bytes(out)
                out.clear()
                await send({"type": "http.response.body", "body": body, "more_body": not ended})

    run = choices.run(relay, emit, writing)
    return await _until_end(run, progress, send, headers)


async def _complete_choices(
    relay: Relay, choices: Choices, *, send: Send, headers: Headers
) -> int:
    prepared = choices.prepared
    outputs = [_Choice(relay, prepared) for _ in range(len(choices))]
    ends: list[Finished | None] = [None] * len(choices)
    progress = _Progress()

    async def emit(index: int, event: RelayEvent) -> None:
        choice = outputs[index]
        if type(event) is Batch:
            choice.collect(event)
        elif type(event) is Opened:
            choice.opened(event)
        elif type(event) is Finished:
            choice.collect(event.last)
            ends[index] = event
        elif type(event) is Failed:
            progress.failed = event.error

    status = await _until_end(choices.run(relay, emit), progress, send, headers)
    if status != 200:
        return status
    body = render_choices(
        prepared.kind, prepared.request_id, prepared.request.model, int(time.time()),
        [choice.output(end) for choice, end in zip(outputs, ends, strict=True)],
        choices.usage(), served_tier(prepared.request),
    )
    await send_body(send, 200, body, JSON, headers)
    return 200


def _triple(usage: Usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens


class _Choice:
    """One choice's output as its events bring it: its echo, its logprobs, and (a full
    response) its text or parsed deltas."""

    __slots__ = ("_asked", "_chat", "_tokens", "deltas", "echo", "logprobs", "pieces")

    def __init__(self, relay: Relay, prepared: PreparedRequest) -> None:
        self._asked = prepared.request.logprobs is not None
        self._chat = prepared.kind == "chat"
        self._tokens = relay.text_model.token_bytes
        self.echo: Echo | None = None  # the prompt that leads it (completions ``echo``)
        self.logprobs: ChoiceLogprobs | None = None  # its logprobs, when asked for
        self.pieces: list[str] = []
        self.deltas: list[ParsedDelta] = []

    def opened(self, event: Opened, renderer: ChunkRenderer | None = None) -> bytes:
        """The choice's first output is here; a stream's first chunk: the echoed prompt
        (with its logprobs if asked for), ``b""`` without echo or ``renderer``."""
        echo = self.echo = event.echo
        if self._asked:
            self.logprobs = ChoiceLogprobs(self._chat, self._tokens,
                                           0 if echo is None else len(echo.text))
        if echo is None or renderer is None:
            return b""
        if self.logprobs is None:
            return renderer.text(echo.text)
        return renderer.text_with_logprobs(echo.text, self._prompt_logprobs(echo, self.logprobs))

    def chunk(self, renderer: ChunkRenderer, continuous_usage: bool, batch: Batch,
              usage: tuple[int, int, int] | None = None) -> bytes:
        """The choice's chunk for a batch of output (``b""``: nothing to send).

        Parsed when the choice has a parser; with the batch's logprobs and the
        usage so far (``continuous_usage``, or the given one) when asked for.
        """
        if continuous_usage:
            usage = (batch.prompt_tokens, batch.completion_tokens, batch.cached_tokens)
        logprobs = self.logprobs
        part = (logprobs.batch(batch.logprobs, batch.offsets)
                if logprobs is not None and batch.logprobs else None)
        if batch.parsed is not None:
            return renderer.parsed(batch.parsed, part, usage)
        if part is not None:
            return renderer.text_with_logprobs(batch.text, part, usage)
        if not batch.text:
            return b""
        if usage is not None:
            return renderer.text_with_usage(batch.text, *usage)
        return renderer.text(batch.text)

    def collect(self, batch: Batch) -> None:
        """Keep a batch of a full response: parsed when the choice has a parser, else its
        text; and its logprobs."""
        if batch.parsed is not None:
            self.deltas.append(batch.parsed)
        else:
            self.pieces.append(batch.text)
        logprobs = self.logprobs
        if logprobs is not None and batch.logprobs:
            logprobs.batch(batch.logprobs, batch.offsets)

    def output(self, end: Finished | None) -> ChoiceOutput:
        """The choice in a full response (led by the prompt, and its logprobs, when echoed)."""
        assert end is not None
        pieces, logprobs, echo = self.pieces, self.logprobs, self.echo
        if echo is not None:
            pieces.insert(0, echo.text)
            if logprobs is not None:
                self._prompt_logprobs(echo, logprobs)
        return ChoiceOutput(
            "".join(pieces), end.finish_reason, end.stop_reason,
            None if logprobs is None else logprobs.whole(),
            collect(self.deltas) if end.last.parsed is not None else None,
        )

    @staticmethod
    def _prompt_logprobs(echo: Echo, logprobs: ChoiceLogprobs) -> dict[str, Any]:
        """The echoed prompt's logprobs, from what the engine sent with its first output."""
        return logprobs.prompt(echo.token_ids, echo.logprobs, echo.offsets)
