"""DeepSeek V3, V3.1 and Kimi K2: calls between special-token markers, at every split point."""

from __future__ import annotations

import pytest

from tests.support.parsers import check_malformed, check_output, make

V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      '{"location": "東京"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
      "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "東京"}'
       "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>")
KIMI = ("<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"location": "東京"}<|tool_call_end|>\n<|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>\n"
        "<|tool_calls_section_end|>")
CALLS = [("get_weather", {"location": "東京"}), ("get_time", {})]


@pytest.mark.parametrize(("parser", "text"), [
    ("deepseek_v3", V3), ("deepseek_v31", V31), ("kimi_k2", KIMI),
])
def test_parallel_calls_after_content(parser: str, text: str) -> None:
    check_output(make(parser), "Let me look. " + text, ("Let me look. ", "", CALLS),
                 markers=("<｜", "<|tool"))


DS_CUT = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"location": ')
DS_BAD = '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": 東京}<｜tool▁call▁end｜>'
KIMI_NO_NAME = "<|tool_call_begin|><|tool_call_argument_begin|>{}<|tool_call_end|>"


@pytest.mark.parametrize(("parser", "text", "content"), [
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + DS_CUT, DS_CUT),
    ("deepseek_v31", f"<｜tool▁calls▁begin｜>{DS_BAD}<｜tool▁calls▁end｜>", DS_BAD),
    ("kimi_k2", f"<|tool_calls_section_begin|>{KIMI_NO_NAME}<|tool_calls_section_end|>",
     KIMI_NO_NAME),
])
def test_malformed_calls_come_back_as_content(parser: str, text: str, content: str) -> None:
    check_malformed(make(parser), text, content)
