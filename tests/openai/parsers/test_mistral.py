"""Mistral ``[TOOL_CALLS]`` in the pre-v11 array form and the v11+ name/args form."""

from __future__ import annotations

import pytest

from tests.support.parsers import check_malformed, check_output, make

mistral = make("mistral")
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {}}]',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"},'
    '{"name": "get_time", "arguments": {}, "id": "f5g6h7i8j"}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
    '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
    "[TOOL_CALLS]get_time[CALL_ID]f5g6h7i8j[ARGS]{}",
])
def test_both_forms_with_parallel_calls(text: str) -> None:
    check_output(mistral, "Sure. " + text, ("Sure. ", "", CALLS),
                 markers=("[TOOL_CALLS]", "[ARGS]"))


def test_text_after_v11_calls_is_content() -> None:
    check_output(mistral, '[TOOL_CALLS]f[ARGS]{"a": [1]} done', ("done", "", [("f", {"a": [1]})]))


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
    "[TOOL_CALLS] [42]",
])
def test_malformed_calls_come_back_as_content(text: str) -> None:
    check_malformed(mistral, text, text)
