"""Which parsers a model gets: the fleet file's names, "none", or what its template shows."""

from __future__ import annotations

import pytest

from direct_frontend.openai.parse import parse_chat_request
from direct_frontend.openai.parsers.forced import NamedCallParser, RequiredCallsParser
from direct_frontend.openai.parsers.registry import ChoiceParser
from direct_frontend.pipeline.parsing import (
    ModelParsers,
    choice_parser,
    model_parsers,
    parser_problems,
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
