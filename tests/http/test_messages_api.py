"""Parsed deltas as Anthropic content blocks and stream events (no I/O)."""

from __future__ import annotations

from direct_frontend.http.messages_api import MessageBuilder
from direct_frontend.openai.parsers.base import ParsedDelta, ToolCallDelta


def test_blocks_open_and_close_in_the_models_order() -> None:
    b = MessageBuilder("msg_1", "m")
    events = b.feed(ParsedDelta(reasoning="think"))
    events += b.feed(ParsedDelta(reasoning="ing", content="Hi"))
    events += b.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, "", "call_x", "f"),
                                             ToolCallDelta(0, '{"a"')]))
    events += b.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, ": 1}"),
                                             ToolCallDelta(1, "{}", "call_y", "g")]))
    events += b.finish()
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
    ]
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "text_delta", "input_json_delta",
        "input_json_delta", "input_json_delta"]
    assert events[7]["content_block"] == {"type": "tool_use", "id": "call_x", "name": "f",
                                          "input": {}}
    assert b.blocks == [
        {"type": "thinking", "thinking": "thinking", "signature": ""},
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "call_x", "name": "f", "input": {"a": 1}},
        {"type": "tool_use", "id": "call_y", "name": "g", "input": {}},
    ]
    assert b.called and b.malformed_inputs == 0
    assert b.message(None, None, {})["content"] == []  # message_start shows no content


def test_arguments_that_are_not_an_object_become_an_empty_input_and_are_counted() -> None:
    b = MessageBuilder("msg_1", "m")
    b.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, "[1, 2", "call_x", "f")]))
    b.finish()
    assert b.blocks[0]["input"] == {} and b.malformed_inputs == 1
    message = b.message("tool_use", None, {"input_tokens": 1, "output_tokens": 2})
    assert message["content"] == b.blocks and message["stop_reason"] == "tool_use"
