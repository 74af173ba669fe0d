"""Reasoning blocks: ``<think>`` (DeepSeek-R1, Qwen3) and ``[THINK]`` (Magistral)."""

from __future__ import annotations

import pytest

from direct_frontend.openai.parsers.think import prompt_opens_reasoning, prompt_reasoning_state
from tests.support.parsers import check_output, make


@pytest.mark.parametrize(("reasoning", "text", "expected"), [
    ("qwen3", "<think>\nLet me add: 2+2.\n</think>\n\nIt is 4.",
     ("It is 4.", "Let me add: 2+2.", [])),
    ("qwen3", "It is 4.", ("It is 4.", "", [])),  # enable_thinking off
    ("qwen3", "<think>cut by max_tokens", ("", "cut by max_tokens", [])),
    ("deepseek_r1", "Let me add: 2+2.\n</think>\n\nIt is 4.", ("It is 4.", "Let me add: 2+2.", [])),
    ("deepseek_r1", "<think>\nLet me add.</think>It is 4.", ("It is 4.", "Let me add.", [])),
    ("mistral", "[THINK]Add them.[/THINK]It is 4.", ("It is 4.", "Add them.", [])),
])
def test_reasoning_and_content_split_alike_at_every_point(reasoning: str, text: str,
                                                         expected: tuple) -> None:
    check_output(make(None, reasoning), text, expected, markers=("<think>", "</think>", "THINK]"))


def test_tags_after_the_start_of_the_reply_are_content() -> None:
    check_output(make(None, "qwen3"), "a </think> b <think> c", ("a </think> b <think> c", "", []))


def test_a_prompt_that_opens_the_block_starts_the_reply_inside_it() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"
    assert prompt_opens_reasoning(prompt)
    assert not prompt_opens_reasoning(prompt + "\n</think>\n\n")
    check_output(make(None, "qwen3", starts_in_reasoning=prompt_opens_reasoning(prompt)),
                 "Hmm.</think>Done.", ("Done.", "Hmm.", []))


@pytest.mark.parametrize(("parser", "prompt", "state", "expected"), [
    # DeepSeek-V3.1 without thinking (its default): the template closes the block
    ("deepseek_v31", "<｜User｜>hi<｜Assistant｜></think>", False, ("Hello.", "", [])),
    ("deepseek_v31", "<｜User｜>hi<｜Assistant｜><think>", True, ("", "Hello.", [])),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, ("Hello.", "", [])),
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜>", None, ("", "Hello.", [])),  # R1's default
])
def test_the_prompt_says_whether_the_reply_starts_in_reasoning(
    parser: str, prompt: str, state: bool | None, expected: tuple,
) -> None:
    assert prompt_reasoning_state(prompt) is state
    check_output(make(None, parser, starts_in_reasoning=state), "Hello.", expected)


def test_tool_calls_are_parsed_in_the_content_after_reasoning() -> None:
    text = ('<think>Need weather.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    check_output(make("hermes", "qwen3"), text,
                 ("", "Need weather.", [("get_weather", {"city": "Paris"})]))


def test_reasoning_waits_only_for_an_ambiguous_tail() -> None:
    parser = make(None, "qwen3")()
    assert parser.feed("<think>a").reasoning == "a"
    assert parser.feed(" </thi").reasoning == ""
    out = parser.feed("nk>b")
    assert (out.reasoning, out.content) == ("", "b")
