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

from direct_frontend.openai.parsers.calls import JsonArgsBody, LeadingCallsParser, envelope_body

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*(?P<name>[^\s\[{]+)\s*(?:\[CALL_ID\][^\[{]*)?(?:\[ARGS\])?\s*(?=\{)")


class MistralParser(LeadingCallsParser):
    name = "mistral"
    TRIGGER = MARKER
    AFTER_TRIGGER = "marker"  # the form is not known yet
    FIRST_MODE = "content"

    def _step(self, text: str, final: bool) -> bool:
        head = text[0]
        if self._mode == "marker" and head == "[":
            self._mode = "array"
            self._consume(1)
        elif self._mode == "marker":
            self._mode = "content"
            self._begin_call(JsonArgsBody(_NAMED, self_delimited=True), self._opening)
        elif head in ",]":
            self._consume(1)
            if head == "]":
                self._mode, self._opening = "content", ""
        elif head == "{":
            self._begin_call(envelope_body(self_delimited=True), self._opening)
        else:  # not a call array after all
            self.malformed += 1
            self._to_content()
        return True
