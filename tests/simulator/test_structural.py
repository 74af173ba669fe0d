"""The simulator under a structural tag: the script where the tag allows it, else the tag's text."""

from __future__ import annotations

import json
import random

import pytest

from direct_frontend.engines.neutral import Constraint, ConstraintKind
from direct_frontend.openai.parsers.call_tags import tools_or_format
from direct_frontend.openai.types import FunctionDefinition, Tool
from direct_frontend.simulator.constraints import Unsupported
from direct_frontend.simulator.structural import accepts, conforms, structural_text

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"city": {"type": "string"},
                                           "degrees": {"type": "integer", "maximum": 60}},
          "required": ["city", "degrees"], "additionalProperties": False}
TOOLS = (Tool(function=FunctionDefinition(name="get_weather", parameters=CITY)),)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tag(parallel: bool = True) -> str:
    constraint = tools_or_format("hermes", TOOLS, parallel,
                                 Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ANSWER)))
    assert constraint is not None
    return constraint.text


@pytest.mark.parametrize("script", [
    CALL,
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    CALL + "\n" + CALL,
    '{"city": "Paris", "degrees": 21}',
])
def test_a_script_the_tag_allows_is_the_models_choice(script: str) -> None:
    assert accepts(tag(), script)
    assert structural_text(tag(), random.Random(1), script) == script


@pytest.mark.parametrize("script", [
    "It is sunny in Paris.",  # prose: neither a call nor the format
    '{"city": "Paris"}',  # the format's JSON, a required field missing
    '{"city": "Paris", "degrees": 99}',  # out of range
    CALL.replace("get_weather", "get_time"),  # no such tool
    CALL.replace('"Paris"', "7"),  # arguments against the tool's schema
    CALL + "\nand more",
])
def test_a_script_the_tag_refuses_is_replaced_by_text_it_allows(script: str) -> None:
    assert not accepts(tag(), script)
    text = structural_text(tag(), random.Random(1), script)
    assert text != script and accepts(tag(), text)
    assert conforms(json.loads(text), ANSWER, ANSWER)  # the first alternative: the format


def test_one_call_only_without_parallel_calls() -> None:
    assert accepts(tag(parallel=False), CALL)
    assert not accepts(tag(parallel=False), CALL + "\n" + CALL)


def test_the_older_form_and_unknown_formats_are_unsupported() -> None:
    legacy = json.dumps({"structures": [], "triggers": ["<tool_call>"]})
    with pytest.raises(Unsupported):
        structural_text(legacy, random.Random(1), None)
    token = json.dumps({"type": "structural_tag", "format": {"type": "token", "token": 5}})
    with pytest.raises(Unsupported):
        structural_text(token, random.Random(1), None)


def test_unscripted_an_agent_calls_first_and_answers_in_the_format_after() -> None:
    first = structural_text(tag(), random.Random(1), None, "<|im_start|>user\nWeather?")
    assert first.startswith("<tool_call>") and accepts(tag(), first)
    history = '<|im_start|>assistant\n<tool_call>{"name": "get_weather"}</tool_call>'
    after = structural_text(tag(), random.Random(1), None, history)
    assert conforms(json.loads(after), ANSWER, ANSWER)


def test_whitespace_between_json_tokens_is_bounded_as_the_tag_says() -> None:
    pretty = '{\n  "city": "Paris",\n  "degrees": 21\n}'
    assert accepts(tag(), pretty)
    padded = '{"city": "Paris",' + " " * 17 + '"degrees": 21}'
    assert not accepts(tag(), padded)
    assert accepts(tag(), '{"city": "Paris' + " " * 40 + '", "degrees": 21}')  # in a string
