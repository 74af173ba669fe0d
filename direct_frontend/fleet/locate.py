"""Find the line of a key in TOML text, for error messages.

``tomllib`` returns plain values with no positions, so problems found after
parsing would have no line number. This module re-scans the raw text for
table headers, keys (bare, quoted, dotted), inline-table keys and array
elements and records the first line of each, by the same path the loader
checks. It only ever runs on text ``tomllib`` accepted, and it is best
effort: anything it cannot follow just has no line.

Paths are tuples of keys and 1-based array indexes, so the second
``[[engine]]``'s ``url`` is ``("engine", 2, "url")``.
"""

from __future__ import annotations

import bisect
import contextlib
import tomllib

PathKey = str | int
KeyPath = tuple[PathKey, ...]

_BARE_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_SCALAR_END = frozenset(",]}#\n\r")


class _Unfollowable(Exception):
    """The scanner met text it cannot follow; keep what was found so far."""


class Locator:
    """Lines of the tables, keys and array elements of one TOML text."""

    def __init__(self, text: str) -> None:
        self._lines: dict[KeyPath, int] = {}
        # Where a truncated file ends: its last line with anything on it.
        self.last_line = max(1, len(text.rstrip().splitlines()))
        self._scanner = _Scanner(text, self._lines)
        with contextlib.suppress(_Unfollowable, IndexError):
            self._scanner.document()

    def line_of(self, path: KeyPath) -> int | None:
        """The line of ``path``, else of its nearest ancestor found, else ``None``.

        Falling back to the ancestor puts "missing key" problems on the line
        of the table that lacks the key.
        """
        for end in range(len(path), 0, -1):
            line = self._lines.get(path[:end])
            if line is not None:
                return line
        return None


class _Scanner:
    """A forgiving walk over TOML text that records where each path starts."""

    def __init__(self, text: str, lines: dict[KeyPath, int]) -> None:
        self.text = text
        self.pos = 0
        self.lines = lines
        self.line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        self.array_counts: dict[KeyPath, int] = {}  # arrays of tables: elements so far

    # -- bookkeeping ---------------------------------------------------------

    def line_at(self, pos: int) -> int:
        return bisect.bisect_right(self.line_starts, pos)

    def record(self, path: KeyPath, pos: int) -> None:
        line = self.line_at(pos)
        for end in range(1, len(path) + 1):
            self.lines.setdefault(path[:end], line)

    def peek(self, ahead: int = 0) -> str:
        at = self.pos + ahead
        return self.text[at] if at < len(self.text) else ""

    def skip_blank(self, *, newlines: bool) -> None:
        """Skip spaces and comments, and newlines too where the grammar allows them."""
        text = self.text
        while self.pos < len(text):
            ch = text[self.pos]
            if ch in " \t" or (newlines and ch in "\r\n"):
                self.pos += 1
            elif ch == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            else:
                return

    def expect(self, token: str) -> None:
        if not self.text.startswith(token, self.pos):
            raise _Unfollowable(self.pos)
        self.pos += len(token)

    # -- grammar -------------------------------------------------------------

    def document(self) -> None:
        table: KeyPath = ()
        while True:
            self.skip_blank(newlines=True)
            if self.pos >= len(self.text):
                return
            start = self.pos
            if self.text.startswith("[[", self.pos):
                self.pos += 2
                table = self.resolve(self.key(), new_element=True)
                self.skip_blank(newlines=False)
                self.expect("]]")
                self.record(table, start)
            elif self.peek() == "[":
                self.pos += 1
                table = self.resolve(self.key(), new_element=False)
                self.skip_blank(newlines=False)
                self.expect("]")
                self.record(table, start)
            else:
                self.key_value(table)

    def resolve(self, parts: list[str], *, new_element: bool) -> KeyPath:
        """Turn header keys into a path, stepping into the latest array-of-tables element."""
        path: KeyPath = ()
        for i, part in enumerate(parts):
            path += (part,)
            if new_element and i == len(parts) - 1:
                count = self.array_counts.get(path, 0) + 1
                self.array_counts[path] = count
                path += (count,)
            elif path in self.array_counts:
                path += (self.array_counts[path],)
        return path

    def key_value(self, table: KeyPath) -> None:
        start = self.pos
        path = table + tuple(self.key())
        self.record(path, start)
        self.skip_blank(newlines=False)
        self.expect("=")
        self.skip_blank(newlines=False)
        self.value(path)

    def key(self) -> list[str]:
        """A dotted key: bare or quoted parts separated by dots."""
        parts: list[str] = []
        while True:
            self.skip_blank(newlines=False)
            ch = self.peek()
            if ch and ch in "\"'":
                start = self.pos
                self.string()
                quoted = self.text[start : self.pos]
                parts.append(tomllib.loads(f"k = {quoted}")["k"])
            else:
                start = self.pos
                while self.peek() and self.peek() in _BARE_KEY_CHARS:
                    self.pos += 1
                if self.pos == start:
                    raise _Unfollowable(self.pos)
                parts.append(self.text[start : self.pos])
            self.skip_blank(newlines=False)
            if self.peek() != ".":
                return parts
            self.pos += 1

    def value(self, path: KeyPath) -> None:
        ch = self.peek()
        if ch and ch in "\"'":
            self.string()
        elif ch == "[":
            self.array(path)
        elif ch == "{":
            self.inline_table(path)
        else:
            start = self.pos
            while self.pos < len(self.text) and self.text[self.pos] not in _SCALAR_END:
                self.pos += 1
            if self.pos == start:
                raise _Unfollowable(self.pos)

    def string(self) -> None:
        """Skip a basic, literal or multi-line string of either kind."""
        text = self.text
        quote = text[self.pos]
        delimiter = quote * 3 if text.startswith(quote * 3, self.pos) else quote
        self.pos += len(delimiter)
        escapes = quote == '"'
        while self.pos < len(text):
            if escapes and text[self.pos] == "\\":
                self.pos += 2
            elif text.startswith(delimiter, self.pos):
                self.pos += len(delimiter)
                if len(delimiter) == 3:  # up to two quotes may end the content
                    for _ in range(2):
                        if self.peek() == quote:
                            self.pos += 1
                return
            else:
                self.pos += 1
        raise _Unfollowable(self.pos)

    def array(self, path: KeyPath) -> None:
        self.expect("[")
        index = 0
        while True:
            self.skip_blank(newlines=True)
            if self.peek() == "]":
                self.pos += 1
                return
            index += 1
            self.record((*path, index), self.pos)
            self.value((*path, index))
            self.skip_blank(newlines=True)
            if self.peek() == ",":
                self.pos += 1

    def inline_table(self, path: KeyPath) -> None:
        self.expect("{")
        while True:
            self.skip_blank(newlines=False)
            if self.peek() == "}":
                self.pos += 1
                return
            self.key_value(path)
            self.skip_blank(newlines=False)
            if self.peek() == ",":
                self.pos += 1
