"""DeepSeek V3 / R1 calls: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + fenced JSON.

Fits DeepSeek-V3, V3-0324 and R1 / R1-0528 (whose templates write the
arguments as a ```json block); V3.1 and later dropped the fence: see
:mod:`.deepseek_v31`.
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.calls import JsonArgsBody, SectionCallParser, SectionFormat

_HEADER = re.compile(r"\s*function<｜tool▁sep｜>(?P<name>[^\n<]+?)\s*```(?:json)?\s*(?=\{)")
_TAIL = re.compile(r"\s*```\s*")


class DeepSeekV3Parser(SectionCallParser):
    name = "deepseek_v3"
    FORMAT = SectionFormat(section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
                           call=("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
                           body=lambda _tools: JsonArgsBody(_HEADER, tail=_TAIL))
