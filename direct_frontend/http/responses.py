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
from direct_frontend.http.render import (
    ChoiceOutput,
    ChunkRenderer,
    Usage,
    render_choices,
)
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import OpenAIHTTPError, internal_error
from direct_frontend.openai.parsers.base import ParsedDelta, collect
from direct_frontend.openai.types import CompletionRequest
from direct_frontend.pipeline.choices import Choices
from direct_frontend.pipeline.preprocess import PreparedRequest
from direct_frontend.pipeline.relay import Relay, RelayState
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
            functools.partial(write, relay, send=send, headers=headers),
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
    """How far a response got: whether its headers are out, and the bytes not yet written."""

    __slots__ = ("out", "started")

    def __init__(self, out: bytes = b"") -> None:
        self.out = bytearray(out)
        self.started = False


def chat_error_tail(err: OpenAIHTTPError) -> bytes:
    """How a started chat or completions stream ends on a failure: an error event, [DONE]."""
    return ChunkRenderer.error(err) + ChunkRenderer.done()


async def _until_end(
    run: Awaitable[None], error_for: Callable[[EngineError], OpenAIHTTPError],
    progress: _Progress, send: Send, headers: Headers,
    error_tail: Callable[[OpenAIHTTPError], bytes] = chat_error_tail,
) -> int:
    """Await ``run``; a failure is an HTTP error before the headers, an error event after.

    ``error_tail`` writes that event in the stream's own shape.
    """
    try:
        await run
    except EngineError as exc:
        log.warning("request failed on engine %s: %s", exc.engine, exc)
        err = error_for(exc)
        if not progress.started:
            await send_error(send, err, headers)
            return err.status
        await _end_with_error(send, progress.out, error_tail(err))
    except Exception:
        if not progress.started:
            raise  # the app answers it with an OpenAI 500 (and logs it)
        log.exception("unexpected error while streaming")  # the stream ends with an error event
        await _end_with_error(send, progress.out, error_tail(internal_error()))
        return 500
    return 200


async def _end_with_error(send: Send, out: bytearray, tail: bytes) -> None:
    out += tail
    await send({"type": "http.response.body", "body": bytes(out), "more_body": False})


async def _start(send: Send, headers: Headers) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *headers]})


#: a batch of output (text, whether it is the last, its logprobs) as what to write, or do
Batch = Callable[[str, bool, Sequence[TokenLogprob]], Any]


async def _collected(relay: Relay, state: RelayState, feed: Batch, send: Send,
                     headers: Headers) -> int:
    """Run a full (non-streamed) answer, each batch to ``feed``; the caller writes the body."""
    async def emit(text: str, tokens: int, finished: bool,
                   logprobs: Sequence[TokenLogprob]) -> None:
        feed(text, finished, logprobs)

    return await _until_end(relay.run(state, emit), state.error_for, _Progress(), send, headers)


async def _event_stream(
    relay: Relay, state: RelayState, send: Send, headers: Headers, *,
    opening: Callable[[], bytes], batch: Batch, closing: Callable[[], Awaitable[bytes]],
    error_tail: Callable[[OpenAIHTTPError], bytes],
) -> int:
    """A stream of API events (the Responses and Messages APIs'): ``opening`` goes out with
    the head, the events of each ``batch`` as it comes, ``closing`` after the last batch
    (awaited: the Responses API stores the response before its last event says so)."""
    progress = _Progress()
    out = progress.out

    async def emit(text: str, tokens: int, finished: bool,
                   logprobs: Sequence[TokenLogprob]) -> None:
        if not progress.started:
            await _start(send, headers)
            progress.started = True
            out.extend(opening())
        out.extend(batch(text, finished, logprobs))
        if finished:
            out.extend(await closing())
            await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
        elif out:
            await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
            out.clear()

    return await _until_end(relay.run(state, emit), state.error_for, progress, send, headers,
                            error_tail)


async def _stream(relay: Relay, state: RelayState, *, send: Send, headers: Headers) -> int:
    prepared = state.prepared
    renderer = ChunkRenderer(
        prepared.kind, prepared.request_id, state.request.model,
        int(time.time()), state.request.include_usage,
    )
    progress = _Progress()
    out = progress.out
    echo = _echo(relay, state)
    choice_logprobs = _logprobs(relay, state, echo)
    continuous_usage = state.request.include_usage and state.request.continuous_usage_stats

    async def emit(
        text: str, tokens: int, finished: bool, logprobs: Sequence[TokenLogprob]
    ) -> None:
        if not progress.started:
            await _start(send, headers)
            progress.started = True
            out.extend(renderer.role_chunk())
            if echo is not None:
                out.extend(_echo_chunk(renderer, relay, state, echo, choice_logprobs))
        usage = (
            (len(prepared.input_ids), state.processor.completion_tokens, state.cached_tokens or 0)
            if continuous_usage else None
        )
        out.extend(_batch_chunk(renderer, state, text, finished, choice_logprobs, logprobs, usage))
        if finished:  # the last text, the finish chunk, usage and [DONE]: one write
            final = state.final
            assert final is not None
            out.extend(renderer.finish(state.finish_reason, final.stop_reason))
            out.extend(renderer.usage(
                len(prepared.input_ids), state.processor.completion_tokens,
                state.cached_tokens or 0,
            ))
            out.extend(renderer.done())
            await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
        elif out:
            await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
            out.clear()

    return await _until_end(relay.run(state, emit), state.error_for, progress, send, headers)


async def _complete(relay: Relay, state: RelayState, *, send: Send, headers: Headers) -> int:
    pieces: list[str] = []
    deltas: list[ParsedDelta] = []
    echo = _echo(relay, state)
    choice_logprobs = _logprobs(relay, state, echo)

    async def emit(
        text: str, tokens: int, finished: bool, logprobs: Sequence[TokenLogprob]
    ) -> None:
        _collect(state, pieces, deltas, text, finished)
        if choice_logprobs is not None and logprobs:
            choice_logprobs.batch(logprobs)

    status = await _until_end(relay.run(state, emit), state.error_for, _Progress(), send, headers)
    if status != 200:
        return status
    final = state.final
    assert final is not None
    prepared = state.prepared
    usage = Usage(
        len(prepared.input_ids), state.processor.completion_tokens, state.cached_tokens or 0
    )
    body = render_choices(
        prepared.kind, prepared.request_id, state.request.model, int(time.time()),
        [_output(relay, state, pieces, deltas, choice_logprobs, echo)], usage,
    )
    await send_body(send, 200, body, JSON, headers)
    return 200


async def _stream_choices(relay: Relay, choices: Choices, *, send: Send, headers: Headers) -> int:
    prepared = choices.prepared
    request = prepared.request
    created = int(time.time())
    renderers = [
        ChunkRenderer(prepared.kind, prepared.request_id, request.model, created,
                      request.include_usage, index)
        for index in range(len(choices.states))
    ]
    # Every choice announces its role first (chat), as a lone choice does.
    progress = _Progress(b"".join(renderer.role_chunk() for renderer in renderers))
    out = progress.out
    writing = trio.Lock()  # one write at a time; a waiting writer may find its bytes sent
    ended = False
    echoes = [_echo(relay, state) for state in choices.states]  # each its own prompt's
    builders = [_logprobs(relay, state, echo)
                for state, echo in zip(choices.states, echoes, strict=True)]
    echoed = [False] * len(renderers)
    continuous_usage = request.include_usage and request.continuous_usage_stats

    async def emit(
        index: int, text: str, tokens: int, finished: bool, logprobs: Sequence[TokenLogprob]
    ) -> None:
        nonlocal ended
        renderer = renderers[index]
        choice_logprobs = builders[index]
        state = choices.states[index]
        echo = echoes[index]
        if echo is not None and not echoed[index]:
            echoed[index] = True
            out.extend(_echo_chunk(renderer, relay, state, echo, choice_logprobs))
        out.extend(_batch_chunk(
            renderer, state, text, finished, choice_logprobs, logprobs,
            choices.usage() if continuous_usage else None,
        ))
        if finished:
            final = state.final
            assert final is not None
            out.extend(renderer.finish(state.finish_reason, final.stop_reason))
            if choices.finished:  # the last choice: usage and [DONE] go with its finish
                out.extend(renderer.usage(*choices.usage()))
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
    return await _until_end(run, choices.error_for, progress, send, headers)


async def _complete_choices(
    relay: Relay, choices: Choices, *, send: Send, headers: Headers
) -> int:
    pieces: list[list[str]] = [[] for _ in choices.states]
    deltas: list[list[ParsedDelta]] = [[] for _ in choices.states]
    echoes = [_echo(relay, state) for state in choices.states]  # each its own prompt's
    builders = [_logprobs(relay, state, echo)
                for state, echo in zip(choices.states, echoes, strict=True)]

    async def emit(
        index: int, text: str, tokens: int, finished: bool, logprobs: Sequence[TokenLogprob]
    ) -> None:
        _collect(choices.states[index], pieces[index], deltas[index], text, finished)
        choice_logprobs = builders[index]
        if choice_logprobs is not None and logprobs:
            choice_logprobs.batch(logprobs)

    status = await _until_end(choices.run(relay, emit), choices.error_for, _Progress(), send,
                              headers)
    if status != 200:
        return status
    outputs = [
        _output(relay, state, texts, parsed, choice_logprobs, echo)
        for state, texts, parsed, choice_logprobs, echo
        in zip(choices.states, pieces, deltas, builders, echoes, strict=True)
    ]
    prepared = choices.prepared
    body = render_choices(
        prepared.kind, prepared.request_id, prepared.request.model, int(time.time()),
        outputs, Usage(*choices.usage()),
    )
    await send_body(send, 200, body, JSON, headers)
    return 200


def _batch_chunk(
    renderer: ChunkRenderer, state: RelayState, text: str, finished: bool,
    choice_logprobs: ChoiceLogprobs | None, logprobs: Sequence[TokenLogprob],
    usage: tuple[int, int, int] | None,
) -> bytes:
    """One choice's chunk for a batch of output (``b""``: nothing to send).

    Parsed when the choice has a parser; with the batch's logprobs and the
    usage so far (``continuous_usage_stats``) when they were asked for.
    """
    batch = choice_logprobs.batch(logprobs) if choice_logprobs is not None and logprobs else None
    if state.parser is not None:
        return renderer.parsed(state.parse(text, finished), batch, usage)
    if batch is not None:
        return renderer.text_with_logprobs(text, batch, usage)
    if not text:
        return b""
    if usage is not None:
        return renderer.text_with_usage(text, *usage)
    return renderer.text(text)


def _collect(state: RelayState, pieces: list[str], deltas: list[ParsedDelta], text: str,
             finished: bool) -> None:
    """Keep a batch of a full response: parsed when the choice has a parser, else its text."""
    if state.parser is not None:
        deltas.append(state.parse(text, finished))
    else:
        pieces.append(text)


def _output(relay: Relay, state: RelayState, pieces: list[str], deltas: list[ParsedDelta],
            choice_logprobs: ChoiceLogprobs | None, echo: str | None) -> ChoiceOutput:
    """One choice of a full response (led by the prompt, and its logprobs, when echoed)."""
    if echo is not None:
        pieces.insert(0, echo)
        if choice_logprobs is not None:
            _prompt_logprobs(relay, state, choice_logprobs)
    final = state.final
    assert final is not None
    return ChoiceOutput(
        "".join(pieces), state.finish_reason, final.stop_reason,
        None if choice_logprobs is None else choice_logprobs.whole(),
        collect(deltas) if state.parser is not None else None,
    )


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
