"""Which parsers fit a model, read from its chat template (or, failing that, its model type).

The template is the better witness: it is what teaches the model its call
format, and fine-tunes keep their base's ``model_type`` while changing the
template. Rules go from the most specific markers to the least, and the
answer says which marker decided, for the log line the daemon writes.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Detection:
    tool_parser: str | None
    reasoning_parser: str | None
    reason: str


#: (markers that must all be in the template, tool parser, why)
_TOOL_RULES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("<|channel|>", "<|message|>"), "harmony", "Harmony channels (gpt-oss)"),
    (("｜DSML｜function_calls",), "deepseek_v32", "DeepSeek-V3.2 DSML function_calls"),
    (("｜DSML｜tool_calls",), "deepseek_v4", "DeepSeek-V4 DSML tool_calls"),
    (("<｜tool▁calls▁begin｜>", "```json"), "deepseek_v3",
     "DeepSeek tool markers with a ```json block"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v31", "DeepSeek tool markers without a ```json block"),
    (("<|tool_calls_section_begin|>",), "kimi_k2", "Kimi K2 tool-call section markers"),
    (("<minimax:tool_call>",), "minimax_m2", "MiniMax-M2 <minimax:tool_call> markers"),
    (("<function=", "<parameter="), "qwen3_coder", "Qwen3-Coder XML function markers"),
    (("<tool_call>", "<arg_key>"), "glm45", "GLM <arg_key>/<arg_value> call markers"),
    (("<tool_call>",), "hermes", "<tool_call> tags (Hermes / Qwen)"),
    (("[TOOL_CALLS]",), "mistral", "Mistral [TOOL_CALLS] token"),
    (("<|python_start|>",), "pythonic", "Llama 4 python markers"),
    (("<|header_start|>",), "pythonic", "Llama 4 headers"),
    (("<|python_tag|>",), "llama3_json", "Llama 3 <|python_tag|>"),
    (("<|eom_id|>",), "llama3_json", "Llama 3 <|eom_id|>"),
)
_REASONING_RULES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("<|channel|>", "<|message|>"), "harmony", "Harmony analysis channel"),
    (("[THINK]",), "mistral", "Mistral [THINK] token"),
    (("<｜Assistant｜>", "<think>"), "deepseek_r1", "DeepSeek template with <think>"),
    (("<minimax:tool_call>", "<think>"), "minimax_m2", "MiniMax-M2 template with <think>"),
    (("<arg_key>", "<think>"), "glm45", "GLM template with <think>"),
    (("<think>",), "qwen3", "<think> block in the template"),
)
#: model_type (config.json) -> (tool parser, reasoning parser)
_MODEL_TYPES: dict[str, tuple[str | None, str | None]] = {
    "gpt_oss": ("harmony", "harmony"),
    "qwen2": ("hermes", None),
    "qwen3": ("hermes", "qwen3"),
    "qwen3_moe": ("hermes", "qwen3"),
    "llama": ("llama3_json", None),
    "llama4": ("pythonic", None),
    "mistral": ("mistral", None),
    "mistral3": ("mistral", None),
    "deepseek_v3": ("deepseek_v3", "deepseek_r1"),
    "kimi_k2": ("kimi_k2", None),
    "glm4_moe": ("glm45", "glm45"),
    "minimax_m2": ("minimax_m2", "minimax_m2"),
}


def _first(template: str, rules: tuple[tuple[tuple[str, ...], str, str], ...],
           ) -> tuple[str, str] | None:
    for markers, parser, why in rules:
        if all(m in template for m in markers):
            return parser, why
    return None


def detect(chat_template: str | None, model_type: str | None = None) -> Detection:
    """The tool and reasoning parsers for a model, and why; ``None`` where nothing fits."""
    if chat_template:
        tool = _first(chat_template, _TOOL_RULES)
        reasoning = _first(chat_template, _REASONING_RULES)
        if tool is not None or reasoning is not None:
            parts = [f"tool parser {tool[0]!r}: {tool[1]}" if tool else "no tool-call markers",
                     f"reasoning parser {reasoning[0]!r}: {reasoning[1]}" if reasoning
                     else "no reasoning markers"]
            return Detection(tool[0] if tool else None, reasoning[0] if reasoning else None,
                             "chat template: " + "; ".join(parts))
    if model_type and model_type in _MODEL_TYPES:
        tool_name, reasoning_name = _MODEL_TYPES[model_type]
        return Detection(tool_name, reasoning_name, f"model_type {model_type!r}")
    return Detection(None, None, "no known markers in the chat template"
                     + (f" and unknown model_type {model_type!r}" if model_type else ""))
