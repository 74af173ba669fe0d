"""Responses bodies read into chat requests: items to messages, tools, tool_choice, refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest

from direct_frontend.openai.body import read_json_object
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.response_store import decode_items
from direct_frontend.openai.responses_api import parse_responses_request

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def test_items_become_the_chat_turns() -> None:
    parsed = parse_responses_request(body(instructions="Be brief.", tools=[TOOL], input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": "two"},
    ], max_output_tokens=7, reasoning={"effort": "low"}))
    chat = parsed.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert chat.messages[0].content == "Be brief." and chat.messages[1].content == "hi"
    assert [c.id for c in chat.messages[2].tool_calls] == ["call_1", "call_2"]
    assert chat.messages[4].tool_call_id == "call_2" and chat.messages[4].content == "two"
    assert chat.tools[0].function.name == "f" and chat.max_tokens == 7
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


def test_a_string_input_is_one_user_turn_and_a_named_choice_forces_it() -> None:
    parsed = parse_responses_request(body(input="hi", tools=[TOOL],
                                          tool_choice={"type": "function", "name": "f"}))
    assert parsed.chat.messages[0].role == "user"
    assert parsed.chat.tool_function == "f" and parsed.chat.constraint is not None
    keyed = parse_responses_request(body(input="hi", prompt_cache_key="thread-7"))
    assert keyed.chat.prompt_cache_key == "thread-7"  # a routing key, as chat's


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": "hi", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "background": "yes"}, "background"),
    ({"input": "hi", "truncation": "middle"}, "truncation"),
    ({}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0].type"),
])
def test_what_the_server_cannot_take_is_a_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIHTTPError) as caught:
        parse_responses_request(body(**fields))
    assert caught.value.status == 400 and caught.value.param == param


def test_a_follow_up_reads_its_history_first_and_no_earlier_instructions() -> None:
    first = parse_responses_request(body(instructions="Be brief.", input="hi"))
    assert first.store and first.previous_response_id is None and first.history == ()
    history = tuple(json.dumps(item).encode() for item in (
        *first.items,
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "id": "msg_1", "role": "assistant",
         "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
    ))
    raw = read_json_object(body(input="again", previous_response_id="resp_1", store=False))
    follow_up = parse_responses_request(raw, history, decode_items(history))
    chat = follow_up.chat
    assert [(m.role, m.content) for m in chat.messages] == [
        ("user", "hi"), ("assistant", "hello"), ("user", "again")]
    assert follow_up.history is history and follow_up.previous_response_id == "resp_1"
    assert not follow_up.store and follow_up.instructions is None


def test_input_items_come_back_typed_with_ids_and_their_content_in_parts() -> None:
    parsed = parse_responses_request(body(input=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "id": "msg_mine"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
    ]))
    user, assistant, output = parsed.items
    assert user["type"] == "message" and user["id"].startswith("msg_")
    assert user["content"] == [{"type": "input_text", "text": "hi"}]
    assert assistant["id"] == "msg_mine"
    assert assistant["content"] == [{"type": "output_text", "text": "hello"}]
    assert output["id"].startswith("fco_") and output["output"] == "one"
    assert parse_responses_request(body(input="hi")).items[0]["content"] == [
        {"type": "input_text", "text": "hi"}]


def test_a_broken_stored_item_names_the_previous_response() -> None:
    history = (b'{"type":"message","role":"robot","content":"x"}',)
    with pytest.raises(OpenAIHTTPError) as caught:
        parse_responses_request(body(input="hi"), history, decode_items(history))
    assert caught.value.param == "previous_response_id.role"


def test_logprobs_are_asked_by_top_logprobs_or_include() -> None:
    top = parse_responses_request(body(input="hi", top_logprobs=3)).chat
    assert top.logprobs == 3  # alternatives per token
    included = parse_responses_request(body(input="hi",
                                            include=["message.output_text.logprobs"])).chat
    assert included.logprobs == 0
    assert parse_responses_request(body(input="hi")).chat.logprobs is None
    with pytest.raises(OpenAIHTTPError) as caught:
        parse_responses_request(body(input="hi", top_logprobs=25))
    assert caught.value.param == "top_logprobs"


def test_service_tier_and_safety_identifier_carry_over() -> None:
    request = parse_responses_request({"model": "m", "input": "x", "service_tier": "priority",
                                       "safety_identifier": "u1"})
    assert (request.chat.service_tier, request.chat.safety_identifier) == ("priority", "u1")
