"""Mistral calls after ``[TOOL_CALLS]``, in both of Mistral's forms.

* Pre-v11 tokenizers (Mistral-7B-Instruct-v0.3, Mixtral 8x22B, Nemo): a JSON
  array of ``{"name": ..., "arguments": {...}}`` objects (Nemo adds an ``id``).
* v11 and later (Mistral-Small-3.x, Magistral, Devstral, Ministral 3):
  ``[TOOL_CALLS]NAME[ARGS]{json}`` per call (with ``[CALL_ID]id`` before
  ``[ARGS]`` on some), repeated for parallel calls.

The form is read from the first character after the marker, so one parser
serves every Mistral model. ``[TOOL_CALLS]`` and ``[ARGS]`` are control tokens:
the detokenizer must keep special tokens for this parser.
"""

from __future__ import annotations

import re
from typing import Any

from direct_frontend.openai.parsers.calls import CallParser, JsonArgsBody, envelope_body

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*(?P<name>[^\s\[{]+)\s*(?:\[CALL_ID\][^\[{]*)?(?:\[ARGS\])?\s*(?=\{)")
_WS = " \t\r\n"


class MistralParser(CallParser):
    name = "mistral"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode = "content"  # content | marker (form not known yet) | array
        self._opening = ""  # text consumed since the last call, for a malformed one's content

    def _scan(self, final: bool) -> None:
        while True:
            if self._body is not None:
                if not self._call_self_delimited():
                    return
                self._opening = ""
                if not self._last_ok:
                    self._mode = "content"
                continue
            if self._mode == "content":
                if self._content_until((MARKER,), final) is None:
                    return
                self._mode, self._opening = "marker", MARKER
                continue
            stripped = self._buf.lstrip(_WS)
            if not stripped:
                if final:
                    self._content(self._opening)
                    self._opening, self._mode = "", "content"
                return
            self._opening += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            head = stripped[0]
            if self._mode == "marker" and head == "[":
                self._mode, self._opening, self._buf = "array", self._opening + "[", stripped[1:]
            elif self._mode == "marker":
                self._mode = "content"
                self._begin_call(JsonArgsBody(_NAMED, self_delimited=True), self._opening)
            elif head == ",":
                self._opening, self._buf = self._opening + ",", stripped[1:]
            elif head == "]":
                self._mode, self._opening, self._buf = "content", "", stripped[1:]
            elif head == "{":
                self._begin_call(envelope_body(self_delimited=True), self._opening)
            else:  # not a call array after all
                self.malformed += 1
                self._content(self._opening)
                self._mode, self._opening = "content", ""
