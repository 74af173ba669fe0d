"""Checks every parser test runs: each split of a model's output parses as the whole does."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from direct_frontend.openai.parsers.base import ParsedDelta, ParsedMessage, collect
from direct_frontend.openai.parsers.registry import ChoiceParser

#: what a test expects: content, reasoning, [(name, arguments as a dict)]
Expected = tuple[str, str, list[tuple[str, dict[str, Any]]]]


def counting_ids() -> Callable[[], str]:
    """Deterministic call ids, so two runs over one text compare equal."""
    counter = itertools.count()
    return lambda: f"call_{next(counter):024d}"


def make(tool: str | None = None, reasoning: str | None = None,
         **kwargs: Any) -> Callable[..., ChoiceParser]:
    """A parser factory; keywords given to the factory override those given here."""
    return lambda **over: ChoiceParser(tool_parser=tool, reasoning_parser=reasoning,
                                       **{"new_id": counting_ids(), **kwargs, **over})


def run(parser: ChoiceParser, pieces: Sequence[str]) -> tuple[ParsedMessage, list[ParsedDelta]]:
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return collect(deltas), deltas


def summary(message: ParsedMessage) -> Expected:
    return (message.content, message.reasoning,
            [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls])


def splits(text: str) -> list[list[str]]:
    """Every two-piece split, every three-piece split around each point, and one char at a time."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out += [[text[:i], text[i:i + 2], text[i + 2:]] for i in range(len(text))]
    out.append(list(text))
    return out


def check_shapes(deltas: list[ParsedDelta]) -> None:
    """OpenAI's streaming shape: a call's first piece names it, later ones only add arguments."""
    seen: set[int] = set()
    for delta in deltas:
        indexes = [piece.index for piece in delta.tool_calls]
        assert len(indexes) == len(set(indexes)), f"one entry per call in a delta: {delta}"
        for piece in delta.tool_calls:
            if piece.index not in seen:
                assert piece.id is not None and piece.id.startswith("call_"), piece
                assert piece.name, piece
                seen.add(piece.index)
            else:
                assert piece.id is None and piece.name is None, piece
    assert seen == set(range(len(seen)))


def check_output(factory: Callable[[], ChoiceParser], text: str, expected: Expected,
                 *, malformed: int = 0, markers: Sequence[str] = ()) -> None:
    """The whole text parses to ``expected``; every split streams to exactly the same message."""
    whole, deltas = run(factory(), [text])
    assert summary(whole) == expected
    check_shapes(deltas)
    for pieces in splits(text):
        parser = factory()
        streamed, deltas = run(parser, pieces)
        assert streamed == whole, pieces
        assert parser.malformed == malformed, pieces
        check_shapes(deltas)
    for marker in markers:
        assert marker not in whole.content and marker not in whole.reasoning


def check_malformed(factory: Callable[..., ChoiceParser], text: str, content: str) -> None:
    """Text that does not parse comes back as content, counted, for every split."""
    for pieces in splits(text):
        held = factory(stream_arguments=False)
        message, _ = run(held, pieces)
        assert message.content == content and not message.tool_calls, pieces
        assert held.malformed >= 1
        eager = factory()  # may have sent the call's start already: never raises, always counts
        run(eager, pieces)
        assert eager.malformed >= 1


def check_split(parser: str, text: str, cuts: Sequence[int], expected: Expected) -> None:
    """``text`` cut at ``cuts`` streams to what it parses to whole, which is ``expected``."""
    points = sorted(cuts)
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    factory = make(parser)
    whole, _ = run(factory(), [text])
    streamed, _ = run(factory(), pieces)
    assert streamed == whole
    assert summary(whole) == expected
