"""Parsed deltas as Responses items and events (no I/O)."""

from __future__ import annotations

import json

from direct_frontend.http.responses_api import ResponseBuilder
from direct_frontend.openai.parsers.base import ParsedDelta, ToolCallDelta
from direct_frontend.openai.responses_api import parse_responses_request


def builder() -> ResponseBuilder:
    request = parse_responses_request(json.dumps({"model": "m", "input": "hi"}).encode())
    return ResponseBuilder(request, "resp_1", 1)


def test_items_open_and_close_in_the_models_order() -> None:
    b = builder()
    events = b.feed(ParsedDelta(reasoning="think"))
    events += b.feed(ParsedDelta(reasoning="ing", content="Hi"))
    events += b.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, "", "call_x", "f"),
                                             ToolCallDelta(0, '{"a"')]))
    events += b.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, ": 1}")]))
    events += b.finish("completed")
    types = [e["type"] for e in events]
    assert types == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0, 1, 2]
    added = events[0]["item"]
    assert added["type"] == "reasoning" and added["content"] == []  # filled by the deltas
    reasoning, message, call = b.response("completed")["output"]
    assert reasoning["content"][0]["text"] == "thinking"
    assert message["content"][0]["text"] == "Hi"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_x", "f", '{"a": 1}')
    assert all(item["status"] == "completed" for item in (reasoning, message, call))
