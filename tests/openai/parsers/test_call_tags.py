"""The "a call or the format" structural tag: each call it allows, the model's parser reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from direct_frontend.engines.neutral import Constraint, ConstraintKind
from direct_frontend.openai.parsers.call_tags import (
    FORMATS,
    MAX_WHITESPACE,
    call_tags,
    json_part,
    tools_or_format,
)
from direct_frontend.openai.types import FunctionDefinition, Tool
from tests.support.parsers import make, run, summary

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (Tool(function=FunctionDefinition(name="get_weather", parameters=CITY)),
         Tool(function=FunctionDefinition(name="ping")))
ANSWER = {"type": "object", "properties": {"forecast": {"type": "string"}}}
FORMAT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ANSWER))


def tag_of(parallel: bool = True, fmt: Constraint = FORMAT) -> dict[str, Any]:
    constraint = tools_or_format("hermes", TOOLS, parallel, fmt)
    assert constraint is not None and constraint.kind is ConstraintKind.TOOLS_OR_FORMAT
    assert constraint.param == "response_format"
    tag: dict[str, Any] = json.loads(constraint.text)
    return tag


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_every_call_a_tag_allows_is_read_back_as_that_call(parser: str) -> None:
    tags = call_tags(parser, TOOLS)
    assert tags is not None and len(tags) == len(TOOLS) * len(FORMATS[parser])
    arguments = {"get_weather": {"city": "Zürich"}, "ping": {}}
    for tag in tags:
        name = json.loads(tag["begin"].split(">", 1)[1].strip() + "null}")["name"]
        assert tag["content"] == json_part(CITY if name == "get_weather" else {"type": "object"})
        text = tag["begin"] + json.dumps(arguments[name]) + tag["end"]
        message, _ = run(make(parser, tools={"get_weather": CITY, "ping": None})(), [text])
        assert summary(message) == ("", "", [(name, arguments[name])]), text


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
    assert tag_of(parallel=False)["format"]["elements"][1]["stop_after_first"] is True
    any_object = tag_of(fmt=Constraint(ConstraintKind.JSON_OBJECT))["format"]["elements"][0]
    assert any_object == json_part({"type": "object"})


def test_no_tag_for_a_format_without_one_or_a_format_that_is_not_json() -> None:
    assert call_tags("pythonic", TOOLS) is None and call_tags(None, TOOLS) is None
    assert tools_or_format("pythonic", TOOLS, True, FORMAT) is None
    assert tools_or_format("hermes", TOOLS, True,
                           Constraint(ConstraintKind.REGEX, "[a-z]+")) is None
