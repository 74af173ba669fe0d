"""``/v1/responses`` output: a chat choice's parsed deltas as Responses items and events.

:class:`ResponseBuilder` is sans-IO: it turns each parsed delta into the
Responses stream's events (``response.output_item.added``, text and argument
deltas, ``...done``) and keeps the output items, so the non-streaming Response
object is the same items the stream announced. Items follow the model's
order: a reasoning item, then a message, then one item per function call; a
new kind of output closes the open item. A response that ends (completed or
incomplete) is kept in the process's store unless the request or the
server says not to (openai/response_store.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from direct_frontend.engines.neutral import TokenLogprob
from direct_frontend.http.asgi import encode_json, log
from direct_frontend.http.logprobs import chat_logprobs
from direct_frontend.http.stored_responses import append_turn
from direct_frontend.http.stored_responses import keep as stored
from direct_frontend.http.stream import Renderer, parsed
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.parsers.base import ParsedDelta
from direct_frontend.openai.response_store import (
    ANONYMOUS,
    ResponseStore,
    StoredResponse,
    new_response_id,
)
from direct_frontend.openai.responses_api import ResponsesRequest, item_id
from direct_frontend.openai.types import ChatRequest, served_tier
from direct_frontend.pipeline.relay_events import Batch, Finished, Opened, Usage
from direct_frontend.pipeline.serve_events import Prepared
from direct_frontend.text.token_bytes import TokenBytes

Event = dict[str, Any]


class ResponseBuilder:
    """The output items and stream events of one response (one choice)."""

    def __init__(self, request: ResponsesRequest, response_id: str, created: int,
                 stored: bool = False, background: bool = False) -> None:
        self.request = request
        self.id = response_id
        self.created = created
        self.stored = stored  # the response will be kept (what its ``store`` says)
        self.background = background
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item deltas go to
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> item

    # -- the Response object --------------------------------------------------------
    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        r = self.request
        chat = r.chat
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": chat.model, "output": self.items, "background": self.background,
            "error": None,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "metadata": {}, "parallel_tool_calls": chat.parallel_tool_calls,
            "temperature": chat.temperature, "top_p": chat.top_p, "tools": r.tools,
            "tool_choice": r.tool_choice, "store": self.stored, "truncation": r.truncation,
            "previous_response_id": r.previous_response_id,
            "conversation": None if r.conversation is None else {"id": r.conversation},
            "text": {"format": {"type": "text"}}, "usage": usage,
            "service_tier": served_tier(chat),
        }

    def record(self, response: bytes, owner: str) -> StoredResponse:
        """What the store keeps of ``owner``'s finished response (``response``: its JSON)."""
        r = self.request
        return StoredResponse(
            self.id, response, tuple(encode_json(item) for item in self.items),
            r.history + tuple(encode_json(item) for item in r.items), owner=owner,
        )

    # -- deltas to events -------------------------------------------------------------
    def feed(self, delta: ParsedDelta, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """The events of one parsed delta; ``logprobs``: its batch's, in chat's entry shape.

        They go with the output text when the delta has some (a batch whose text
        was all reasoning or call arguments shows none).
        """
        events: list[Event] = []
        if delta.reasoning:
            item = self._item("reasoning", events)
            item["content"][0]["text"] += delta.reasoning
            events.append(self._at(item, "response.reasoning_text.delta", content_index=0,
                                   delta=delta.reasoning))
        if delta.content:
            item = self._item("message", events)
            part = item["content"][0]
            part["text"] += delta.content
            part["logprobs"] += logprobs or []
            events.append(self._at(item, "response.output_text.delta", content_index=0,
                                   delta=delta.content, logprobs=logprobs or []))
        for piece in delta.tool_calls:
            call = self._calls.get(piece.index)
            if call is None or piece.id is not None:
                call = self._item("function_call", events, piece.id or item_id("call"),
                                  piece.name or "")
                self._calls[piece.index] = call
            if piece.arguments:
                call["arguments"] += piece.arguments
                events.append(self._at(call, "response.function_call_arguments.delta",
                                       delta=piece.arguments))
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open item; every item gets the response's final status."""
        events: list[Event] = []
        self._close(events)
        for item in self.items:
            item["status"] = status
        return events

    def _at(self, item: dict[str, Any], kind: str, **fields: Any) -> Event:
        return {"type": kind, "item_id": item["id"], "output_index": self.items.index(item),
                **fields}

    def _item(self, kind: str, events: list[Event], call_id: str = "",
              name: str = "") -> dict[str, Any]:
        """The open item of ``kind``; a new one (closing the open one) when it is another."""
        item = self._open
        if item is not None and item["type"] == kind and kind != "function_call":
            return item
        self._close(events)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": item_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        elif kind == "message":
            item = {"type": "message", "id": item_id("msg"), "role": "assistant",
                    "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [],
                                 "logprobs": []}]}
        else:
            item = {"type": "function_call", "id": item_id("fc"), "call_id": call_id,
                    "name": name, "arguments": "", "status": "in_progress"}
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        shown = {**item, "content": []} if kind != "function_call" else dict(item)
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": shown})
        if kind != "function_call":  # the part as it starts (its own logprobs list: the
            # item's fills as the text comes, and this event may go out after that)
            part = {**item["content"][0], "text": ""}
            if kind == "message":
                part["logprobs"] = []
            events.append(self._at(item, "response.content_part.added", content_index=0,
                                   part=part))
        return item

    def _close(self, events: list[Event]) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        kind = item["type"]
        if kind == "function_call":
            events.append(self._at(item, "response.function_call_arguments.done",
                                   name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = ("response.reasoning_text.done" if kind == "reasoning"
                    else "response.output_text.done")
            extra: dict[str, Any] = {"logprobs": part["logprobs"]} if kind == "message" else {}
            events.append(self._at(item, done, content_index=0, text=part["text"], **extra))
            events.append(self._at(item, "response.content_part.done", content_index=0,
                                   part=dict(part)))
        item["status"] = "completed"
        events.append({"type": "response.output_item.done",
                       "output_index": self.items.index(item), "item": dict(item)})


def entries(tokens: TokenBytes,
            logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]] | None:
    """A batch's logprobs as the output text's entries (chat's shape); None when there are none."""
    if not logprobs:
        return None
    entries: list[dict[str, Any]] = chat_logprobs(tokens, logprobs)["content"]
    return entries


def failure(err: OpenAIHTTPError) -> tuple[dict[str, Any], Event]:
    """How a failed response says why: its ``error`` field, and the ``error`` event."""
    code = err.code or err.type
    return ({"code": code, "message": err.message},
            {"type": "error", "code": code, "message": err.message, "param": err.param})


def usage(used: Usage) -> dict[str, Any]:
    """A Response's ``usage``."""
    prompt, completion = used.prompt_tokens, used.completion_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": used.cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def outcome(end: Finished) -> tuple[str, str | None]:
    """The response's status, and why it is incomplete (if it is)."""
    if end.finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class SseEvents:
    """Stream events as SSE, each with the next ``sequence_number``."""

    def __init__(self) -> None:
        self.sequence = 0

    def render(self, events: Sequence[Event]) -> bytes:
        return b"".join(self.each(events))

    def each(self, events: Sequence[Event]) -> list[bytes]:
        """The events one by one (a background response's log holds them so)."""
        out = []
        for event in events:
            event["sequence_number"] = self.sequence
            self.sequence += 1
            out.append(b"event: %b\ndata: %b\n\n" % (event["type"].encode(), encode_json(event)))
        return out


class ResponsesRenderer(Renderer):
    """One Responses API answer (one chat choice): its events as SSE, or the Response
    object. The finished response is kept in ``store`` for ``owner`` unless the request
    or the server says not to, and that is done before its last event (or its body)
    says it is stored."""

    __slots__ = ("_owner", "_so_far", "_sse", "_store", "_tokens", "builder", "streamed")

    def __init__(self, request: ResponsesRequest, prepared: Prepared,
                 store: ResponseStore | None, owner: str = ANONYMOUS) -> None:
        assert isinstance(prepared.request, ChatRequest)
        request = dataclasses.replace(request, chat=prepared.request)
        keep = store is not None and request.store
        response_id = store.new_id() if store is not None else new_response_id()
        self.builder = ResponseBuilder(request, response_id, int(time.time()), keep)
        self.streamed = request.chat.stream
        self._store = store
        self._owner = owner
        self._tokens = prepared.token_bytes
        self._sse = SseEvents()
        self._so_far = Usage(0, 0)  # the usage of the last event (a failure reports it)

    def opened(self, event: Opened, index: int) -> bytes:
        self._so_far = event.usage
        if not self.streamed:
            return b""
        builder = self.builder
        return self._sse.render([
            {"type": "response.created", "response": builder.response("in_progress")},
            {"type": "response.in_progress", "response": builder.response("in_progress")},
        ])

    def batch(self, event: Batch, index: int) -> bytes:
        self._so_far = Usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        events = self.builder.feed(parsed(event), entries(self._tokens, event.logprobs))
        return self._sse.render(events) if self.streamed else b""

    async def finished(self, event: Finished, index: int) -> tuple[bytes, bool]:
        out = self.batch(event.last, index)
        status, why = outcome(event)
        builder = self.builder
        events = builder.finish(status)
        response = await self._kept(lambda: builder.response(status, usage(event.usage), why))
        if not self.streamed:
            return encode_json(response), True
        events.append({"type": f"response.{status}", "response": response})
        return out + self._sse.render(events), True

    def failed(self, error: OpenAIHTTPError) -> bytes:
        """A started Responses stream ends as the API ends one: ``error``, ``response.failed``."""
        response = self.builder.response("failed", usage(self._so_far))
        response["error"], event = failure(error)
        return self._sse.render([event, {"type": "response.failed", "response": response}])

    async def _kept(self, render: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The finished Response object, stored first if it is to be (one that could not
        be says ``store: false``), its turn added to its conversation if it names one."""
        response = render()
        store, builder = self._store, self.builder
        if store is None:
            return response
        request = builder.request
        await append_turn(store, request.conversation, [*request.items, *builder.items],
                          self._owner)
        if not builder.stored or await stored(
                store, builder.record(encode_json(response), self._owner),
                lineage=request.lineage()):
            return response
        if store.durable is None:
            log.warning("response %s is larger than its owner may keep ([frontend.responses] "
                        "max_bytes %d): not kept", builder.id, store.owner_cap)
        builder.stored = False
        return render()
