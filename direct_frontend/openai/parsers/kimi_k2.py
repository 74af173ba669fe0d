"""Kimi K2 calls: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}``.

Fits Kimi-K2-Instruct (0711, 0905) and Kimi-K2-Thinking, inside
``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``. The
model's own ``functions.NAME:IDX`` id is not kept: ids follow OpenAI's shape
like every other parser's.
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.calls import JsonArgsBody, SectionCallParser, SectionFormat

_HEADER = re.compile(
    r"\s*(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>\s*(?=\{)"
)


class KimiK2Parser(SectionCallParser):
    name = "kimi_k2"
    FORMAT = SectionFormat(section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
                           call=("<|tool_call_begin|>", "<|tool_call_end|>"),
                           body=lambda _tools: JsonArgsBody(_HEADER))
