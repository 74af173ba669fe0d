"""Response bodies: streamed SSE chunks, full responses and the model list.

Streaming renders one event per engine delta, so :class:`ChunkRenderer`
pre-builds every constant byte of a chunk once per request; a text chunk is
then two concatenations around one msgspec string encode (well under 1 µs).
The shapes are those the official ``openai`` client parses; ``stop_reason``
(the matched stop string or token id) is the vLLM extension, which the
client keeps as an extra field.
"""

from __future__ import annotations

import array
import base64
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal, NamedTuple

import msgspec

from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    error_body,
)
from direct_frontend.openai.parsers.base import ParsedDelta, ParsedMessage
from direct_frontend.pipeline.models import ModelCard
from direct_frontend.pipeline.relay_events import Usage

Kind = Literal["chat", "completion"]

_encode: Final = msgspec.json.Encoder().encode

_DONE: Final = b"data: [DONE]\n\n"
_SSE_END: Final = b"}\n\n"


def _scrub(text: str) -> str:
    """Replace lone surrogates, which JSON (UTF-8) cannot carry."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _response_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def _usage_json(prompt: int, completion: int, cached: int) -> bytes:
    return (
        b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
        b'"prompt_tokens_details":{"cached_tokens":%d}}'
        % (prompt, completion, prompt + completion, cached)
    )


class _Shape(NamedTuple):
    """The bytes of a chunk that depend only on its kind and ``include_usage``: what
    follows a choice's head, and its suffixes (built once, at import)."""

    id_prefix: str
    obj: bytes  # the ``object`` field, JSON-encoded
    text: bytes  # after the choice's head: a text chunk's up to its text
    finish: bytes  # after the choice's head: the finishing chunk's up to its reason
    role: bytes  # after the choice's head: the role chunk's (b"": none)
    #: text, logprobs prefix, logprobs, finish, delta, text before a usage
    suffixes: tuple[bytes, bytes, bytes, bytes, bytes, bytes]


def _shape(kind: Kind, include_usage: bool) -> _Shape:
    tail = b"]" + (b',"usage":null' if include_usage else b"") + _SSE_END
    chat = kind == "chat"
    text_suffix = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null}' + tail
    return _Shape(
        "chatcmpl-" if chat else "cmpl-",
        b'"chat.completion.chunk"' if chat else b'"text_completion"',
        b'"delta":{"content":' if chat else b'"text":',
        b'"delta":{},"logprobs":null,' if chat else b'"text":"","logprobs":null,',
        b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
        + tail if chat else b"",
        (text_suffix, b'},"logprobs":' if chat else b',"logprobs":',
         b',"finish_reason":null}' + tail, b"}" + tail,
         b',"logprobs":null,"finish_reason":null}' + tail,
         text_suffix[: -len(tail)] + b'],"usage":'),
    )


_SHAPES: Final = {(kind, usage): _shape(kind, usage)
                  for kind in ("chat", "completion") for usage in (False, True)}


class ChunkRenderer:
    """Renders the SSE events of one streamed response.

    ``id`` is ``chatcmpl-<request_id>`` or ``cmpl-<request_id>``; ``service_tier``
    is the tier the request is served at, as OpenAI reports it on every chunk. With
    ``include_usage`` every chunk carries ``"usage":null`` and :meth:`usage`
    renders the final usage chunk, as OpenAI does; without it :meth:`usage`
    returns ``b""`` so callers need not branch. A response of several choices
    has one renderer per choice (``index``).
    """

    __slots__ = ("_delta_prefix", "_delta_suffix", "_finish_prefix", "_finish_suffix", "_head",
                 "_include_usage", "_logprobs_prefix", "_logprobs_suffix", "_role",
                 "_text_prefix", "_text_suffix", "_text_suffix_open", "kind")

    def __init__(
        self, kind: Kind, request_id: str, model: str, created: int, include_usage: bool,
        index: int = 0, service_tier: str = "default",
    ) -> None:
        shape = _SHAPES.get((kind, include_usage))
        if shape is None:
            raise ValueError(f"unknown response kind {kind!r}")
        self.kind: Kind = kind
        self._include_usage = include_usage
        self._head = head = (
            b'data: {"id":%b,"object":%b,"created":%d,"model":%b,"service_tier":%b,'
            b'"system_fingerprint":null,"choices":['
            % (_encode(shape.id_prefix + request_id), shape.obj, created, _encode(model),
               _encode(service_tier))
        )
        choice = head + b'{"index":%d,' % index
        self._text_prefix = choice + shape.text
        self._finish_prefix = choice + shape.finish
        self._delta_prefix = choice + b'"delta":'
        self._role = choice + shape.role if shape.role else b""
        (self._text_suffix, self._logprobs_prefix, self._logprobs_suffix, self._finish_suffix,
         self._delta_suffix, self._text_suffix_open) = shape.suffixes

    def text(self, delta: str) -> bytes:
        """One chunk carrying new text (``delta.content`` or ``text``)."""
        try:
            return self._text_prefix + _encode(delta) + self._text_suffix
        except UnicodeEncodeError:  # a lone surrogate; never on the normal path
            return self._text_prefix + _encode(_scrub(delta)) + self._text_suffix

    def text_with_logprobs(
        self, delta: str, logprobs: dict[str, Any], usage: tuple[int, int, int] | None = None
    ) -> bytes:
        """A chunk carrying new text (maybe none) and the logprobs of its tokens.

        ``usage`` (prompt, completion, cached) puts the usage so far on it too
        (``continuous_usage_stats``).
        """
        head = (
            self._text_prefix + _encode(_scrub(delta)) + self._logprobs_prefix + _encode(logprobs)
        )
        if usage is None:
            return head + self._logprobs_suffix
        return head + b',"finish_reason":null}],"usage":' + _usage_json(*usage) + _SSE_END

    def text_with_usage(self, delta: str, prompt: int, completion: int, cached: int) -> bytes:
        """A text chunk carrying the usage so far (vLLM's ``continuous_usage_stats``)."""
        return (
            self._text_prefix + _encode(_scrub(delta)) + self._text_suffix_open
            + _usage_json(prompt, completion, cached) + _SSE_END
        )

    def parsed(
        self, delta: ParsedDelta, logprobs: dict[str, Any] | None = None,
        usage: tuple[int, int, int] | None = None,
    ) -> bytes:
        """A chat chunk of parsed output: content, ``reasoning_content``, ``tool_calls``.

        ``b""`` for an empty delta without logprobs (nothing to send). ``usage``
        (prompt, completion, cached) puts the usage so far on it too
        (``continuous_usage_stats``).
        """
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning_content"] = _scrub(delta.reasoning)
        if delta.content:
            body["content"] = _scrub(delta.content)
        if delta.tool_calls:
            body["tool_calls"] = [piece.to_openai() for piece in delta.tool_calls]
        if logprobs is not None:
            head = self._delta_prefix + _encode(body) + b',"logprobs":' + _encode(logprobs)
        elif not body:
            return b""
        else:
            head = self._delta_prefix + _encode(body) + b',"logprobs":null'
        if usage is None:
            return head + self._logprobs_suffix
        return head + b',"finish_reason":null}],"usage":' + _usage_json(*usage) + _SSE_END

    def role_chunk(self) -> bytes:
        """The first chat chunk, announcing the assistant role; ``b""`` for completions."""
        return self._role

    def finish(self, finish_reason: str, stop_reason: str | int | None) -> bytes:
        """The chunk that ends the choice, with an empty delta."""
        return (
            self._finish_prefix
            + b'"finish_reason":%b,"stop_reason":%b'
            % (_encode(finish_reason), _encode(stop_reason))
            + self._finish_suffix
        )

    def usage(self, prompt: int, completion: int, cached: int = 0) -> bytes:
        """The final chunk with ``choices: []`` and the usage; ``b""`` if not requested."""
        if not self._include_usage:
            return b""
        return self._head + b'],"usage":' + _usage_json(prompt, completion, cached) + _SSE_END

    @staticmethod
    def done() -> bytes:
        """The stream terminator the client waits for."""
        return _DONE

    @staticmethod
    def error(err: OpenAIHTTPError) -> bytes:
        """An error after the stream started (status already sent); the client raises it."""
        return b"data: " + error_body(err) + b"\n\n"


class _PromptDetails(msgspec.Struct):
    cached_tokens: int


class _UsageOut(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: _PromptDetails


class _Message(msgspec.Struct):
    role: str
    content: str | None


class _Function(msgspec.Struct):
    name: str
    arguments: str


class _Call(msgspec.Struct):
    id: str
    type: str
    function: _Function


class _ParsedMessage(msgspec.Struct, omit_defaults=True):
    """A parsed reply: ``reasoning_content`` and ``tool_calls`` only when there are some."""

    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[_Call] = []


def _message(c: ChoiceOutput) -> _Message | _ParsedMessage:
    parsed = c.message
    if parsed is None:
        return _Message("assistant", c.text)
    calls = [_Call(t.id, t.type, _Function(t.function.name, t.function.arguments))
             for t in parsed.tool_calls]
    content = parsed.content if parsed.content or not calls else None
    return _ParsedMessage("assistant", content, parsed.reasoning or None, calls)


class _ChatChoice(msgspec.Struct):
    index: int
    message: _Message | _ParsedMessage
    logprobs: dict[str, Any] | None
    finish_reason: str
    stop_reason: str | int | None


class _TextChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str
    stop_reason: str | int | None


class _Full(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    service_tier: str
    system_fingerprint: None
    choices: list[_ChatChoice] | list[_TextChoice]
    usage: _UsageOut


class ChoiceOutput(msgspec.Struct, frozen=True):
    """One choice of a full response: its text (or parsed message) and why it ended."""

    text: str
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: dict[str, Any] | None = None
    message: ParsedMessage | None = None  # a chat reply that went through a parser


def render_full(
    kind: Kind,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    stop_reason: str | int | None,
    usage: Usage,
    logprobs: dict[str, Any] | None = None,
    service_tier: str = "default",
) -> bytes:
    """The non-streaming ``chat.completion`` or ``text_completion`` body of one choice."""
    return render_choices(
        kind, request_id, model, created,
        [ChoiceOutput(text, finish_reason, stop_reason, logprobs)], usage, service_tier,
    )


def render_choices(
    kind: Kind,
    request_id: str,
    model: str,
    created: int,
    outputs: list[ChoiceOutput],
    usage: Usage,
    service_tier: str = "default",
) -> bytes:
    """The non-streaming body with every choice, ``index`` in the order given, and the
    tier it was served at."""
    choices: list[_ChatChoice] | list[_TextChoice]
    if kind == "chat":
        choices = [
            _ChatChoice(i, _message(c), c.logprobs, c.finish_reason, c.stop_reason)
            for i, c in enumerate(outputs)
        ]
        obj = "chat.completion"
    elif kind == "completion":
        choices = [
            _TextChoice(i, c.text, c.logprobs, c.finish_reason, c.stop_reason)
            for i, c in enumerate(outputs)
        ]
        obj = "text_completion"
    else:
        raise ValueError(f"unknown response kind {kind!r}")
    u = usage
    body = _Full(
        _response_id(kind, request_id),
        obj,
        created,
        model,
        service_tier,
        None,
        choices,
        _UsageOut(
            u.prompt_tokens,
            u.completion_tokens,
            u.prompt_tokens + u.completion_tokens,
            _PromptDetails(u.cached_tokens),
        ),
    )
    try:
        return _encode(body)
    except UnicodeEncodeError:  # a lone surrogate from detokenisation; never normally
        clean = [msgspec.structs.replace(c, text=_scrub(c.text)) for c in outputs]
        if clean == outputs:
            raise
        return render_choices(kind, request_id, model, created, clean, usage, service_tier)


class _Model(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None = None  # the context length, named as vLLM names it
    parent: str | None = None  # an adapter's base model


class _ModelList(msgspec.Struct):
    object: str
    data: list[_Model]


def render_models(cards: Iterable[ModelCard], created: int) -> bytes:
    """The ``GET /v1/models`` body: every model, alias and adapter served."""
    return _encode(_ModelList("list", [_model(c, created) for c in cards]))


def render_model(card: ModelCard, created: int) -> bytes:
    """The ``GET /v1/models/{model}`` body: one entry of the list."""
    return _encode(_model(card, created))


class _AnthropicModel(msgspec.Struct):
    id: str
    display_name: str
    created_at: str  # RFC 3339
    type: str = "model"


class _AnthropicModelList(msgspec.Struct):
    data: list[_AnthropicModel]
    has_more: bool
    first_id: str | None
    last_id: str | None


def render_anthropic_models(cards: Sequence[ModelCard], created: int, limit: int,
                            after: str | None, before: str | None) -> bytes:
    """``GET /v1/models`` for an ``anthropic`` SDK client: Anthropic's page of models.

    ``after``/``before``: the page starts after (ends before) that id; an id
    that is not listed gives an empty page, as a cursor past the end does.
    """
    ids = [c.id for c in cards]
    start, end = 0, len(cards)
    if after is not None:
        start = ids.index(after) + 1 if after in ids else len(cards)
    if before is not None:
        end = ids.index(before) if before in ids else 0
        start = max(start, end - limit)
    page = [_anthropic_model(c, created) for c in cards[start:end][:limit]]
    more = start > 0 if before is not None else start + len(page) < end  # in its direction
    return _encode(_AnthropicModelList(
        page, more, page[0].id if page else None, page[-1].id if page else None,
    ))


def render_anthropic_model(card: ModelCard, created: int) -> bytes:
    return _encode(_anthropic_model(card, created))


def _anthropic_model(card: ModelCard, created: int) -> _AnthropicModel:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return _AnthropicModel(card.id, card.id, stamp)


def _model(card: ModelCard, created: int) -> _Model:
    return _Model(card.id, "model", created, card.owned_by, card.context_length, card.parent)


class _Embedding(msgspec.Struct):
    object: str
    embedding: list[float] | str  # a list of floats, or "base64": little-endian float32 bytes
    index: int


class _EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class _EmbeddingList(msgspec.Struct):
    object: str
    data: list[_Embedding]
    model: str
    usage: _EmbeddingUsage


def render_embeddings(
    model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, base64_floats: bool,
) -> bytes:
    """The ``POST /v1/embeddings`` body: one entry per input, in order."""
    data = [
        _Embedding("embedding", _base64_float32(v) if base64_floats else list(v), i)
        for i, v in enumerate(vectors)
    ]
    return _encode(_EmbeddingList("list", data, model,
                                  _EmbeddingUsage(prompt_tokens, prompt_tokens)))


def _base64_float32(vector: Sequence[float]) -> str:
    """``encoding_format: "base64"``: the vector's float32 values, little-endian, in base64."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


class _Tokens(msgspec.Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str | None] | None


def render_tokens(
    tokens: Sequence[int], max_model_len: int | None, token_strs: Sequence[str | None] | None,
) -> bytes:
    """The ``POST /tokenize`` body, in vLLM's shape."""
    return _encode(_Tokens(len(tokens), max_model_len, list(tokens),
                           None if token_strs is None else list(token_strs)))


class _Detokenized(msgspec.Struct):
    prompt: str


def render_detokenized(prompt: str) -> bytes:
    """The ``POST /detokenize`` body, in vLLM's shape."""
    return _encode(_Detokenized(prompt))
