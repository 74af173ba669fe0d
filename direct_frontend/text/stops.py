"""Stop strings, matched by the frontend on the detokenized stream.

Engines never see stop strings, so every engine kind stops at exactly the
same place. Text arrives in arbitrary chunks, so a stop string can straddle
chunks ("EN" + "D"): the matcher holds back just the longest tail that could
still grow into a stop string and releases it once it cannot (or at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    """What one push yields: text safe to emit now, and the stop string if one matched.

    A NamedTuple because one is built per token and tuples are the cheapest.
    """

    text: str
    matched: str | None = None


_NOTHING = StopResult("")


class StopStringMatcher:
    """Finds the first stop string in a stream of text chunks.

    "First" means the match that completes earliest in the stream, as if the
    text came one character at a time (so the result does not depend on how
    it was chunked); among matches completing at the same character the
    longest wins. Text from the start of the match on is never emitted, and
    after a match the matcher is done: further pushes yield nothing.
    """

    __slots__ = (
        "_done",
        "_first_chars",
        "_held",
        "_max_held",
        "_prefixes",
        "_stops",
        "_tail_chars",
    )

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        # Proper prefixes: a held tail is always one of these.
        self._prefixes = frozenset(s[:n] for s in self._stops for n in range(1, len(s)))
        self._max_held = max((len(s) - 1 for s in self._stops), default=0)
        # Quick rejects: a held tail starts with a stop's first character and
        # ends with a character found in some proper prefix.
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._tail_chars = frozenset("".join(self._prefixes))
        self._held = ""
        self._done = False

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings in use (empty ones and duplicates removed)."""
        return self._stops

    def push(self, text: str) -> StopResult:
        """Add a chunk; return what can be emitted and the stop string if one completed."""
        if self._done:
            return _NOTHING
        if not self._stops:
            return StopResult(text)
        buf = self._held + text if self._held else text
        if not buf:
            return _NOTHING

        match_start = -1
        match_end = len(buf) + 1
        matched: str | None = None
        for s in self._stops:
            start = buf.find(s)
            if start >= 0:
                end = start + len(s)
                if end < match_end or (end == match_end and start < match_start):
                    match_start, match_end, matched = start, end, s
        if matched is not None:
            self._done = True
            self._held = ""
            return StopResult(buf[:match_start], matched)

        if buf[-1] not in self._tail_chars:
            self._held = ""
            return StopResult(buf)
        first_chars = self._first_chars
        prefixes = self._prefixes
        size = len(buf)
        for i in range(max(0, size - self._max_held), size):
            if buf[i] in first_chars and buf[i:] in prefixes:
                self._held = buf[i:]
                return StopResult(buf[:i])
        self._held = ""
        return StopResult(buf)

    def flush(self) -> str:
        """End of stream: the held-back tail can no longer become a stop string."""
        held, self._held = self._held, ""
        return held
