"""MiniMax-M2 calls: ``<minimax:tool_call><invoke name="F"><parameter name="K">V</parameter>…``.

One ``<minimax:tool_call>`` section holds one ``<invoke>`` per call. Names
may be double-, single- or unquoted, as vLLM's parser takes them. Values
are typed by the tool's parameter schema (xml_params.py).
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.calls import CallBody, SectionCallParser
from direct_frontend.openai.parsers.xml_params import TaggedParamsBody

_QUOTED = r"(?P<q>[\"']?)(?P<{}>[^\"'>\s]+)(?P=q)\s*>"
_HEADER = re.compile(r"\s*" + _QUOTED.format("name"))
_PAIR = re.compile(r"\s*<parameter\s+name\s*=\s*" + _QUOTED.format("key"))


class MiniMaxM2Parser(SectionCallParser):
    name = "minimax_m2"
    SECTION_OPEN = "<minimax:tool_call>"
    SECTION_CLOSE = "</minimax:tool_call>"
    CALL_OPEN = "<invoke name="
    CALL_CLOSE = "</invoke>"

    def _new_body(self) -> CallBody:
        return TaggedParamsBody(self.tools, header=_HEADER, pair_open=_PAIR,
                                value_end="</parameter>", openers=("<parameter",))
