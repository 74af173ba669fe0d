"""A model's tool calls *or* the response format, as one structural tag for the engine's grammar.

An agent asks for tools and a response format on every turn: it means "call
a tool, or answer in this format" (OpenAI lets a tool call bypass the
format). A JSON-schema constraint alone would hold from the first token and
the model could never call a tool. A structural tag in xgrammar's format
says both, and vLLM's and SGLang's xgrammar backends compile it (here for
Hermes' calls)::

    {"type": "structural_tag", "format": {"type": "or", "elements": [
        {"type": "json_schema", "json_schema": <the response format's schema>},
        {"type": "tags_with_separator", "separator": "\\n", "at_least_one": true,
         "stop_after_first": <not parallel_tool_calls>,
         "tags": [<one call of one tool, in the model's own format>, ...]}]}}

Each tag is one call of one tool as the model's tool parser reads it, its
arguments under that tool's ``parameters`` schema, so a call is well-formed
by construction too; models that wrap their calls in a section (DeepSeek,
Kimi) have the list in a tag of its own. The shapes are those of xgrammar's
built-in tags for these models (what vLLM's own server sends). Only formats
whose call is a fixed text around a JSON object have one here
(:data:`FORMATS`); for any other, :func:`call_tags` is None and the caller
decides (pipeline/parsing.py). Llama 3's bare ``{"name": …, "parameters":
…}`` is left out on purpose: its parser would read the format's own JSON as
a call attempt.

Every JSON part bounds the whitespace between its tokens
(:data:`MAX_WHITESPACE`): inside a structural tag the engine's compact-JSON
setting (vLLM's ``disable_any_whitespace``) does not apply, and a model can
pad without end (a real vLLM's random-weight model did, to its token limit).
xgrammar ignores a key it does not know (0.2.8 was seen to), so an older one
takes the tag without the bound.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Final

from direct_frontend.engines.neutral import Constraint, ConstraintKind
from direct_frontend.openai.parsers.forced import ANY_OBJECT, parameters_of
from direct_frontend.openai.types import Tool


@dataclasses.dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model writes its calls, in structural-tag pieces.

    ``shapes`` are the (begin, end) texts around one call's arguments,
    ``{name}`` standing for the function's; ``numbered``, when set, follows
    ``begin`` after a call number (Kimi's ``functions.f:0``); ``section`` is
    the (begin, end) around all the calls of a reply.
    """

    shapes: tuple[tuple[str, str], ...]
    separator: str = ""
    section: tuple[str, str] | None = None
    numbered: str | None = None


_DS_CALLS: Final = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

#: tool parser -> its models' call format
FORMATS: Final[dict[str, CallFormat]] = {
    # a call on lines of its own or on one line (vLLM's tag takes both); a newline between calls
    "hermes": CallFormat((
        ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
        ('<tool_call>{{"name": "{name}", "arguments": ', "}</tool_call>"),
    ), separator="\n"),
    "deepseek_v3": CallFormat((
        ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
         "\n```<｜tool▁call▁end｜>"),
    ), section=_DS_CALLS),
    "deepseek_v31": CallFormat((
        ("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
    ), section=_DS_CALLS),
    "kimi_k2": CallFormat((
        ("<|tool_call_begin|>functions.{name}:", "<|tool_call_end|>"),
    ), section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        numbered="<|tool_call_argument_begin|>"),
}
#: the most whitespace characters in a row between JSON tokens: room for pretty-printed JSON
#: a few levels deep, none for padding without end
MAX_WHITESPACE: Final = 16


def json_part(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema element of a structural tag, its whitespace bounded."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def call_tags(parser: str | None, tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    """One tag per tool and call shape of ``parser``'s format; None: the format has none here."""
    form = FORMATS.get(parser) if parser is not None else None
    if form is None:
        return None
    tags = []
    for tool in tools:
        arguments = json_part(parameters_of(tool))
        content = arguments if form.numbered is None else {"type": "sequence", "elements": [
            {"type": "regex", "pattern": "[0-9]+"},
            {"type": "const_string", "value": form.numbered}, arguments]}
        tags += [{"type": "tag", "begin": begin.format(name=tool.function.name),
                  "content": content, "end": end} for begin, end in form.shapes]
    return tags


def calls_part(parser: str | None, tools: Sequence[Tool], parallel: bool) -> dict[str, Any] | None:
    """The element taking one call or more (one without ``parallel``) in ``parser``'s format."""
    tags = call_tags(parser, tools)
    if tags is None:
        return None
    form = FORMATS[parser] if parser is not None else None
    assert form is not None
    calls = {"type": "tags_with_separator", "tags": tags, "separator": form.separator,
             "at_least_one": True, "stop_after_first": not parallel}
    if form.section is None:
        return calls
    begin, end = form.section
    return {"type": "tag", "begin": begin, "content": calls, "end": end}


def format_schema(constraint: Constraint) -> dict[str, Any] | None:
    """The JSON schema a response format holds (None: not a JSON format)."""
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        schema: dict[str, Any] = json.loads(constraint.text)
        return schema
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return ANY_OBJECT
    return None


def tools_or_format(parser: str | None, tools: Sequence[Tool], parallel: bool,
                    response_format: Constraint) -> Constraint | None:
    """The "a call, or the format" constraint; None where ``parser``'s format has no tags here
    or the format is not JSON."""
    calls = calls_part(parser, tools, parallel)
    schema = format_schema(response_format)
    if calls is None or schema is None:
        return None
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [
        json_part(schema), calls]}}
    return Constraint(ConstraintKind.TOOLS_OR_FORMAT,
                      json.dumps(tag, separators=(",", ":"), ensure_ascii=False),
                      param=response_format.param)
