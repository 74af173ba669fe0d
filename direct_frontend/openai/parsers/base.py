"""What every output parser speaks: deltas in OpenAI's streaming shape, and the parsed message.

A parser is fed the detokenized text of one choice piece by piece and answers
each piece with a :class:`ParsedDelta`; ``finish()`` flushes what it held back.
The non-streaming message is :func:`collect` of the same deltas, so the two
paths cannot disagree. Parsers never raise on model output: what does not
parse comes back as content and is counted in ``malformed``.
"""

from __future__ import annotations

import dataclasses
import secrets
import string
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol

from direct_frontend.openai.types import ToolCall, ToolCallFunction

#: what a parser knows of the request's tools: name -> JSON schema of the parameters
ToolSchemas = Mapping[str, Mapping[str, Any] | None]

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An id in OpenAI's shape: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclasses.dataclass(slots=True)
class ToolCallDelta:
    """One piece of one tool call, as a ``choices[].delta.tool_calls[]`` entry.

    The first piece of a call carries ``id`` and ``name`` (and ``type`` on the
    wire); later pieces only ``index`` and an ``arguments`` fragment.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The delta entry exactly as OpenAI streams it."""
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclasses.dataclass(slots=True)
class ParsedDelta:
    """What one piece of model text turned into (any part may be empty)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.add_calls(other.tool_calls)

    def add_calls(self, pieces: Iterable[ToolCallDelta]) -> None:
        """Add call pieces, one entry per call: a piece of a call already here is folded into
        its entry, as OpenAI streams a chunk (a client may read each entry as a call piece of
        its own, and one naming no call as a call without a name)."""
        calls = self.tool_calls
        for piece in pieces:
            at = next((k for k in range(len(calls) - 1, -1, -1)
                       if calls[k].index == piece.index), None)
            if at is None:
                calls.append(piece)
                continue
            entry = calls[at]
            calls[at] = ToolCallDelta(
                entry.index, entry.arguments + piece.arguments,
                entry.id if entry.id is not None else piece.id,
                entry.name if entry.name is not None else piece.name,
            )


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedMessage:
    """The non-streaming ``choices[].message``: every delta of a choice put together."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]


def collect(deltas: Iterable[ParsedDelta]) -> ParsedMessage:
    """Concatenate deltas the way a client accumulates a stream."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments...]
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            entry = calls.setdefault(piece.index, ["", ""])
            if piece.id is not None:
                entry[0] = piece.id
            if piece.name is not None:
                entry[1] = piece.name
            entry.append(piece.arguments)
    return ParsedMessage(
        content="".join(content),
        reasoning="".join(reasoning),
        tool_calls=tuple(
            ToolCall(id=e[0], function=ToolCallFunction(name=e[1], arguments="".join(e[2:])))
            for _, e in sorted(calls.items())
        ),
    )


def finish_reason(engine_reason: str, made_tool_calls: bool) -> str:
    """OpenAI's ``finish_reason``: a natural stop after tool calls is ``"tool_calls"``.

    A stop for length (or anything else) stays as the engine said, so a client
    can tell a call cut by ``max_tokens`` from a finished one.
    """
    return "tool_calls" if made_tool_calls and engine_reason == "stop" else engine_reason


class OutputParser(Protocol):
    """Text deltas of one choice in, :class:`ParsedDelta` out; ``finish`` flushes.

    ``malformed`` counts calls (or blocks) that did not parse and came back as
    content; ``tool_calls_made`` counts calls emitted, for :func:`finish_reason`.
    """

    name: ClassVar[str]
    malformed: int
    tool_calls_made: int

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


#: how a parser is built: tools of the request, eager argument streaming, id source
ParserFactory = Callable[..., OutputParser]
