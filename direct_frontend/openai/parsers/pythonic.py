"""Pythonic calls: ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2 / 4, ToolACE, ...).

The output is a call list only if it starts with ``[`` (or Llama 4's
``<|python_start|>``); each call is read with :mod:`ast` once its closing
parenthesis arrives, so a call's name streams early and its arguments go out
whole. Only keyword arguments with literal values make a call.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from direct_frontend.openai.parsers.calls import LeadingCallsParser
from direct_frontend.openai.parsers.scan import BracketScanner

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"
_HEADER = re.compile(r"\s*(?P<name>[A-Za-z_][\w.]*)\s*(?=\()")
_WS = " \t\r\n"


def _arguments(call_text: str) -> str | None:
    """JSON arguments of one ``name(k=v, ...)`` call, None unless it is exactly that."""
    try:
        node = ast.parse(call_text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        values: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return None
            values[keyword.arg] = ast.literal_eval(keyword.value)
        return json.dumps(values, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonCallBody:
    """One ``name(...)`` call, ended by its closing parenthesis."""

    __slots__ = ("_scanner", "_text", "failed", "name")

    def __init__(self) -> None:
        self._scanner = BracketScanner(python=True)
        self._text = ""
        self.name: str | None = None
        self.failed = False

    def push(self, text: str) -> int:
        start = len(self._text)
        self._text += text
        if self.name is None:
            m = _HEADER.match(self._text)
            if m is None:
                if self._text.strip(_WS) and not re.fullmatch(r"\s*[A-Za-z_][\w.]*\s*", self._text):
                    self.failed = True
                return -1
            self.name = m.group("name")
            end = self._scanner.feed(self._text, m.end())
        else:
            end = self._scanner.feed(self._text, start)
        if end == -1:
            return -1
        self._text = self._text[:end]
        return end - start

    def take_arguments(self) -> str:
        return ""

    def close(self) -> str | None:
        if self.failed or self._scanner.depth > 0 or not self._scanner.started:
            return None
        return _arguments(self._text)


class PythonicParser(LeadingCallsParser):
    name = "pythonic"
    TRIGGER = START_TAG
    AFTER_TRIGGER = "start"

    def _step(self, text: str, final: bool) -> bool:
        if self._mode == "start":
            if text[0] == "[":
                self._mode = "list"
                self._consume(1)
            else:
                self._to_content()
        elif text[0] == ",":
            self._consume(1)
        elif text[0] == "]":
            rest = text[1:].lstrip(_WS)
            if END_TAG.startswith(rest) and not final and len(rest) < len(END_TAG):
                return False
            self._buf = rest.removeprefix(END_TAG)
            self._mode, self._opening = "content", ""
            self._after_call = True
        else:
            self._begin_call(PythonCallBody(), self._opening)
        return True
