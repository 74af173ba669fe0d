"""Anthropic Messages bodies read into chat requests, and errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request, model_not_found
from direct_frontend.openai.messages_api import anthropic_error_body, parse_messages_request

TOOL = {"name": "f", "description": "d", "input_schema": {"type": "object"}}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 9, **fields}).encode()


def test_blocks_become_the_chat_turns() -> None:
    chat = parse_messages_request(body(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        tools=[TOOL], stop_sequences=["END"], metadata={"user_id": "u1"}, top_k=5,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "one"}]},
                {"type": "text", "text": "and now?"}]},
        ]))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief."
    assistant = chat.messages[2]
    assert assistant.content == "Let me look."
    assert [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in assistant.tool_calls] == [("toolu_1", "f", {"a": 1})]
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "one"
    assert chat.messages[4].content == "and now?"
    assert chat.tools[0].function.name == "f" and chat.tools[0].function.description == "d"
    assert chat.stop == ("END",) and chat.max_tokens == 9 and chat.user == "u1"
    assert chat.top_k == 5


@pytest.mark.parametrize(("choice", "mode", "parallel"), [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "f", "disable_parallel_tool_use": True}, "function", False),
])
def test_tool_choice_as_chats(choice: dict[str, Any], mode: str, parallel: bool) -> None:
    chat = parse_messages_request(body(tools=[TOOL], tool_choice=choice,
                                       messages=[{"role": "user", "content": "hi"}]))
    assert chat.parallel_tool_calls is parallel
    if mode == "function":
        assert chat.tool_function == "f" and chat.constraint is not None
    else:
        assert chat.tool_choice == mode


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({}, "messages"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.source.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305",
                                                                   "name": "web_search"}]},
     "tools.0.type"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "some"}},
     "tool_choice.type"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop_sequences": "END"},
     "stop_sequences"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
])
def test_what_cannot_be_taken_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIHTTPError) as caught:
        parse_messages_request(body(**fields))
    assert caught.value.status == 400 and caught.value.param == param


def test_a_count_tokens_body_needs_no_max_tokens() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert parse_messages_request(raw, counting=True).messages[0].content == "hi"


def test_errors_in_anthropics_shape() -> None:
    assert json.loads(anthropic_error_body(invalid_request("bad", "x"))) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert json.loads(anthropic_error_body(model_not_found("m")))["error"]["type"] == (
        "not_found_error")
    for status, kind in ((401, "authentication_error"), (429, "rate_limit_error"),
                         (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
                         (408, "invalid_request_error")):
        err = OpenAIHTTPError(status, "x")
        assert json.loads(anthropic_error_body(err))["error"]["type"] == kind


@pytest.mark.parametrize(("thinking", "kwargs"), [
    ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True, "thinking": True}),
    ({"type": "disabled"}, {"enable_thinking": False, "thinking": False}),
    (None, None),
])
def test_thinking_reaches_the_template_as_its_switch(thinking: Any, kwargs: Any) -> None:
    fields: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if thinking is not None:
        fields["thinking"] = thinking
    assert parse_messages_request(body(**fields)).chat_template_kwargs == kwargs
