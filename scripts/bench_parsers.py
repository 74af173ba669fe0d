#!/usr/bin/env python3
"""Measure the output parsers: µs per streamed token, for prose and for tool-call output.

Each parser is fed token-sized pieces (words with their leading space,
punctuation runs, whitespace runs, and each special marker as one piece, as
the model's tokenizer emits it) of two outputs: prose with no call (what
most replies are), and that prose followed by three calls in the parser's own
format whose arguments hold prose strings. Reasoning parsers get a reasoning
block of the prose and then the prose as content. The figure is wall time
per piece, best of ``--rounds``. Target: ≤ 5 µs per token for the common
parsers (hermes, llama3_json, mistral, qwen3 / deepseek_r1 reasoning).

Usage::

    python scripts/bench_parsers.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from direct_frontend.openai.parsers.registry import ChoiceParser  # noqa: E402

PIECE = re.compile(r"<[|｜][^>]*[|｜]>|\[[A-Z_/]+\]|</?[a-z_]+>| ?\w+| ?[^\w\s]+|\s+")
ARGS = [{"city": "San Francisco", "note": "a windy day, bring a coat"},
        {"query": "the best parser benchmarks of 2026", "limit": 5}, {}]


def _calls_hermes() -> str:
    return "".join(
        f'<tool_call>\n{json.dumps({"name": f"tool_{i}", "arguments": a})}\n</tool_call>\n'
        for i, a in enumerate(ARGS))


def _calls_qwen3_coder() -> str:
    out = []
    for i, a in enumerate(ARGS):
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
        out.append(f"<tool_call>\n<function=tool_{i}>\n{params}</function>\n</tool_call>\n")
    return "".join(out)


def _calls_llama3_json() -> str:
    return "<|python_tag|>" + "; ".join(
        json.dumps({"name": f"tool_{i}", "parameters": a}) for i, a in enumerate(ARGS))


def _calls_pythonic() -> str:
    calls = ", ".join(f"tool_{i}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                      for i, a in enumerate(ARGS))
    return f"[{calls}]"


def _calls_mistral() -> str:
    return "".join(f"[TOOL_CALLS]tool_{i}[ARGS]{json.dumps(a)}" for i, a in enumerate(ARGS))


def _calls_deepseek_v3() -> str:
    body = "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_{i}\n```json\n"
                   f"{json.dumps(a)}\n```<｜tool▁call▁end｜>" for i, a in enumerate(ARGS))
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _calls_deepseek_v31() -> str:
    body = "".join(f"<｜tool▁call▁begin｜>tool_{i}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>"
                   for i, a in enumerate(ARGS))
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _calls_kimi_k2() -> str:
    body = "".join(f"<|tool_call_begin|>functions.tool_{i}:{i}<|tool_call_argument_begin|>"
                   f"{json.dumps(a)}<|tool_call_end|>" for i, a in enumerate(ARGS))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def _calls_harmony() -> str:
    return "".join(f"<|start|>assistant<|channel|>commentary to=functions.tool_{i} "
                   f"<|constrain|>json<|message|>{json.dumps(a)}<|call|>"
                   for i, a in enumerate(ARGS))


TOOL_OUTPUTS: dict[str, Callable[[], str]] = {
    "hermes": _calls_hermes, "qwen3_coder": _calls_qwen3_coder, "llama3_json": _calls_llama3_json,
    "pythonic": _calls_pythonic, "mistral": _calls_mistral, "deepseek_v3": _calls_deepseek_v3,
    "deepseek_v31": _calls_deepseek_v31, "kimi_k2": _calls_kimi_k2, "harmony": _calls_harmony,
}
REASONING: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"),
}


def prose() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")[:6000]


def per_token_us(make: Callable[[], ChoiceParser], pieces: list[str], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        parser = make()
        feed = parser.feed
        start = time.perf_counter()
        for piece in pieces:
            feed(piece)
        parser.finish()
        best = min(best, time.perf_counter() - start)
    return best / len(pieces) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    rounds = ap.parse_args().rounds
    text = prose()
    print(f"{'tool parser':<14}{'prose µs/tok':>14}{'calls µs/tok':>14}{'tokens':>8}")
    for name, calls in TOOL_OUTPUTS.items():
        if name == "harmony":
            plain = f"<|channel|>final<|message|>{text}<|return|>"
            called = f"<|channel|>analysis<|message|>{text}<|end|>" + calls()
        else:
            plain, called = text, text + calls()
        a = PIECE.findall(plain)
        b = PIECE.findall(called)
        assert "".join(a) == plain and "".join(b) == called

        def make(n: str = name) -> ChoiceParser:
            return ChoiceParser(tool_parser=n)
        prose_us, calls_us = per_token_us(make, a, rounds), per_token_us(make, b, rounds)
        print(f"{name:<14}{prose_us:>14.2f}{calls_us:>14.2f}{len(b):>8}")
    print(f"\n{'reasoning':<14}{'µs/tok':>14}{'+hermes':>14}{'tokens':>8}")
    for name, (open_tag, close_tag) in REASONING.items():
        pieces = PIECE.findall(f"{open_tag}{text}{close_tag}\n\n{text}")

        def alone(n: str = name) -> ChoiceParser:
            return ChoiceParser(reasoning_parser=n)

        def chained(n: str = name) -> ChoiceParser:
            return ChoiceParser(reasoning_parser=n, tool_parser="hermes")
        print(f"{name:<14}{per_token_us(alone, pieces, rounds):>14.2f}"
              f"{per_token_us(chained, pieces, rounds):>14.2f}{len(pieces):>8}")


if __name__ == "__main__":
    main()
