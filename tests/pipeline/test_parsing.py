"""Which parsers a model gets: the fleet file's names, "none", or what its template shows."""

from __future__ import annotations

import json

import pytest

from direct_frontend.engines.neutral import ConstraintKind
from direct_frontend.openai.parse import parse_chat_request
from direct_frontend.openai.parsers.forced import NamedCallParser, RequiredCallsParser
from direct_frontend.openai.parsers.registry import ChoiceParser
from direct_frontend.pipeline.parsing import (
    ModelParsers,
    choice_parser,
    model_parsers,
    parser_problems,
    with_tools_or_format,
)
from direct_frontend.text.model_dir import TextModel

TOOLS = '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]'


def chat(extra: str = "") -> bytes:
    return ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": '
            + TOOLS + extra + "}").encode()


def test_the_demo_template_is_read_as_hermes(text_model: TextModel) -> None:
    found = model_parsers(None, None, text_model.template_text, text_model.model_type)
    assert (found.tool_parser, found.reasoning_parser) == ("hermes", None)
    assert "<tool_call>" in found.reason


def test_the_fleet_file_wins_and_none_turns_a_parser_off(text_model: TextModel) -> None:
    found = model_parsers("none", "deepseek-r1", text_model.template_text, None)
    assert (found.tool_parser, found.reasoning_parser) == (None, "deepseek_r1")
    assert model_parsers("qwen", "none", "", None) == ModelParsers("hermes", None,
                                                                   "as the fleet file says")


def test_unknown_names_are_problems() -> None:
    assert parser_problems("hermes", "none") == []
    (problem,) = parser_problems("hermez", None)
    assert problem.startswith("tool_parser: unknown parser 'hermez'") and "hermes" in problem


@pytest.mark.parametrize(("extra", "kind"), [
    ("", ChoiceParser),
    (', "tool_choice": "required"', RequiredCallsParser),
    (', "tool_choice": {"type": "function", "function": {"name": "f"}}', NamedCallParser),
])
def test_each_tool_choice_gets_its_parser(extra: str, kind: type) -> None:
    parser = choice_parser(ModelParsers("hermes"), parse_chat_request(chat(extra)), "")
    assert isinstance(parser, kind)


def test_no_tools_and_no_reasoning_parser_is_no_parser() -> None:
    request = parse_chat_request(chat(', "tool_choice": "none"'))
    assert choice_parser(ModelParsers("hermes"), request, "") is None
    reasoning = choice_parser(ModelParsers("hermes", "qwen3"), request, "<think>\n")
    assert isinstance(reasoning, ChoiceParser) and reasoning.tools is None
    assert reasoning.feed("a</think>b").reasoning == "a"



@pytest.mark.parametrize(("prompt", "reasoning", "content"), [
    ("<｜User｜>x<｜Assistant｜></think>", "", "Hi."),  # thinking off: the template closed it
    ("<｜User｜>x<｜Assistant｜><think>", "Hi.", ""),
    ("<｜User｜>x<｜Assistant｜>", "Hi.", ""),  # the parser's own default (R1 starts inside)
])
def test_the_rendered_prompt_says_where_the_reply_starts(prompt: str, reasoning: str,
                                                         content: str) -> None:
    parser = choice_parser(ModelParsers(None, "deepseek_v31"), parse_chat_request(chat()), prompt)
    assert parser is not None
    out = parser.feed("Hi.")
    out.extend(parser.finish())
    assert (out.reasoning, out.content) == (reasoning, content)


SCHEMA = ', "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": ' \
    '{"type": "object", "properties": {"a": {"type": "integer"}}}}}'
HERMES = ModelParsers("hermes", None)


def test_tools_with_a_response_format_take_a_call_or_the_format() -> None:
    request = parse_chat_request(chat(SCHEMA))
    widened = with_tools_or_format(request, HERMES)
    assert widened.constraint is not None and request.constraint is not None
    assert widened.constraint.kind is ConstraintKind.TOOLS_OR_FORMAT
    assert widened.constraint.param == "response_format"
    schema, calls = json.loads(widened.constraint.text)["format"]["elements"]
    assert schema["json_schema"] == json.loads(request.constraint.text)
    assert calls["tags"][0]["begin"].startswith('<tool_call>\n{"name": "f"')


@pytest.mark.parametrize("extra", [
    "",  # no format
    ', "tool_choice": "none"' + SCHEMA,  # no tools offered
    ', "guided_json": {"type": "object"}',  # an engine constraint, not a response format
    ', "response_format": {"type": "structural_tag", "structures": [], "triggers": []}',
])
def test_other_requests_keep_their_constraint(extra: str) -> None:
    request = parse_chat_request(chat(extra))
    assert with_tools_or_format(request, HERMES) is request


def test_a_model_without_a_tool_parser_keeps_the_format_and_one_without_a_tag_drops_it() -> None:
    request = parse_chat_request(chat(SCHEMA))
    assert with_tools_or_format(request, ModelParsers(None, "qwen3")) is request
    assert with_tools_or_format(request, ModelParsers("pythonic", None)).constraint is None
