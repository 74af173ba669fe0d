"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Fits Hermes 2/3, Qwen2.5, Qwen3 (dense and MoE, instruct and thinking) and QwQ,
whose chat templates render tools this way. One call per tag pair; parallel
calls are consecutive pairs.
"""

from __future__ import annotations

from direct_frontend.openai.parsers.calls import CallBody, TaggedCallParser, envelope_body


class HermesParser(TaggedCallParser):
    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def _new_body(self) -> CallBody:
        return envelope_body()
