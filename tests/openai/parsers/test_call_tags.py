"""The "a call or the format" structural tag: each call it allows, the model's parser reads."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from direct_frontend.engines.neutral import Constraint, ConstraintKind
from direct_frontend.openai.parsers.call_tags import (
    FORMATS,
    MAX_WHITESPACE,
    call_tags,
    calls_part,
    json_part,
    tools_or_format,
)
from direct_frontend.openai.types import FunctionDefinition, Tool
from direct_frontend.simulator.structural import accepts, structural_text
from tests.support.parsers import make, run, summary

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (Tool(function=FunctionDefinition(name="get_weather", parameters=CITY)),
         Tool(function=FunctionDefinition(name="ping")))
SCHEMAS: Any = {"get_weather": CITY, "ping": None}
ANSWER = {"type": "object", "properties": {"forecast": {"type": "string"}}}
FORMAT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ANSWER))

#: per parser, a reply of two calls as its models write it (the parser tests' own shapes)
REPLIES = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
               '</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>'),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"city": "Zürich"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>'
                    "function<｜tool▁sep｜>ping\n```json\n{}\n```<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Zürich"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>ping<｜tool▁sep｜>'
                     "{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|>'
                "<|tool_call_begin|>functions.ping:1<|tool_call_argument_begin|>{}"
                "<|tool_call_end|><|tool_calls_section_end|>"),
}
TWO_CALLS = [("get_weather", {"city": "Zürich"}), ("ping", {})]


def only_calls(parser: str, parallel: bool = True) -> str:
    """A structural tag of ``parser``'s calls alone."""
    return json.dumps({"type": "structural_tag", "format": calls_part(parser, TOOLS, parallel)})


def test_every_format_with_a_tag_has_a_reply_here() -> None:
    assert set(REPLIES) == set(FORMATS)


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_the_tag_takes_the_models_own_calls_which_its_parser_reads(parser: str) -> None:
    assert accepts(only_calls(parser), REPLIES[parser])
    message, _ = run(make(parser, tools=SCHEMAS)(), [REPLIES[parser]])
    assert summary(message) == ("", "", TWO_CALLS)
    assert not accepts(only_calls(parser, parallel=False), REPLIES[parser])
    assert not accepts(only_calls(parser), REPLIES[parser].replace("get_weather", "get_time"))
    assert not accepts(only_calls(parser), REPLIES[parser].replace('"Zürich"', "7"))


@pytest.mark.parametrize("parser", sorted(FORMATS))
@pytest.mark.parametrize("seed", range(5))
def test_whatever_a_tags_call_says_its_parser_reads(parser: str, seed: int) -> None:
    text = structural_text(only_calls(parser), random.Random(seed), None)
    message, _ = run(make(parser, tools=SCHEMAS)(), [text])
    assert message.content == "" and len(message.tool_calls) == 1, text
    call = message.tool_calls[0]
    assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)


def tag_of(parallel: bool = True, fmt: Constraint = FORMAT) -> dict[str, Any]:
    constraint = tools_or_format("hermes", TOOLS, parallel, fmt)
    assert constraint is not None and constraint.kind is ConstraintKind.TOOLS_OR_FORMAT
    assert constraint.param == "response_format"
    tag: dict[str, Any] = json.loads(constraint.text)
    return tag


def test_the_tag_is_the_format_or_calls_and_parallel_calls_follow_the_request() -> None:
    tag = tag_of()
    assert tag["type"] == "structural_tag"
    either = tag["format"]
    assert either["type"] == "or"
    schema, calls = either["elements"]
    assert schema == {"type": "json_schema", "json_schema": ANSWER,
                      "max_whitespace_cnt": MAX_WHITESPACE}
    assert calls["type"] == "tags_with_separator" and calls["at_least_one"] is True
    assert calls["stop_after_first"] is False and calls["tags"] == call_tags("hermes", TOOLS)
    assert calls["tags"][2]["content"] == json_part({"type": "object"})  # ping: no parameters
    assert tag_of(parallel=False)["format"]["elements"][1]["stop_after_first"] is True
    any_object = tag_of(fmt=Constraint(ConstraintKind.JSON_OBJECT))["format"]["elements"][0]
    assert any_object == json_part({"type": "object"})


def test_no_tag_for_a_format_without_one_or_a_format_that_is_not_json() -> None:
    assert call_tags("pythonic", TOOLS) is None and call_tags(None, TOOLS) is None
    assert tools_or_format("llama3_json", TOOLS, True, FORMAT) is None
    assert tools_or_format("hermes", TOOLS, True,
                           Constraint(ConstraintKind.REGEX, "[a-z]+")) is None
