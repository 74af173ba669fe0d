"""Auto-detection from chat templates and model types; the registry's names."""

from __future__ import annotations

import pytest

from direct_frontend.openai.parsers.detect import detect
from direct_frontend.openai.parsers.registry import (
    TOOL_ALIASES,
    TOOL_PARSERS,
    ChoiceParser,
    resolve,
)


@pytest.mark.parametrize(("template", "tool", "reasoning"), [
    ("{% for tool in tools %}<tool_call>\n{{ tool | tojson }}\n</tool_call>{% endfor %}<think>",
     "hermes", "qwen3"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", "qwen3_coder", None),
    ("<|start|>{{ role }}<|channel|>analysis<|message|>", "harmony", "harmony"),
    ("<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ t }}<｜tool▁sep｜>"
     "\n```json\n<think>",
     "deepseek_v3", "deepseek_r1"),
    ("<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>",
     "deepseek_v31", None),
    ("<|tool_calls_section_begin|>", "kimi_k2", None),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS][THINK]", "mistral", "mistral"),
    ("<|header_start|>assistant<|header_end|>", "pythonic", None),
    ("<|start_header_id|>ipython<|end_header_id|><|eom_id|>", "llama3_json", None),
])
def test_templates(template: str, tool: str | None, reasoning: str | None) -> None:
    found = detect(template)
    assert (found.tool_parser, found.reasoning_parser) == (tool, reasoning)
    assert found.reason.startswith("chat template")
    ChoiceParser(tool_parser=found.tool_parser, reasoning_parser=found.reasoning_parser)


def test_model_type_when_the_template_says_nothing() -> None:
    assert detect("{{ messages }}", "qwen3_moe").tool_parser == "hermes"
    assert detect(None, "gpt_oss").reasoning_parser == "harmony"
    assert detect(None, "gpt2").tool_parser is None


def test_aliases_and_unknown_names() -> None:
    assert all(resolve(a, TOOL_PARSERS, TOOL_ALIASES) in TOOL_PARSERS for a in TOOL_ALIASES)
    assert resolve("Llama3-JSON", TOOL_PARSERS, TOOL_ALIASES) == "llama3_json"
    with pytest.raises(ValueError, match="known: deepseek_v3"):
        resolve("nope", TOOL_PARSERS, TOOL_ALIASES)
