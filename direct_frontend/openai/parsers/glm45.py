"""GLM-4.5 / 4.6 / 4.7 calls: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…``.

GLM-4.5 and 4.6 put a newline after the name and between pairs, GLM-4.7
none; both are read. A call without arguments is ``<tool_call>NAME</tool_call>``.
Values are typed by the tool's parameter schema (xml_params.py).
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.calls import CallBody, TaggedCallParser
from direct_frontend.openai.parsers.xml_params import TaggedParamsBody

_HEADER = re.compile(r"\s*(?P<name>[^\s<]+)[ \t]*(?:\n|(?=<arg_key>))")
_BARE = re.compile(r"\s*(?P<name>[^\s<]+)\s*")
_PAIR = re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>", re.DOTALL)


class Glm45Parser(TaggedCallParser):
    name = "glm45"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def _new_body(self) -> CallBody:
        return TaggedParamsBody(self.tools, header=_HEADER, pair_open=_PAIR,
                                value_end="</arg_value>", openers=("<arg_key>",), bare=_BARE)
