"""DeepSeek V3 / R1 calls: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + fenced JSON.

Fits DeepSeek-V3, V3-0324 and R1 / R1-0528 (whose templates write the
arguments as a ```json block); V3.1 and later dropped the fence: see
:mod:`.deepseek_v31`.
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.calls import CallBody, JsonArgsBody, SectionCallParser

_HEADER = re.compile(r"\s*function<｜tool▁sep｜>(?P<name>[^\n<]+?)\s*```(?:json)?\s*(?=\{)")
_TAIL = re.compile(r"\s*```\s*")


class DeepSeekV3Parser(SectionCallParser):
    name = "deepseek_v3"
    SECTION_OPEN = "<｜tool▁calls▁begin｜>"
    SECTION_CLOSE = "<｜tool▁calls▁end｜>"
    CALL_OPEN = "<｜tool▁call▁begin｜>"
    CALL_CLOSE = "<｜tool▁call▁end｜>"

    def _new_body(self) -> CallBody:
        return JsonArgsBody(_HEADER, tail=_TAIL)
