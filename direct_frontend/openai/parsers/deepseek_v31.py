"""DeepSeek V3.1+ calls: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>``.

Fits DeepSeek-V3.1, V3.1-Terminus and V3.2(-Exp), in thinking and
non-thinking mode (reasoning itself is the ``deepseek_r1`` reasoning parser).
"""

from __future__ import annotations

import dataclasses
import re

from direct_frontend.openai.parsers.calls import JsonArgsBody
from direct_frontend.openai.parsers.deepseek_v3 import DeepSeekV3Parser

_HEADER = re.compile(r"\s*(?P<name>[^\s<]+?)\s*<｜tool▁sep｜>\s*(?=\{)")


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    FORMAT = dataclasses.replace(DeepSeekV3Parser.FORMAT, body=lambda _tools: JsonArgsBody(_HEADER))
