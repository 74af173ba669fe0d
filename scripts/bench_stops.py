#!/usr/bin/env python3
"""Measure the stop-string matcher: µs per token for short stops, and one very long stop.

The matcher runs once per output token of every request that has stop
strings, on the event loop. This script times :class:`StopStringMatcher`
on token-sized pieces of the repository's own documentation (split the way
a BPE pre-tokenizer splits English: words with their leading space,
punctuation runs, whitespace runs) for a few sets of short stop strings that
never occur in it (so every piece is matched, none ends the stream), and
then builds a matcher for one long stop string and streams its worst case
through it (everything but its last character, repeated): the time, and the
peak of Python allocations (tracemalloc, in a separate pass).

``--baseline REF`` also loads ``direct_frontend/text/stops.py`` as it is at
the git ref REF and times it in the same run, rounds alternating, so the two
columns are comparable. A baseline that grows quadratically with a stop
string's length gets ``--baseline-long-chars`` characters (default 10,000).

Usage::

    python scripts/bench_stops.py
    python scripts/bench_stops.py --baseline main
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import re
import subprocess
import sys
import time
import tracemalloc
import types
from collections.abc import Callable, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from direct_frontend.text import stops as current  # noqa: E402

PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
STOP_SETS: dict[str, tuple[str, ...]] = {
    "1 stop": ("<|im_end|>",),
    "4 stops": ("<|im_end|>", "</s>", "\nUser:", "\n\n\n\n"),
    "16 stops": (
        "<|im_end|>", "</s>", "\nUser:", "\n\n\n\n", "<|eot_id|>", "###", "\nQ:", "[END]",
        "Observation:", "<|endoftext|>", "\nHuman:", "```\n\n", "\nAssistant:", "~~~~",
        "<stop>", "\n---\n\n",
    ),
}


def corpus_pieces() -> list[str]:
    text = "\n\n".join(
        p.read_text(encoding="utf-8")
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    for stops in STOP_SETS.values():
        for stop in stops:
            text = text.replace(stop, "")  # the stream must never end early
    return PIECE.findall(text)


def load_baseline(ref: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:direct_frontend/text/stops.py"],
        check=True, capture_output=True, text=True,
    ).stdout
    module = types.ModuleType("baseline_stops")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{ref}:direct_frontend/text/stops.py", "exec"), module.__dict__)
    return module


def per_token_us(module: Any, stops: Sequence[str], pieces: list[str]) -> float:
    matcher = module.StopStringMatcher(stops)
    push = matcher.push
    gc.disable()
    start = time.perf_counter()
    for piece in pieces:
        push(piece)
    elapsed = time.perf_counter() - start
    gc.enable()
    return elapsed / len(pieces) * 1e6


def long_stop_run(module: Any, chars: int) -> tuple[float, float]:
    """Build a matcher for one ``chars``-long stop and stream its worst case; seconds each."""
    stop = "a" * (chars - 1) + "b"
    stream = "a" * (chars + chars // 2)
    start = time.perf_counter()
    matcher = module.StopStringMatcher([stop])
    built = time.perf_counter()
    for pos in range(0, len(stream), 4):
        matcher.push(stream[pos : pos + 4])
    result = matcher.push("b")
    done = time.perf_counter()
    assert result.matched == stop, "the long stop string did not match"
    return built - start, done - built


def long_stop_peak_mb(module: Any, chars: int) -> float:
    tracemalloc.start()
    try:
        long_stop_run(module, chars)
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def best(rounds: int, measure: Callable[[], float]) -> float:
    return min(measure() for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", metavar="REF", help="also time stops.py at this git ref")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--long-chars", type=int, default=100_000)
    parser.add_argument("--baseline-long-chars", type=int, default=10_000)
    args = parser.parse_args()

    modules: dict[str, Any] = {"this checkout": current}
    if args.baseline:
        modules[args.baseline] = load_baseline(args.baseline)
    pieces = corpus_pieces()
    chars = sum(map(len, pieces))
    print(f"{len(pieces)} pieces, {chars / len(pieces):.1f} characters each on average")

    for module in modules.values():  # warm up: first calls, caches, CPU frequency
        per_token_us(module, STOP_SETS["4 stops"], pieces)

    print("\nµs per token (best of alternating rounds)")
    print(f"{'':10}" + "".join(f"{name:>16}" for name in modules))
    for label, stops in (("no stops", ()), *STOP_SETS.items()):
        figures = {name: float("inf") for name in modules}
        for _ in range(args.rounds):
            for name, module in modules.items():
                figures[name] = min(figures[name], per_token_us(module, stops, pieces))
        print(f"{label:10}" + "".join(f"{figures[name]:16.3f}" for name in modules))

    print("\none long stop string, worst-case stream of 1.5× its length in 4-character chunks")
    for name, module in modules.items():
        sizes = [args.long_chars] if module is current else []
        if module is not current or args.baseline:
            sizes.insert(0, args.baseline_long_chars)
        for size in sizes:
            build_s, stream_s = min(long_stop_run(module, size) for _ in range(3))
            peak = long_stop_peak_mb(module, size)
            print(
                f"{name:>14}: {size:>7,} characters: build {build_s * 1e3:8.1f} ms, "
                f"stream {stream_s * 1e3:8.1f} ms, peak allocations {peak:9.1f} MB"
            )


if __name__ == "__main__":
    main()
