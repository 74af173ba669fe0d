"""Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>``.

The templates ask for a bare JSON object as the whole reply; the model
sometimes puts ``<|python_tag|>`` first (a special token: keep special tokens
when detokenizing) and separates parallel calls with ``;``. Output is taken as
calls only if it starts with the tag or a ``{``; anything else is content.
"""

from __future__ import annotations

from typing import Any

from direct_frontend.openai.parsers.calls import CallParser, envelope_body

TAG = "<|python_tag|>"
_WS = " \t\r\n"


class Llama3JsonParser(CallParser):
    name = "llama3_json"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode = "start"  # start | calls | content

    def _scan(self, final: bool) -> None:
        while True:
            if self._body is not None:
                if not self._call_self_delimited():
                    return
                if not self._last_ok:
                    self._mode = "content"
                continue
            if self._mode == "content":
                if self._content_until((TAG,), final) is None:
                    return
                self._mode = "calls"
                continue
            stripped = self._buf.lstrip(_WS + (";" if self._mode == "calls" else ""))
            if not stripped:
                return
            if self._mode == "start" and stripped.startswith(TAG):
                self._buf, self._mode = stripped[len(TAG):], "calls"
            elif self._mode == "start" and TAG.startswith(stripped) and not final:
                return
            elif stripped[0] == "{":
                self._buf, self._mode = stripped, "calls"
                self._begin_call(envelope_body(self_delimited=True), "")
            else:
                self._mode = "content"
