"""Hermes / Qwen ``<tool_call>`` JSON calls, fed at every split point."""

from __future__ import annotations

import pytest

from tests.support.parsers import check_malformed, check_output, make, run

hermes = make("hermes")
MARKERS = ("<tool_call>", "</tool_call>")


@pytest.mark.parametrize(("text", "expected"), [
    ("Plain answer, no tools.", ("Plain answer, no tools.", "", [])),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ("", "", [("get_weather", {"city": "Paris"})])),
    ('Checking both.\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Zürich 🌧"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "a\\"}b"}}\n</tool_call>',
     ("Checking both.\n", "", [("get_weather", {"city": "Zürich 🌧"}),
                              ("get_time", {"tz": 'a"}b'})])),
    ('<tool_call>{"name": "nested", "arguments": {"a": [1, {"b": "</tool"}], "c": {}}}</tool_call>'
     " and then a remark",
     ("and then a remark", "", [("nested", {"a": [1, {"b": "</tool"}], "c": {}})])),
    ("a < b <tool and <tool_cal are text", ("a < b <tool and <tool_cal are text", "", [])),
])
def test_every_split_parses_alike(text: str, expected: tuple) -> None:
    check_output(hermes, text, expected, markers=MARKERS)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "f", "arguments": {"a": "cut',  # cut by max_tokens
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing junk\n</tool_call>',
    "<tool_call>not json at all</tool_call>",
])
def test_malformed_calls_come_back_as_content(text: str) -> None:
    check_malformed(hermes, text, text)


def test_an_unknown_tool_is_content_when_tools_are_known() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    check_malformed(make("hermes", tools={"get_weather": None}), text, text)


def test_arguments_stream_in_fragments_after_a_header() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"query": "a long query"}}</tool_call>'
    _, deltas = run(hermes(), [text[i:i + 3] for i in range(0, len(text), 3)])
    pieces = [p for d in deltas for p in d.tool_calls]
    assert pieces[0].name == "f" and pieces[0].id is not None
    assert len(pieces) > 3 and all(p.id is None for p in pieces[1:])
    assert pieces[0].to_openai()["type"] == "function"


def test_content_waits_only_for_an_ambiguous_tail() -> None:
    parser = hermes()
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("box>").content == "<toolbox>"
    assert parser.feed("done <").content == "done "
    assert parser.finish().content == "<"
