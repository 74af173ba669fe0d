"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Fits Hermes 2/3, Qwen2.5, Qwen3 (dense and MoE, instruct and thinking) and QwQ,
whose chat templates render tools this way. One call per tag pair; parallel
calls are consecutive pairs.
"""

from __future__ import annotations

from direct_frontend.openai.parsers.calls import CallParser, envelope_body

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(CallParser):
    name = "hermes"

    def _scan(self, final: bool) -> None:
        while True:
            if self._body is None:
                if self._content_until((OPEN,), final) is None:
                    return
                self._begin_call(envelope_body(), OPEN)
            elif not self._call_until(CLOSE, final):
                return
