"""Kimi K2 calls: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}``.

Fits Kimi-K2-Instruct (0711, 0905) and Kimi-K2-Thinking, inside
``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``. The
model's own ``functions.NAME:IDX`` id is not kept: ids follow OpenAI's shape
like every other parser's.
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.calls import CallBody, JsonArgsBody, SectionCallParser

_HEADER = re.compile(
    r"\s*(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>\s*(?=\{)"
)


class KimiK2Parser(SectionCallParser):
    name = "kimi_k2"
    SECTION_OPEN = "<|tool_calls_section_begin|>"
    SECTION_CLOSE = "<|tool_calls_section_end|>"
    CALL_OPEN = "<|tool_call_begin|>"
    CALL_CLOSE = "<|tool_call_end|>"

    def _new_body(self) -> CallBody:
        return JsonArgsBody(_HEADER)
