"""Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>``.

The templates ask for a bare JSON object as the whole reply; the model
sometimes puts ``<|python_tag|>`` first (a special token: keep special tokens
when detokenizing) and separates parallel calls with ``;``. Output is taken as
calls only if it starts with the tag or a ``{``; anything else is content.
"""

from __future__ import annotations

from direct_frontend.openai.parsers.calls import LeadingCallsParser, envelope_body

TAG = "<|python_tag|>"


class Llama3JsonParser(LeadingCallsParser):
    name = "llama3_json"
    TRIGGER = TAG
    AFTER_TRIGGER = "calls"

    def _step(self, text: str, final: bool) -> bool:
        if text[0] == "{":
            self._mode = "calls"
            self._begin_call(envelope_body(self_delimited=True), self._opening)
        elif self._mode == "calls" and text[0] == ";":
            self._consume(1)
        else:
            self._to_content()
        return True
