"""Qwen3-Coder's XML calls: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...``.

Parameter values are bare text, so their JSON type comes from the tool's
parameter schema when the request gave one (a ``string`` stays text; numbers,
booleans, arrays and objects are read as JSON); without a schema a value that
reads as JSON is taken as such. Arguments stream one parameter at a time,
since a value's type is known only once it is complete.
"""

from __future__ import annotations

import re

from direct_frontend.openai.parsers.base import ToolSchemas
from direct_frontend.openai.parsers.calls import CallBody, TaggedCallParser
from direct_frontend.openai.parsers.scan import find_first
from direct_frontend.openai.parsers.xml_params import TypedArguments

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_FUNCTION_END = re.compile(r"\s*</function>")
_VALUE_ENDS = ("</parameter>", "\n<parameter=", "\n</function>")
_PREFIXES = ("<function=", "<parameter=", "</function>")


class XmlFunctionBody(TypedArguments):
    """One ``<function=...>`` element, parsed as its parameters complete."""

    __slots__ = ("_closed", "_from")

    def __init__(self, schemas: ToolSchemas | None) -> None:
        super().__init__(schemas)
        self._from = 0  # where to look for the end of the open value
        self._closed = False  # at ``</function>``: the text from ``_pos`` on is what follows it

    def _parse(self) -> None:
        if self._closed:
            return
        text = self._text
        if self.name is None:
            m = _FUNCTION.match(text)
            if m is None:
                self._check_opening(text.lstrip(), _PREFIXES)
                return
            self.name = m.group(1).strip()
            self._pos = m.end()
        while not self.failed:
            m = _PARAMETER.match(text, self._pos)
            if m is not None:
                i, marker = find_first(text, _VALUE_ENDS, max(m.end(), self._from))
                if i == -1:
                    self._from = max(m.end(), len(text) - len(_VALUE_ENDS[0]))
                    return
                self._add(m.group(1).strip(), text[m.end():i])
                self._pos = i + (len(marker) if marker == "</parameter>" else 0)
                self._from = 0
                continue
            m = _FUNCTION_END.match(text, self._pos)
            if m is not None:
                self._closed = True
                self._pos = m.end()
                return
            self._check_opening(text[self._pos:].lstrip(), _PREFIXES)
            return

    def _add(self, key: str, raw: str, string: str | None = None) -> None:
        super()._add(key, raw.removeprefix("\n").removesuffix("\n"), string)  # its own lines

    def close(self) -> str | None:
        if self.failed or not self._closed or self._text[self._pos:].strip():
            return None
        return self._rest()


class Qwen3CoderParser(TaggedCallParser):
    name = "qwen3_coder"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def _new_body(self) -> CallBody:
        return XmlFunctionBody(self.tools)
