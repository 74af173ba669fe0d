"""A model's tool calls *or* the response format, as one structural tag for the engine's grammar.

An agent asks for tools and a response format on every turn: it means "call
a tool, or answer in this format" (OpenAI lets a tool call bypass the
format). A JSON-schema constraint alone would hold from the first token and
the model could never call a tool. A structural tag in xgrammar's format
says both, and vLLM's and SGLang's xgrammar backends compile it::

    {"type": "structural_tag", "format": {"type": "or", "elements": [
        {"type": "json_schema", "json_schema": <the response format's schema>},
        {"type": "tags_with_separator", "separator": "\\n", "at_least_one": true,
         "stop_after_first": <not parallel_tool_calls>,
         "tags": [<one call of one tool, in the model's own format>, ...]}]}}

Each tag is one call of one tool as the model's tool parser reads it, its
arguments under that tool's ``parameters`` schema, so a call is well-formed
by construction too. Only formats whose call is a fixed text around a JSON
object have a tag here (:data:`FORMATS`); for any other, :func:`call_tags`
is None and the caller decides (pipeline/parsing.py).

Every JSON part bounds the whitespace between its tokens
(:data:`MAX_WHITESPACE`): inside a structural tag the engine's compact-JSON
setting (vLLM's ``disable_any_whitespace``) does not apply, and a model can
pad without end (a real vLLM's random-weight model did, to its token limit).
xgrammar ignores a key it does not know (0.2.8 was seen to), so an older one
takes the tag without the bound.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from direct_frontend.engines.neutral import Constraint, ConstraintKind
from direct_frontend.openai.parsers.forced import ANY_OBJECT, parameters_of
from direct_frontend.openai.types import Tool

#: tool parser -> the (begin, end) texts around one call's arguments, ``{name}`` the function's;
#: Hermes' models write a call on lines of its own or on one line (vLLM's tag takes both)
FORMATS: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    "hermes": (
        ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
        ('<tool_call>{{"name": "{name}", "arguments": ', "}</tool_call>"),
    ),
}

#: what separates parallel calls (the models' templates put a newline between them)
SEPARATOR: Final = "\n"
#: the most whitespace characters in a row between JSON tokens: room for pretty-printed JSON
#: a few levels deep, none for padding without end
MAX_WHITESPACE: Final = 16


def json_part(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema element of a structural tag, its whitespace bounded."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def call_tags(parser: str | None, tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    """One tag per tool and call shape of ``parser``'s format; None: the format has none here."""
    shapes = FORMATS.get(parser) if parser is not None else None
    if shapes is None:
        return None
    return [
        {"type": "tag", "begin": begin.format(name=tool.function.name),
         "content": json_part(parameters_of(tool)), "end": end}
        for tool in tools
        for begin, end in shapes
    ]


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
    tags = call_tags(parser, tools)
    schema = format_schema(response_format)
    if tags is None or schema is None:
        return None
    calls = {"type": "tags_with_separator", "tags": tags, "separator": SEPARATOR,
             "at_least_one": True, "stop_after_first": not parallel}
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [
        json_part(schema), calls]}}
    return Constraint(ConstraintKind.TOOLS_OR_FORMAT,
                      json.dumps(tag, separators=(",", ":"), ensure_ascii=False),
                      param=response_format.param)
