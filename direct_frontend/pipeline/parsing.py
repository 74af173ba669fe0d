"""Which output parsers a model's chat replies go through, and one parser per choice.

A model's parsers are settled once, when it is built: the fleet file's
``tool_parser`` / ``reasoning_parser``, ``"none"`` to turn one off, and unset
ones read from the chat template (or ``model_type``) by
:func:`~direct_frontend.openai.parsers.detect.detect`. Each chat choice then
gets its own parser (:func:`choice_parser`), kept with the choice's output
state, so a migrated stream goes on feeding the same object.

A forced call (``tool_choice`` ``"required"`` or named) is read by the
forced-call parsers instead of the model's: the engine's grammar shaped the
output into their JSON, not into the model's own call format.

A request with tools (``tool_choice`` ``"auto"``) and a JSON response format
is constrained to "a call in the model's format, or the format"
(:func:`with_tools_or_format`), since the format alone would keep the model
from ever calling a tool.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Final, Protocol

import msgspec

from direct_frontend.openai.parsers.base import ParsedDelta
from direct_frontend.openai.parsers.call_tags import format_schema, tools_or_format
from direct_frontend.openai.parsers.detect import detect
from direct_frontend.openai.parsers.forced import NamedCallParser, RequiredCallsParser
from direct_frontend.openai.parsers.registry import (
    REASONING_ALIASES,
    REASONING_PARSERS,
    TOOL_ALIASES,
    TOOL_PARSERS,
    ChoiceParser,
    resolve,
)
from direct_frontend.openai.parsers.think import prompt_reasoning_state
from direct_frontend.openai.types import ChatRequest

#: the fleet file's value that turns a parser off (auto-detection included)
OFF: Final = "none"
#: parsers whose markers are special tokens: the detokenizer must keep those
READS_SPECIAL_TOKENS: Final = frozenset(
    {"mistral", "harmony", "kimi_k2", "deepseek_v3", "deepseek_v31", "llama3_json", "pythonic"}
)


class ChoiceOutputParser(Protocol):
    """What the relay needs of a choice's parser (a ``ChoiceParser`` or a forced-call one)."""

    @property
    def malformed(self) -> int: ...

    @property
    def tool_calls_made(self) -> int: ...

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ModelParsers:
    """A model's tool and reasoning parsers (canonical names; None: none) and why."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    reason: str = "no parsers"

    @property
    def keeps_special_tokens(self) -> bool:
        return bool({self.tool_parser, self.reasoning_parser} & READS_SPECIAL_TOKENS)


NO_PARSERS: Final = ModelParsers()


def parser_problems(tool_parser: str | None, reasoning_parser: str | None) -> list[str]:
    """What is wrong with a model's parser names (empty: nothing), for the fleet-file error."""
    problems = []
    for field, name, names, aliases in (
        ("tool_parser", tool_parser, TOOL_PARSERS, TOOL_ALIASES),
        ("reasoning_parser", reasoning_parser, REASONING_PARSERS, REASONING_ALIASES),
    ):
        if name is not None and name != OFF:
            try:
                resolve(name, names, aliases)
            except ValueError as exc:
                problems.append(f"{field}: {exc} (or {OFF!r})")
    return problems


def model_parsers(tool_parser: str | None, reasoning_parser: str | None,
                  chat_template: str, model_type: str | None) -> ModelParsers:
    """The parsers of a model: as configured, the unset ones detected (names checked before)."""
    found = None
    if tool_parser is None or reasoning_parser is None:
        found = detect(chat_template, model_type)

    def pick(configured: str | None, detected: str | None, names: Mapping[str, object],
             aliases: dict[str, str]) -> str | None:
        if configured == OFF:
            return None
        if configured is not None:
            return resolve(configured, names, aliases)
        return detected

    tool = pick(tool_parser, found.tool_parser if found else None, TOOL_PARSERS, TOOL_ALIASES)
    reasoning = pick(reasoning_parser, found.reasoning_parser if found else None,
                     REASONING_PARSERS, REASONING_ALIASES)
    reason = "as the fleet file says" if found is None else found.reason
    return ModelParsers(tool, reasoning, reason)


log = logging.getLogger(__name__)
#: (model, tool parser) pairs already logged as running tools-with-format unconstrained
_WARNED: set[tuple[str, str]] = set()


def with_tools_or_format(request: ChatRequest, parsers: ModelParsers) -> ChatRequest:
    """``request`` with its response format widened to "a tool call, or the format".

    Only a request that offers tools with ``tool_choice`` ``"auto"`` and sets
    a JSON ``response_format`` (``text.format``) changes. A model without a
    tool parser keeps the format (no call could be read back anyway); one
    whose call format has no structural tag (openai/parsers/call_tags.py)
    runs unconstrained, so its tools stay callable, and the answer's JSON is
    the model's own (logged).
    """
    fmt = request.constraint
    if (fmt is None or fmt.param != "response_format" or not request.offers_tools
            or request.tool_choice != "auto" or parsers.tool_parser is None
            or format_schema(fmt) is None):
        return request
    widened = tools_or_format(parsers.tool_parser, request.tools, request.parallel_tool_calls,
                              fmt)
    if widened is None and (request.model, parsers.tool_parser) not in _WARNED:
        _WARNED.add((request.model, parsers.tool_parser))
        log.warning("model %s: tool parser %s has no structural tag, so its requests with "
                    "tools and a response format run without a constraint", request.model,
                    parsers.tool_parser)
    return msgspec.structs.replace(request, constraint=widened)


def choice_parser(parsers: ModelParsers, request: ChatRequest,
                  prompt: str) -> ChoiceOutputParser | None:
    """A fresh parser for one choice of ``request`` (None: its text is all content)."""
    schemas = ({t.function.name: t.function.parameters for t in request.tools}
               if request.offers_tools else None)
    if schemas is not None and request.tool_choice == "required":
        if request.tool_function is not None:
            return NamedCallParser(request.tool_function)
        return RequiredCallsParser(tools=schemas)
    tool = parsers.tool_parser if schemas is not None else None
    reasoning = parsers.reasoning_parser
    if tool is None and reasoning is None:
        return None
    # A stream sends a call's name and arguments as they come; a full reply waits for
    # the call to close well, so a malformed one is content there.
    return ChoiceParser(
        tool_parser=tool, reasoning_parser=reasoning, tools=schemas,
        stream_arguments=request.stream,
        starts_in_reasoning=prompt_reasoning_state(prompt),
    )


def parser_names(parser: ChoiceOutputParser) -> list[tuple[str, int]]:
    """(parser name, malformed count) of each part of ``parser``, for the metric."""
    if isinstance(parser, ChoiceParser):
        return [(p.name, p.malformed) for p in (parser.tools, parser.reasoning) if p is not None]
    assert isinstance(parser, NamedCallParser | RequiredCallsParser)
    return [(parser.name, parser.malformed)]


def open_reasoning_close(parser: ChoiceOutputParser) -> str | None:
    """The marker closing the choice's reasoning block while the text so far is inside it."""
    return parser.open_reasoning_close() if isinstance(parser, ChoiceParser) else None


def only_first_call(delta: ParsedDelta) -> ParsedDelta:
    """``parallel_tool_calls: false``: calls after the first are dropped."""
    if any(piece.index > 0 for piece in delta.tool_calls):
        delta.tool_calls = [piece for piece in delta.tool_calls if piece.index == 0]
    return delta
