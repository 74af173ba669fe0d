"""Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>``.

The templates ask for a bare JSON object as the whole reply; the model
sometimes puts ``<|python_tag|>`` first (a special token: keep special tokens
when detokenizing) and separates parallel calls with ``;``. Output is taken as
calls only if it starts with the tag or a ``{``; anything else is content.
"""

from __future__ import annotations

from typing import Any

from direct_frontend.openai.parsers.calls import LeadingCallsParser, envelope_body

TAG = "<|python_tag|>"


class Llama3JsonParser(LeadingCallsParser):
    name = "llama3_json"
    TRIGGER = TAG
    AFTER_TRIGGER = "calls"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("start", **kwargs)

    def _structure(self, text: str, final: bool) -> bool:
        if self._mode == "start":
            taken = self._trigger_at(text, final)
            if taken is not False:
                return taken is True  # or wait for more
        if text[0] == "{":
            self._mode = "calls"
            self._begin_call(envelope_body(self_delimited=True), self._opening)
        elif self._mode == "calls" and text[0] == ";":
            self._consume(1)
        else:
            self._to_content()
        return True
