"""Llama 3.x JSON calls, with and without ``<|python_tag|>``."""

from __future__ import annotations

import pytest

from tests.support.parsers import check_malformed, check_output, make

llama = make("llama3_json")


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '\n{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
])
def test_one_call(text: str) -> None:
    check_output(llama, text, ("", "", [("get_weather", {"city": "Paris"})]),
                 markers=("<|python_tag|>",))


def test_parallel_calls_separated_by_semicolons() -> None:
    text = ('<|python_tag|>{"name": "a", "parameters": {"x": "};"}}; '
            '{"name": "b", "parameters": {}}')
    check_output(llama, text, ("", "", [("a", {"x": "};"}), ("b", {})]))


def test_prose_is_content_even_with_braces() -> None:
    check_output(llama, "Use {braces} like this.", ("Use {braces} like this.", "", []))


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Par',
    '{"name": "get_weather", "parameters": {"city": Paris}}',
])
def test_malformed_calls_come_back_as_content(text: str) -> None:
    check_malformed(llama, text, text)
