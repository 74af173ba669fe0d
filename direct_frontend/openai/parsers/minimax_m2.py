"""MiniMax-M2 calls: ``<minimax:tool_call><invoke name="F"><parameter name="K">V</parameter>…``.

One ``<minimax:tool_call>`` section holds one ``<invoke>`` per call. Names
may be double-, single- or unquoted, as vLLM's parser takes them. Values
are typed by the tool's parameter schema (xml_params.py).
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.calls import SectionCallParser, SectionFormat
from direct_frontend.openai.parsers.xml_params import TaggedParamsBody

_QUOTED = r"(?P<q>[\"']?)(?P<{}>[^\"'>\s]+)(?P=q)\s*>"
_HEADER = re.compile(r"\s*" + _QUOTED.format("name"))
_PAIR = re.compile(r"\s*<parameter\s+name\s*=\s*" + _QUOTED.format("key"))


class MiniMaxM2Parser(SectionCallParser):
    name = "minimax_m2"
    FORMAT = SectionFormat(
        section=("<minimax:tool_call>", "</minimax:tool_call>"),
        call=("<invoke name=", "</invoke>"),
        body=lambda tools: TaggedParamsBody(tools, header=_HEADER, pair_open=_PAIR,
                                            value_end="</parameter>", openers=("<parameter",)))
