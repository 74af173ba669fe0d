"""Pythonic call lists (Llama 3.2 / 4)."""

from __future__ import annotations

import pytest

from tests.support.parsers import check_malformed, check_output, make

pythonic = make("pythonic")


@pytest.mark.parametrize("text", [
    '[get_weather(city="San Francisco, CA", days=3), get_time()]',
    '<|python_start|>[get_weather(city="San Francisco, CA", days=3), get_time()]<|python_end|>',
    "[ get_weather(city='San Francisco, CA', days=3) ,get_time( ) ]",
])
def test_parallel_calls(text: str) -> None:
    calls = [("get_weather", {"city": "San Francisco, CA", "days": 3}), ("get_time", {})]
    check_output(pythonic, text, ("", "", calls), markers=("<|python",))


def test_literal_values_of_every_kind() -> None:
    text = "[f(s='a)b]c', n=-1.5, b=True, z=None, l=[1, (2, 3)], d={'k': 'v'})]"
    expected = {"s": "a)b]c", "n": -1.5, "b": True, "z": None, "l": [1, [2, 3]], "d": {"k": "v"}}
    check_output(pythonic, text, ("", "", [("f", expected)]))


def test_prose_is_content() -> None:
    check_output(pythonic, "The answer is f(x).", ("The answer is f(x).", "", []))


@pytest.mark.parametrize("text", [
    "[1, 2] is a list",
    "[f(x)]",  # positional
    "[f(a=open('x'))]",  # not a literal
    '[get_weather(city="Par',
])
def test_malformed_lists_come_back_as_content(text: str) -> None:
    check_malformed(pythonic, text, text)
