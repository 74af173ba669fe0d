"""Forced calls: the JSON the constraint makes the engine write, read back as tool calls."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from direct_frontend.openai.parsers.base import ParsedDelta, ToolCallDelta
from direct_frontend.openai.parsers.forced import (
    NamedCallParser,
    RequiredCallsParser,
    named_call_schema,
    required_calls_schema,
)
from direct_frontend.openai.types import FunctionDefinition, Tool
from tests.support.parsers import check_output, check_shapes, counting_ids, run, summary

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (Tool(function=FunctionDefinition(name="get_weather", parameters=CITY)),
         Tool(function=FunctionDefinition(name="ping")))
TWO_CALLS = ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
             '{"name": "ping", "parameters": {}}]')


def required(**over: Any) -> Any:
    return RequiredCallsParser(tools={"get_weather": CITY, "ping": None},
                               new_id=counting_ids(), **over)


def test_the_required_schema_takes_exactly_the_calls_of_the_tools() -> None:
    schema = required_calls_schema(TOOLS, parallel=True)
    jsonschema.validate(json.loads(TWO_CALLS), schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather",
                                                             "parameters": {}}]):
        try:
            jsonschema.validate(bad, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"{bad} passed")
    single = required_calls_schema(TOOLS, parallel=False)
    assert single["maxItems"] == 1
    assert named_call_schema(TOOLS[0]) == CITY and named_call_schema(TOOLS[1]) == {
        "type": "object"}


def test_required_calls_stream_as_they_parse_whole() -> None:
    expected = ("", "", [("get_weather", {"city": "Zürich"}), ("ping", {})])
    check_output(required, TWO_CALLS, expected)


def test_a_required_array_cut_short_is_counted() -> None:
    parser = required()
    run(parser, [TWO_CALLS[:40]])
    assert parser.malformed == 1


def test_a_named_call_is_the_whole_output_streamed() -> None:
    text = '{"city": "Zürich"}'
    whole, _ = run(NamedCallParser("get_weather", new_id=counting_ids()), [text])
    assert summary(whole) == ("", "", [("get_weather", {"city": "Zürich"})])
    for i in range(len(text) + 1):
        parser = NamedCallParser("get_weather", new_id=counting_ids())
        streamed, deltas = run(parser, [text[:i], text[i:]])
        assert streamed == whole and parser.malformed == 0
        check_shapes(deltas)


def test_a_named_call_cut_by_max_tokens_is_counted() -> None:
    parser = NamedCallParser("get_weather")
    message, _ = run(parser, ['{"city": "Zü'])
    assert parser.malformed == 1 and message.tool_calls[0].function.arguments == '{"city": "Zü'


def test_a_delta_holds_one_entry_per_call_however_its_pieces_arrive() -> None:
    delta = ParsedDelta(tool_calls=[ToolCallDelta(0, '{"a"', "call_0", "f")])
    delta.add_calls([ToolCallDelta(1, "", "call_1", "g"), ToolCallDelta(0, ": 1}"),
                     ToolCallDelta(1, "{}")])
    assert [c.to_openai() for c in delta.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function",
         "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "g",
                                                                      "arguments": "{}"}},
    ]
