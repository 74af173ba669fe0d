"""The model endpoints: each one's body, prompt and output shape, in one table, and the
handler that reads a request and hands it to the stair (pipeline/serve.py) once.

An :class:`Endpoint` is what differs between chat completions, completions,
the Responses API and Anthropic's Messages API: how its body is parsed
(a Responses request is read with the history it continues), the kind of
prompt it makes, the renderer its output is written with (http/stream.py's
writer runs it), and whether its errors are Anthropic's. Everything between
is the stair's, the same for all of them. A Responses request with
``background: true`` comes back from the stair prepared and charged, and is
handed to the background runner (http/background.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from functools import partial
from types import TracebackType
from typing import Final, TypeVar

import msgspec
import trio

from direct_frontend.http import conversations
from direct_frontend.http.access_log import MODEL_KEY
from direct_frontend.http.asgi import (
    JSON,
    ClientGone,
    Headers,
    Receive,
    Scope,
    Send,
    encode_json,
    from_body,
    log,
    read_body,
    send_body,
)
from direct_frontend.http.background import BackgroundResponses, follow
from direct_frontend.http.completions import CompletionsRenderer
from direct_frontend.http.control_view import ControlView
from direct_frontend.http.disconnect import disconnect_of
from direct_frontend.http.embeddings import EmbeddingsRenderer
from direct_frontend.http.identity import Caller, caller_of, owner_of
from direct_frontend.http.internal import Answer, Exchange
from direct_frontend.http.messages_api import MessagesRenderer
from direct_frontend.http.render import Kind, render_detokenized, render_tokens
from direct_frontend.http.responses_api import ResponsesRenderer
from direct_frontend.http.stored_responses import find
from direct_frontend.http.stream import Renderer, Writer
from direct_frontend.observability.logging import current_request_id, new_request_id
from direct_frontend.observability.metrics import Metrics
from direct_frontend.observability.tracing import Tracing
from direct_frontend.openai.body import read_json_object
from direct_frontend.openai.conversations import conversation_id_of
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    error_body,
    internal_error,
    invalid_request,
    previous_response_not_found,
)
from direct_frontend.openai.messages_api import parse_messages_request
from direct_frontend.openai.parse import (
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_embedding_request,
    parse_tokenize_request,
)
from direct_frontend.openai.response_store import ResponseStore, StoredResponse, decode_items
from direct_frontend.openai.responses_api import (
    ResponsesRequest,
    parse_responses_request,
    previous_response_id,
)
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.serve import Ask, EmbedAsk, Later, Stair
from direct_frontend.pipeline.serve_events import Prepared
from direct_frontend.pipeline.settings import Settings
from direct_frontend.pipeline.tokenizing import PARSE_INLINE_BYTES, new_holding_limiter
from direct_frontend.state.shell import Durable

_R = TypeVar("_R")


class Parsed(msgspec.Struct, frozen=True):
    """A model endpoint's body, read: the request the stair walks, and what else it said."""

    request: ChatRequest | CompletionRequest
    truncate: bool = False  # Responses: ``truncation: "auto"``
    background: bool = False  # Responses: ``background: true``
    responses: ResponsesRequest | None = None  # a Responses request, whole


class Context(msgspec.Struct, frozen=True):
    """What an endpoint's parse and renderer may use besides the body: the stores and the
    owner of what the request stores and reads."""

    owner: str
    responses: ResponseStore | None
    conversations: Durable | None
    metrics: Metrics
    #: large bodies are parsed in worker threads, one at a time: decoding holds the GIL
    #: throughout (pipeline/tokenizing.py ``new_holding_limiter``)
    parsing: trio.CapacityLimiter


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """One generation endpoint: its body's parse, its prompt's kind, its output's renderer."""

    kind: Kind
    parse: Callable[[Context, bytes], Awaitable[Parsed]]
    #: its renderer, once the request holds its slots (``Prepared``: as its model serves it)
    render: Callable[[Context, Parsed, Prepared | None], Renderer]
    anthropic: bool = False  # its errors and rate-limit headers are Anthropic's


async def responses_request(context: Context, body: bytes) -> ResponsesRequest:
    """A Responses body read with the history it continues, if any: the response it names,
    or the conversation (the owner's: another's is not found)."""
    raw = read_json_object(body)
    previous = previous_response_id(raw)
    conversation = conversation_id_of(raw)
    history: tuple[bytes, ...] = ()
    upto = 0
    if previous is not None:
        history = (await _previous(context, previous)).history()
    elif conversation is not None:
        upto, history = await conversations.history(context.conversations, conversation,
                                                    context.owner)
    request = parse_responses_request(raw, history, decode_items(history), conversation)
    return dataclasses.replace(request, conversation_upto=upto) if upto else request


async def _previous(context: Context, response_id: str) -> StoredResponse:
    """The owner's stored response a Responses request continues; a 400 if none is held."""
    if context.responses is None:
        raise invalid_request(
            "previous_response_id needs a stored response, and this server keeps none "
            "([frontend.responses] store = false): send the whole conversation in 'input'.",
            "previous_response_id",
        )
    record = await find(context.responses, response_id, context.owner)
    if record is None:
        raise previous_response_not_found(response_id)
    if record.running:  # its output is not all there yet
        raise invalid_request(f"Response '{response_id}' is still {record.status}: "
                              "continue it once it has ended.", "previous_response_id")
    return record


async def _off_loop(context: Context, parse: Callable[[bytes], _R], body: bytes) -> _R:
    """``parse(body)``; a large body in a worker thread (≈ 1 ms per MB), off the loop."""
    if len(body) < PARSE_INLINE_BYTES:
        return parse(body)
    return await trio.to_thread.run_sync(parse, body, limiter=context.parsing)


async def _parse_chat(context: Context, body: bytes) -> Parsed:
    return Parsed(await _off_loop(context, parse_chat_request, body))


async def _parse_completion(context: Context, body: bytes) -> Parsed:
    return Parsed(await _off_loop(context, parse_completion_request, body))


async def _parse_messages(context: Context, body: bytes) -> Parsed:
    return Parsed(await _off_loop(context, parse_messages_request, body))


async def _parse_responses(context: Context, body: bytes) -> Parsed:
    request = await responses_request(context, body)
    return Parsed(request.chat, request.truncation == "auto", request.background, request)


def _completions(kind: Kind, context: Context, parsed: Parsed,
                 prepared: Prepared | None) -> Renderer:
    assert prepared is not None
    return CompletionsRenderer(kind, prepared)


def _responses(context: Context, parsed: Parsed, prepared: Prepared | None) -> Renderer:
    assert prepared is not None and parsed.responses is not None
    return ResponsesRenderer(parsed.responses, prepared, context.responses, context.owner)


def _messages(context: Context, parsed: Parsed, prepared: Prepared | None) -> Renderer:
    assert prepared is not None
    return MessagesRenderer(prepared, context.metrics)


#: the generation endpoints by path
ENDPOINTS: Final[dict[str, Endpoint]] = {
    "/v1/chat/completions": Endpoint("chat", _parse_chat, partial(_completions, "chat")),
    "/v1/completions": Endpoint("completion", _parse_completion,
                                partial(_completions, "completion")),
    "/v1/responses": Endpoint("chat", _parse_responses, _responses),
    "/v1/messages": Endpoint("chat", _parse_messages, _messages, anthropic=True),
}


class _Traced:
    """A model's request under its id and trace, with its writer: an ``async with`` block
    around its walk (which runs in the handler's own frame), whose :attr:`status` the walk
    sets. A refusal before the stair (its body, its parse) is answered; whatever ends the
    block, the trace ends and the model's series counts the request, with its status."""

    __slots__ = ("_generation", "_scope", "_token", "request_id", "status", "trace", "writer")

    def __init__(self, generation: Generation, scope: Scope, receive: Receive, send: Send, *,
                 anthropic: bool = False) -> None:
        self._generation = generation
        self._scope = scope
        self.request_id = request_id = current_request_id.get() or new_request_id()  # set on
        self._token = current_request_id.set(request_id)  # arrival; reset when it is over
        tracing = generation.tracing
        self.trace = None if tracing is None else tracing.begin(
            scope["path"], scope["headers"], request_id)
        self.writer = Writer(send, receive, [(b"x-request-id", request_id.encode())],
                             generation.metrics, anthropic=anthropic,
                             disconnect=disconnect_of(scope))
        self.status = 500

    async def __aenter__(self) -> _Traced:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        try:
            if isinstance(exc, OpenAIHTTPError):
                self.status = await self.writer.refuse(exc)
                return True
            if isinstance(exc, ClientGone):
                self._generation.metrics.request_cancelled()
                self.status = 499
                return True
            return False
        finally:
            current_request_id.reset(self._token)
            model = self.writer.model
            if model is not None:
                model.series.request(self.status)
                self._scope[MODEL_KEY] = model.model  # the access log's
            if self.trace is not None:
                self.trace.end(self.status)


class Generation:
    """The model endpoints' handler: one request read, parsed and handed to the stair."""

    def __init__(self, control: ControlView, stair: Stair, metrics: Metrics,
                 tracing: Tracing | None, responses: ResponseStore | None,
                 conversations: Durable | None,
                 background: BackgroundResponses | None) -> None:
        self.control = control
        self.stair = stair
        self.metrics = metrics
        self.tracing = tracing  # None: tracing is off, and costs nothing
        self.responses = responses
        self.conversations = conversations
        self.background = background
        self.parsing = new_holding_limiter()

    def context(self, owner: str) -> Context:
        return Context(owner, self.responses, self.conversations, self.metrics, self.parsing)

    async def generate(self, endpoint: Endpoint, settings: Settings, scope: Scope,
                       receive: Receive, send: Send, caller: Caller | None = None) -> int:
        """One generation request from its body to its last byte; the HTTP status.

        What it stores belongs to ``caller.owner``, and it queues as
        ``caller.tenant`` (by default: the request's credential and headers).
        """
        caller = caller_of(settings.frontend, scope) if caller is None else caller
        context = self.context(caller.owner)
        async with _Traced(self, scope, receive, send, anthropic=endpoint.anthropic) as traced:
            writer = traced.writer
            body = await read_body(receive, settings.frontend.max_body_bytes,
                                   settings.frontend.body_timeout_s)
            parsed = await endpoint.parse(context, body)
            ask = Ask(parsed.request, endpoint.kind, self.control.models, traced.request_id,
                      caller.tenant, scope["headers"], traced.trace, parsed.truncate,
                      parsed.background)
            status, later = await writer.run(partial(endpoint.render, context, parsed),
                                             partial(self.stair.serve, ask))
            if later is not None:
                assert parsed.responses is not None and writer.prepared is not None
                status = await self._background(later, writer.prepared, parsed.responses,
                                                caller, receive, send, writer.headers)
            traced.status = status  # once the request's answer is all out
        return traced.status

    async def embeddings(self, settings: Settings, scope: Scope, receive: Receive,
                         send: Send, caller: Caller | None = None) -> int:
        """One embeddings request; the HTTP status."""
        tenant = (caller_of(settings.frontend, scope) if caller is None else caller).tenant
        async with _Traced(self, scope, receive, send) as traced:
            body = await read_body(receive, settings.frontend.max_body_bytes,
                                   settings.frontend.body_timeout_s)
            request = parse_embedding_request(body)
            renderer = EmbeddingsRenderer(request)
            ask = EmbedAsk(request, self.control.models, traced.request_id, tenant,
                           scope["headers"], traced.trace)
            status, _ = await traced.writer.run(lambda _: renderer,
                                                partial(self.stair.embed, ask))
            traced.status = status
        return traced.status

    async def serve_line(self, path: str, body: bytes, caller: Caller) -> Answer:
        """One batch line through its endpoint's own handler, in this process
        (http/internal.py), as ``caller`` (its rate limits, its share of the admission
        queue): answered byte for byte as a client of that endpoint is. Never raises but its
        cancellation (an unexpected error is the 500 a client would get)."""
        exchange = Exchange(body)
        scope = exchange.scope(path)
        request_id = new_request_id()
        token = current_request_id.set(request_id)
        settings = self.control.settings
        try:
            if path == "/v1/embeddings":  # else a generation endpoint (openai/batch_lines.py)
                status = await self.embeddings(settings, scope, exchange.receive, exchange.send,
                                               caller)
            else:
                status = await self.generate(ENDPOINTS[path], settings, scope,
                                             exchange.receive, exchange.send, caller)
        except Exception:
            log.exception("unexpected error serving a batch line to %s", path)
            return Answer(500, error_body(internal_error()), request_id)
        finally:
            current_request_id.reset(token)
        return Answer(exchange.status or status, exchange.body, request_id,
                      exchange.retry_after_s)

    # -- a model's tokenizer, with no engine ---------------------------------------------

    async def count_tokens(self, settings: Settings, scope: Scope, receive: Receive,
                           send: Send) -> int:
        """Anthropic's ``count_tokens``: the prompt a Messages request would send, counted."""
        async def answer(body: bytes, headers: Headers) -> int:
            count = await self.stair.prompt_tokens(
                self.control.models, parse_messages_request(body, counting=True))
            await send_body(send, 200, b'{"input_tokens":%d}' % count, JSON, headers)
            return 200

        return await from_body(settings.frontend, receive, send, answer,
                               self.metrics.request_cancelled)

    async def input_tokens(self, settings: Settings, scope: Scope, receive: Receive,
                           send: Send) -> int:
        """OpenAI's ``/v1/responses/input_tokens``: a Responses request's prompt, counted."""
        context = self.context(owner_of(settings.frontend.auth, scope))

        async def answer(body: bytes, headers: Headers) -> int:
            chat = (await responses_request(context, body)).chat
            count = await self.stair.prompt_tokens(self.control.models, chat)
            await send_body(send, 200, b'{"object":"response.input_tokens","input_tokens":%d}'
                            % count, JSON, headers)
            return 200

        return await from_body(settings.frontend, receive, send, answer,
                               self.metrics.request_cancelled)

    async def tokenize(self, settings: Settings, scope: Scope, receive: Receive,
                       send: Send) -> int:
        """``POST /tokenize``: the prompt's token ids (and their strings when asked), and the
        model's context length, as vLLM's server answers (the same template and tools a
        generation request's prompt is made with)."""
        async def answer(body: bytes, headers: Headers) -> int:
            tokens = await self.stair.tokenize(self.control.models, parse_tokenize_request(body))
            await send_body(send, 200, render_tokens(tokens.ids, tokens.context_length,
                                                     tokens.strings), JSON, headers)
            return 200

        return await from_body(settings.frontend, receive, send, answer,
                               self.metrics.request_cancelled)

    async def detokenize(self, settings: Settings, scope: Scope, receive: Receive,
                         send: Send) -> int:
        """``POST /detokenize``: the text of the token ids, as vLLM's server answers."""
        async def answer(body: bytes, headers: Headers) -> int:
            text = self.stair.detokenize(self.control.models, parse_detokenize_request(body))
            await send_body(send, 200, render_detokenized(text), JSON, headers)
            return 200

        return await from_body(settings.frontend, receive, send, answer,
                               self.metrics.request_cancelled)

    async def _background(self, later: Later, prepared: Prepared, request: ResponsesRequest,
                          caller: Caller, receive: Receive, send: Send,
                          headers: Headers) -> int:
        """Start a ``background: true`` response; its queued object, or its events."""
        background = self.background  # None exactly when the server keeps no responses
        if background is None:
            raise invalid_request(
                "A background response is kept to be polled, and this server keeps none "
                "([frontend.responses] store = false).", "background",
            )
        response_id = background.store.new_id()
        queued = await background.start(later, prepared, request, response_id, caller)
        if not request.chat.stream:
            await send_body(send, 200, encode_json(queued), JSON, headers)
            return 200
        return await follow(background, response_id, caller.owner, -1, receive, send, headers)
