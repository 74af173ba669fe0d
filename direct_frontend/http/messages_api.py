"""``/v1/messages`` output: a chat choice's parsed deltas as Anthropic content blocks and events.

:class:`MessageBuilder` is sans-IO: each parsed delta becomes the stream's
``content_block_start`` / ``content_block_delta`` / ``content_block_stop``
events, and the blocks it keeps are the non-streaming Message's content, so
both say the same. Blocks follow the model's order (thinking, text, one
``tool_use`` per call); a new kind of output closes the open block. Usage is
Anthropic's: ``input_tokens`` are the prompt tokens the engine did not have
cached, ``cache_read_input_tokens`` the ones it had.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

from direct_frontend.http.asgi import Scope, encode_json, log
from direct_frontend.http.query import query_int
from direct_frontend.http.stream import Renderer, parsed
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.messages_api import anthropic_error_body
from direct_frontend.openai.parsers.base import ParsedDelta
from direct_frontend.pipeline.relay_events import Batch, Finished, Opened, Usage
from direct_frontend.pipeline.serve_events import Prepared

Event = dict[str, Any]


class MessageBuilder:
    """The content blocks and stream events of one Message (one choice)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.blocks: list[dict[str, Any]] = []
        self.malformed_inputs = 0  # tool calls whose arguments were not a JSON object
        self._open: dict[str, Any] | None = None
        self._arguments: dict[int, str] = {}  # a tool_use block's index -> its JSON so far
        self._calls: dict[int, int] = {}  # the parser's call index -> the block's index

    def message(self, stop_reason: str | None, stop_sequence: str | None,
                usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks if stop_reason is not None else [],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @property
    def called(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def feed(self, delta: ParsedDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            index = self._block("thinking", events)
            self.blocks[index]["thinking"] += delta.reasoning
            events.append(_delta(index, {"type": "thinking_delta",
                                         "thinking": delta.reasoning}))
        if delta.content:
            index = self._block("text", events)
            self.blocks[index]["text"] += delta.content
            events.append(_delta(index, {"type": "text_delta", "text": delta.content}))
        for piece in delta.tool_calls:
            index = self._calls.get(piece.index, -1)
            if index < 0 or piece.id is not None:
                index = self._block("tool_use", events, piece.id or f"toolu_{piece.index}",
                                    piece.name or "")
                self._calls[piece.index] = index
            if piece.arguments:
                self._arguments[index] += piece.arguments
                events.append(_delta(index, {"type": "input_json_delta",
                                             "partial_json": piece.arguments}))
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        self._close(events)
        return events

    def _block(self, kind: str, events: list[Event], call_id: str = "", name: str = "") -> int:
        """The open block of ``kind``; a new one (closing the open one) when it is another."""
        block = self._open
        if block is not None and block["type"] == kind and kind != "tool_use":
            return len(self.blocks) - 1
        self._close(events)
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == "text":
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        self.blocks.append(block)
        self._open = block
        index = len(self.blocks) - 1
        if kind == "tool_use":
            self._arguments[index] = ""
        events.append({"type": "content_block_start", "index": index,
                       "content_block": dict(block)})
        return index

    def _close(self, events: list[Event]) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        index = len(self.blocks) - 1
        if block["type"] == "tool_use":
            block["input"] = self._input(self._arguments.pop(index))
        events.append({"type": "content_block_stop", "index": index})

    def _input(self, arguments: str) -> dict[str, Any]:
        """A call's arguments as the object ``input`` must be (``{}`` if they are not one)."""
        if not arguments.strip():
            return {}
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        self.malformed_inputs += 1
        return {}


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _usage(usage: Usage) -> dict[str, int]:
    cached = usage.cached_tokens
    return {"input_tokens": usage.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage.completion_tokens}


def _stop(end: Finished, builder: MessageBuilder) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and the ``stop_sequence`` behind it."""
    if end.finish_reason == "length":
        return "max_tokens", None
    if end.matched_stop is not None:
        return "stop_sequence", end.matched_stop
    return ("tool_use" if builder.called else "end_turn"), None


def _render(events: Sequence[Event]) -> bytes:
    out = bytearray()
    for event in events:
        out += b"event: %b\ndata: %b\n\n" % (event["type"].encode(), encode_json(event))
    return bytes(out)


class MessagesRenderer(Renderer):
    """One Anthropic Message (one chat choice): its events as SSE, or the Message object.

    Tool calls whose arguments were not a JSON object count in ``metrics`` once the
    message ends (their ``input`` is ``{}``)."""

    __slots__ = ("_metrics", "builder", "streamed")

    def __init__(self, prepared: Prepared, metrics: Metrics) -> None:
        self.builder = MessageBuilder("msg_" + prepared.request_id, prepared.request.model)
        self.streamed = prepared.request.stream
        self._metrics = metrics

    def opened(self, event: Opened, index: int) -> bytes:
        if not self.streamed:
            return b""
        message = self.builder.message(None, None, _usage(event.usage))
        return _render([{"type": "message_start", "message": message}])

    def batch(self, event: Batch, index: int) -> bytes:
        events = self.builder.feed(parsed(event))
        return _render(events) if self.streamed else b""

    async def finished(self, event: Finished, index: int) -> tuple[bytes, bool]:
        out = self.batch(event.last, index)
        builder = self.builder
        events = builder.finish()
        self._count_malformed()
        reason, sequence = _stop(event, builder)
        if not self.streamed:
            return encode_json(builder.message(reason, sequence, _usage(event.usage))), True
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": _usage(event.usage)})
        events.append({"type": "message_stop"})
        return out + _render(events), True

    def failed(self, error: OpenAIHTTPError) -> bytes:
        """A started stream ends as Anthropic's do: an ``error`` event."""
        self._count_malformed()
        return b"event: error\ndata: %b\n\n" % anthropic_error_body(error)

    def _count_malformed(self) -> None:
        malformed, self.builder.malformed_inputs = self.builder.malformed_inputs, 0
        if malformed:
            self._metrics.parser_malformed_total.labels("messages_tool_input").inc(malformed)
            log.warning("a tool call's arguments were not a JSON object; its input is {}")


def from_anthropic(scope: Scope) -> bool:
    """Whether the client is an ``anthropic`` SDK (it sends ``anthropic-version``): it gets
    Anthropic's shapes where the two APIs share a path (``/v1/models``)."""
    return any(name == b"anthropic-version" for name, _ in scope["headers"])


def anthropic_page(query: bytes) -> tuple[int, str | None, str | None]:
    """Anthropic's list query: ``limit`` (1–1000, 20 by default), ``after_id``, ``before_id``."""
    fields = parse_qs(query.decode("latin-1"))
    raw = fields.get("limit", ["20"])[-1]
    limit = query_int(raw, 1, 1000)
    if limit is None:
        raise invalid_request(f"limit: Input should be an integer from 1 to 1000, not "
                              f"{raw[:40]!r}", "limit")
    return limit, fields.get("after_id", [None])[-1], fields.get("before_id", [None])[-1]
