"""Qwen3-Coder XML calls, typed by the tools' schemas, fed at every split point."""

from __future__ import annotations

import pytest

from tests.support.parsers import check_malformed, check_output, make

coder = make("qwen3_coder")
CALL = ("<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
        "<parameter=content>\nprint('<hi>')\nx = 1\n</parameter>\n<parameter=mode>\n644\n"
        "</parameter>\n</function>\n</tool_call>")


def test_a_call_with_typed_parameters() -> None:
    expected = ("I'll write it.\n", "", [("write_file", {"path": "/tmp/a.py",
                                                         "content": "print('<hi>')\nx = 1",
                                                         "mode": 644})])
    check_output(coder, "I'll write it.\n" + CALL, expected, markers=("<tool_call>", "<function="))


def test_a_string_schema_keeps_digits_text() -> None:
    tools = {"write_file": {"type": "object", "properties": {"mode": {"type": "string"}}}}
    expected = ("", "", [("write_file", {"path": "/tmp/a.py", "content": "print('<hi>')\nx = 1",
                                         "mode": "644"})])
    check_output(make("qwen3_coder", tools=tools), CALL, expected)


def test_parallel_calls_and_one_without_parameters() -> None:
    text = (CALL + "\n<tool_call>\n<function=list_dir>\n</function>\n</tool_call>")
    calls = [("write_file", {"path": "/tmp/a.py", "content": "print('<hi>')\nx = 1", "mode": 644}),
             ("list_dir", {})]
    check_output(coder, text, ("", "", calls))


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",  # cut before </function>
    "<tool_call>\nnot xml\n</tool_call>",
])
def test_malformed_calls_come_back_as_content(text: str) -> None:
    check_malformed(coder, text, text)
