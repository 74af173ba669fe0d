"""Text scanning shared by the parsers: markers split across deltas, and bracket ends.

Both are incremental and cost O(new text) per delta, so a parser never
re-reads what it already decided on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def safe_end(text: str, markers: Sequence[str]) -> int:
    """How much of ``text`` can be released: all but the longest tail that may start a marker.

    The tail held back is never longer than the longest marker minus one, so
    unrelated text waits only for what is really ambiguous.
    """
    end = n = len(text)
    for marker in markers:
        first = marker[0]
        i = text.find(first, max(0, n - len(marker) + 1))
        while i != -1 and i < end:
            if marker.startswith(text[i:]):
                end = i
                break
            i = text.find(first, i + 1)
    return end


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
    """The earliest marker in ``text`` from ``start``: (index, marker), or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        limit = best + len(marker) - 1 if best != -1 else len(text)
        i = text.find(marker, start, limit)
        if i != -1 and (best == -1 or i < best):
            best, found = i, marker
    return best, found


_JSON_OUTSIDE = re.compile(r'[{}\[\]"]')
_JSON_INSIDE = re.compile(r'["\\]')
_PY_OUTSIDE = re.compile(r"""[{}\[\]()"']""")
_OPEN = frozenset("{[(")
_CLOSE = frozenset("}])")


class BracketScanner:
    """Finds where a bracketed value ends, fed piece by piece; strings are skipped.

    Checks nesting only by depth, not by kind, and leaves the full check to
    ``json.loads`` / ``ast`` at the end: a scanner that validated everything
    would be a second parser to keep right.
    """

    __slots__ = ("_inside", "_outside", "_quote", "depth", "escape", "started")

    def __init__(self, *, python: bool = False) -> None:
        self._outside = _PY_OUTSIDE if python else _JSON_OUTSIDE
        self._inside: dict[str, re.Pattern[str]] = {
            '"': _JSON_INSIDE,
            "'": re.compile(r"['\\]"),
        }
        self._quote = ""  # the open string's quote, "" when outside strings
        self.depth = 0
        self.escape = False
        self.started = False

    def feed(self, text: str, start: int = 0) -> int:
        """Scan ``text[start:]``; return the index just past the value's end, or -1."""
        pos = start
        if self.escape and pos < len(text):
            self.escape = False
            pos += 1
        while True:
            quote = self._quote  # "" outside strings
            m = (self._inside[quote] if quote else self._outside).search(text, pos)
            if m is None:
                return -1
            pos = m.end()
            ch = m.group()
            if quote:
                if ch != "\\":  # the string's end
                    self._quote = ""
                elif pos < len(text):
                    pos += 1  # the escaped character
                else:  # it is the next piece's first
                    self.escape = True
                    return -1
            elif ch in _OPEN:
                self.depth += 1
                self.started = True
            elif ch in _CLOSE:
                self.depth -= 1
                if self.depth <= 0 and self.started:
                    return pos
            else:
                self._quote = ch
