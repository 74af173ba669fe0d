"""Forced tool calls (``tool_choice`` ``"required"`` or named), as vLLM's own server does them.

A forced call is not left to the model's own call format: the request carries
a JSON-schema constraint the engine's grammar enforces, so the output is
well-formed by construction and needs no model-family parser:

* a named function: the output *is* that function's arguments (the schema is
  its ``parameters``), read by :class:`NamedCallParser`;
* ``"required"``: the output is a JSON array of ``{"name": ..., "parameters":
  {...}}`` objects, one per call (``maxItems: 1`` without
  ``parallel_tool_calls``), read by :class:`RequiredCallsParser`.

Both stream like every other parser: the first delta of a call carries its id
and name, later ones argument fragments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from direct_frontend.openai.parsers.base import ParsedDelta, ToolCallDelta, new_call_id
from direct_frontend.openai.parsers.mistral import MistralParser
from direct_frontend.openai.types import Tool

#: the schema of a function that declares no parameters: any JSON object
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_of(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def named_call_schema(tool: Tool) -> dict[str, Any]:
    """The constraint for a named function: its arguments object."""
    return parameters_of(tool)


def required_calls_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """The constraint for ``"required"``: an array of calls of the given tools."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters_of(tool),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedCallParser:
    """The whole output is the arguments of one call of ``function``."""

    name: ClassVar[str] = "named_function"

    def __init__(self, function: str, *, new_id: Callable[[], str] = new_call_id) -> None:
        self.function = function
        self.new_id = new_id
        self.malformed = 0
        self.tool_calls_made = 0
        self._arguments: list[str] = []

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        self._arguments.append(text)
        if self.tool_calls_made == 0:
            self.tool_calls_made = 1
            return ParsedDelta(tool_calls=[ToolCallDelta(0, text, self.new_id(), self.function)])
        return ParsedDelta(tool_calls=[ToolCallDelta(0, text)])

    def finish(self) -> ParsedDelta:
        try:
            ok = isinstance(json.loads("".join(self._arguments)), dict)
        except ValueError:
            ok = False
        if not ok:  # cut by max_tokens (the grammar allows nothing else): the call stays as sent
            self.malformed += 1
        return ParsedDelta()


class RequiredCallsParser(MistralParser):
    """A JSON array of ``{"name", "parameters"}`` calls from the first character on.

    The array form of Mistral's format without its marker: what follows the
    array (nothing, under the grammar) is content.
    """

    name = "required_function"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode, self._opening = "marker", ""
