"""Stop strings, matched by the frontend on the detokenized stream.

Engines never see stop strings, so every engine kind stops at exactly the
same place. Text arrives in arbitrary chunks, so a stop string can straddle
chunks ("EN" + "D"): the matcher holds back just the longest tail that could
still grow into a stop string and releases it once it cannot (or at the end).

Stop strings are client input, so matching costs time and memory linear in
the text and in the stop strings' length (a version that listed every prefix
of every stop string took gigabytes for one long stop): an Aho–Corasick
automaton over the stop strings follows the stream one character at a time,
and text that cannot start a stop string is skipped with one regular
expression search, so a stream that does not come near a stop string costs
one search per chunk.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    """What one push yields: text safe to emit now, and the stop string if one matched.

    A NamedTuple because one is built per token and tuples are the cheapest.
    """

    text: str
    matched: str | None = None


_NOTHING = StopResult("")


def _common_prefix_length(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (binary search, C-speed compares)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class _Automaton:
    """Aho–Corasick over the stop strings, with each state named (stop, depth).

    A state is a prefix of some stop string, ``stops[k][:d]``, so it needs no
    node of its own: its transitions follow stop k itself (``stops[k][d]``)
    and, where other stops part from that prefix, ``branches[k][d]`` (at most
    one entry per pair of stops). Per character of stop k it keeps its
    failure state (``fail_stop[k][d]``, ``fail_depth[k][d]``: the longest
    proper suffix that is a prefix of some stop) and ``found[k][d]``: the
    longest stop string that ends the state, or -1. Memory is a few bytes per
    character of the stop strings; building it is linear in their length.
    """

    __slots__ = ("branches", "fail_depth", "fail_stop", "found", "stops", "trigger")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        # Finds the next character that can start a stop string (text before it is let through).
        first_chars = dict.fromkeys(s[0] for s in stops)
        self.trigger = re.compile("[" + "".join(map(re.escape, first_chars)) + "]")
        self.branches: list[dict[int, dict[str, int]]] = [{} for _ in stops]
        ends: list[dict[int, int]] = [{len(s): k} for k, s in enumerate(stops)]
        for k, s in enumerate(stops):
            for j, other in enumerate(stops):
                if j == k:
                    continue
                shared = _common_prefix_length(s, other)
                if shared < len(other):  # other goes on where it parts from s (or s ends)
                    self.branches[k].setdefault(shared, {}).setdefault(other[shared], j)
                else:  # other is a prefix of s
                    ends[k][shared] = j
        self.fail_stop = [array("i", [0]) * (len(s) + 1) for s in stops]
        self.fail_depth = [array("i", [0]) * (len(s) + 1) for s in stops]
        self.found = [array("i", [-1]) * (len(s) + 1) for s in stops]
        self._fill_failures(ends)

    def _fill_failures(self, ends: list[dict[int, int]]) -> None:
        """Failure states and stops found, depth by depth (a failure is always shallower).

        Beyond the second longest stop only the longest is left, so its tail is
        filled in one run.
        """
        longest_first = sorted(range(len(self.stops)), key=lambda k: -len(self.stops[k]))
        for k in longest_first:  # depth 1 fails to the root
            self.found[k][1] = ends[k].get(1, -1)
        longest = longest_first[0]
        shared = len(self.stops[longest_first[1]]) if len(longest_first) > 1 else 1
        for depth in range(2, shared + 1):
            while len(self.stops[longest_first[-1]]) < depth:
                longest_first.pop()
            for k in longest_first:
                self._fill_run(k, depth, depth + 1, ends[k])
        self._fill_run(longest, shared + 1, len(self.stops[longest]) + 1, ends[longest])

    def _fill_run(self, k: int, first: int, end: int, ends: dict[int, int]) -> None:
        """Fill stop ``k`` from depth ``first`` to ``end - 1``; shallower states are done."""
        stops, branches, found = self.stops, self.branches, self.found
        fail_stop, fail_depth = self.fail_stop, self.fail_depth
        stop, stop_fails, depth_fails, stop_found = stops[k], fail_stop[k], fail_depth[k], found[k]
        for depth in range(first, end):
            # The failure of stop[:depth] extends the failure of stop[:depth - 1] by
            # its last character, falling back further until one does.
            char = stop[depth - 1]
            at, at_depth = stop_fails[depth - 1], depth_fails[depth - 1]
            while True:
                at_stop = stops[at]
                if at_depth < len(at_stop) and at_stop[at_depth] == char:
                    at_depth += 1
                    break
                branch = branches[at].get(at_depth)
                if branch is not None and (j := branch.get(char)) is not None:
                    at, at_depth = j, at_depth + 1
                    break
                if not at_depth:
                    break
                at, at_depth = fail_stop[at][at_depth], fail_depth[at][at_depth]
            stop_fails[depth] = at
            depth_fails[depth] = at_depth
            ends_here = ends.get(depth, -1)
            stop_found[depth] = ends_here if ends_here >= 0 else found[at][at_depth]


class StopStringMatcher:
    """Finds the first stop string in a stream of text chunks.

    "First" means the match that completes earliest in the stream, as if the
    text came one character at a time (so the result does not depend on how
    it was chunked); among matches completing at the same character the
    longest wins. Text from the start of the match on is never emitted, and
    after a match the matcher is done: further pushes yield nothing.

    The held-back tail is the automaton's state, ``stops[k][:d]``, so the
    matcher keeps just (k, d) and never copies the held text until it is
    released.
    """

    __slots__ = ("_automaton", "_done", "_held", "_held_stop", "_stops")

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._automaton = _Automaton(self._stops) if self._stops else None
        self._held_stop = 0  # the automaton's state: stops[_held_stop][:_held] is held back
        self._held = 0
        self._done = False

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings in use (empty ones and duplicates removed)."""
        return self._stops

    def push(self, text: str) -> StopResult:
        """Add a chunk; return what can be emitted and the stop string if one completed."""
        if self._done:
            return _NOTHING
        automaton = self._automaton
        if automaton is None:
            return StopResult(text)
        if self._held:
            return self._scan(automaton, text, 0)
        first = automaton.trigger.search(text)
        if first is None:
            return StopResult(text)
        return self._scan(automaton, text, first.start())

    def _scan(self, automaton: _Automaton, text: str, pos: int) -> StopResult:
        """Run the automaton over ``text[pos:]`` from the held state (nothing before ``pos``
        can start a stop string)."""
        k, depth = self._held_stop, self._held
        trigger = automaton.trigger
        stops = automaton.stops
        branches = automaton.branches
        fail_stop, fail_depth, found = automaton.fail_stop, automaton.fail_depth, automaton.found
        stop = stops[k]
        size = len(text)
        # The state never ends a stop string (that would have matched), so depth < len(stop).
        while pos < size:
            char = text[pos]
            while True:
                if stop[depth] == char:
                    depth += 1
                    break
                branch = branches[k].get(depth)
                if branch is not None and (j := branch.get(char)) is not None:
                    k, depth = j, depth + 1
                    stop = stops[k]
                    break
                if not depth:
                    break
                k, depth = fail_stop[k][depth], fail_depth[k][depth]
                stop = stops[k]
            pos += 1
            hit = found[k][depth]
            if hit >= 0:
                return self._match(text, pos, stops[hit])
            if not depth:  # back at the root: skip to the next character that can start a stop
                nxt = trigger.search(text, pos)
                pos = size if nxt is None else nxt.start()

        released = self._release(text, self._held + size - depth)
        self._held_stop, self._held = k, depth
        return StopResult(released)

    def _match(self, text: str, end: int, stop: str) -> StopResult:
        """``stop`` completed at ``text[end - 1]``: emit what came before it, and be done."""
        released = self._release(text, self._held + end - len(stop))
        self._done = True
        self._held = 0
        return StopResult(released, stop)

    def _release(self, text: str, count: int) -> str:
        """The first ``count`` characters of the held-back tail followed by ``text``."""
        held = self._held
        if not held:
            return text[:count]
        prefix = self._stops[self._held_stop]
        if count <= held:
            return prefix[:count]
        return prefix[:held] + text[: count - held]

    def flush(self) -> str:
        """End of stream: the held-back tail can no longer become a stop string."""
        if not self._held:
            return ""
        held = self._stops[self._held_stop][: self._held]
        self._held = 0
        return held
