"""Parsers by name, and the per-choice parser that chains reasoning before tool calls.

Names follow vLLM's and SGLang's flags where they agree, so a fleet file can
carry over the ``--tool-call-parser`` / ``--reasoning-parser`` it had; a few
aliases cover the other spellings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from direct_frontend.openai.parsers.base import OutputParser, ParsedDelta, ToolSchemas, new_call_id
from direct_frontend.openai.parsers.calls import CallParser
from direct_frontend.openai.parsers.deepseek_dsml import DeepSeekV4Parser, DeepSeekV32Parser
from direct_frontend.openai.parsers.deepseek_v3 import DeepSeekV3Parser
from direct_frontend.openai.parsers.deepseek_v31 import DeepSeekV31Parser
from direct_frontend.openai.parsers.glm45 import Glm45Parser
from direct_frontend.openai.parsers.harmony import HarmonyParser
from direct_frontend.openai.parsers.hermes import HermesParser
from direct_frontend.openai.parsers.kimi_k2 import KimiK2Parser
from direct_frontend.openai.parsers.llama3_json import Llama3JsonParser
from direct_frontend.openai.parsers.minimax_m2 import MiniMaxM2Parser
from direct_frontend.openai.parsers.mistral import MistralParser
from direct_frontend.openai.parsers.pythonic import PythonicParser
from direct_frontend.openai.parsers.qwen3_coder import Qwen3CoderParser
from direct_frontend.openai.parsers.think import MistralThinkParser, ThinkParser

TOOL_PARSERS: dict[str, type[CallParser]] = {
    cls.name: cls
    for cls in (HermesParser, Qwen3CoderParser, Llama3JsonParser, PythonicParser, MistralParser,
                DeepSeekV3Parser, DeepSeekV31Parser, DeepSeekV32Parser, DeepSeekV4Parser,
                KimiK2Parser, HarmonyParser, Glm45Parser, MiniMaxM2Parser)
}
TOOL_ALIASES: dict[str, str] = {
    "qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
    "llama4_pythonic": "pythonic", "deepseekv3": "deepseek_v3", "deepseekv31": "deepseek_v31",
    "deepseekv32": "deepseek_v32", "deepseekv4": "deepseek_v4",
    "openai": "harmony", "gpt_oss": "harmony", "qwen3_xml": "qwen3_coder",
    "glm4_moe": "glm45", "glm46": "glm45", "glm47": "glm45", "minimax": "minimax_m2",
}

#: reasoning parser name -> (class, whether the reply starts inside the block by default);
#: Harmony's reasoning is a channel its tool parser reads (None here)
REASONING_PARSERS: dict[str, tuple[type[ThinkParser] | None, bool]] = {
    "deepseek_r1": (ThinkParser, True),
    "qwen3": (ThinkParser, False),
    "kimi_k2": (ThinkParser, False),
    "glm45": (ThinkParser, False),
    "minimax_m2": (ThinkParser, True),  # it always thinks (vLLM's parser starts inside too)
    "mistral": (MistralThinkParser, False),
    "harmony": (None, False),
}
REASONING_ALIASES: dict[str, str] = {
    "deepseek_v3": "deepseek_r1", "deepseek_v31": "deepseek_r1", "qwen3_thinking": "qwen3",
    "deepseek_v32": "deepseek_r1", "deepseek_v4": "deepseek_r1",
    "magistral": "mistral", "gpt_oss": "harmony", "openai": "harmony",
    "glm4_moe": "glm45", "glm46": "glm45", "glm47": "glm45", "minimax": "minimax_m2",
    "minimax_m2_append_think": "minimax_m2",
}


def tool_parser_names() -> list[str]:
    return sorted(TOOL_PARSERS)


def reasoning_parser_names() -> list[str]:
    return sorted(REASONING_PARSERS)


def resolve(name: str, names: Mapping[str, Any], aliases: Mapping[str, str]) -> str:
    """The canonical parser name for ``name`` (or an alias); ValueError listing the known ones."""
    key = name.strip().lower().replace("-", "_")
    key = aliases.get(key, key)
    if key not in names:
        raise ValueError(f"unknown parser {name!r}; known: {', '.join(sorted(names))}")
    return key


class ChoiceParser:
    """One choice's output parsing: reasoning split off first, then tool calls in the content.

    Harmony does both in one pass (its channels carry both), so when either
    side is Harmony it alone reads the text.
    """

    def __init__(self, *, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 tools: ToolSchemas | None = None, stream_arguments: bool = True,
                 starts_in_reasoning: bool | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.tools: OutputParser | None = None
        self.reasoning: OutputParser | None = None
        if tool_parser is not None:
            cls = TOOL_PARSERS[resolve(tool_parser, TOOL_PARSERS, TOOL_ALIASES)]
            self.tools = cls(tools=tools, stream_arguments=stream_arguments, new_id=new_id)
        if reasoning_parser is not None:
            rcls, inside = REASONING_PARSERS[resolve(reasoning_parser, REASONING_PARSERS,
                                                     REASONING_ALIASES)]
            if rcls is None:
                if not isinstance(self.tools, HarmonyParser):
                    self.tools = HarmonyParser(tools=tools, stream_arguments=stream_arguments,
                                               new_id=new_id)
            elif not isinstance(self.tools, HarmonyParser):
                start = inside if starts_in_reasoning is None else starts_in_reasoning
                self.reasoning = rcls(starts_in_reasoning=start)

    @property
    def malformed(self) -> int:
        return sum(p.malformed for p in (self.tools, self.reasoning) if p is not None)

    def open_reasoning_close(self) -> str | None:
        """The marker that closes the reasoning block while the text so far is inside it;
        None otherwise (no block open, or a parser whose block no marker closes)."""
        reasoning = self.reasoning
        if isinstance(reasoning, ThinkParser) and reasoning.reasoning_open:
            return reasoning.CLOSE
        return None

    @property
    def tool_calls_made(self) -> int:
        return self.tools.tool_calls_made if self.tools is not None else 0

    def feed(self, text: str) -> ParsedDelta:
        if self.reasoning is None:
            return self.tools.feed(text) if self.tools is not None else ParsedDelta(content=text)
        out = self.reasoning.feed(text)
        return self._tools_on(out, final=False)

    def finish(self) -> ParsedDelta:
        if self.reasoning is None:
            return self.tools.finish() if self.tools is not None else ParsedDelta()
        return self._tools_on(self.reasoning.finish(), final=True)

    def _tools_on(self, out: ParsedDelta, final: bool) -> ParsedDelta:
        if self.tools is None:
            return out
        parsed = self.tools.feed(out.content) if out.content else ParsedDelta()
        if final:
            parsed.extend(self.tools.finish())
        parsed.reasoning = out.reasoning + parsed.reasoning
        return parsed
