"""Any content, any calls, any split: the stream equals the whole, for the marker-based formats."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.parsers import check_split

Calls = list[tuple[str, dict[str, Any]]]


def _hermes(calls: Calls) -> str:
    return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                   for n, a in calls)


def _deepseek_v31(calls: Calls) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a, ensure_ascii=False)}"
                   "<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>" if calls else ""


def _kimi(calls: Calls) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>"
                   f"{json.dumps(a)}<|tool_call_end|>" for i, (n, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>" if calls else ""


def _mistral(calls: Calls) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls)


RENDER: dict[str, Callable[[Calls], str]] = {
    "hermes": _hermes, "deepseek_v31": _deepseek_v31, "kimi_k2": _kimi, "mistral": _mistral,
}
content = st.lists(st.sampled_from(["a", " ", "é", "🌧", "\n", "<", "<tool", "[TOOL", "<|tool",
                                    "<｜tool", "{", "}", '"']), max_size=12).map("".join)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
values = st.one_of(st.integers(), st.booleans(), st.none(), st.text(max_size=8),
                   st.lists(st.integers(), max_size=3))
arguments = st.dictionaries(st.text(min_size=1, max_size=6), values, max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(RENDER)), content, st.lists(st.tuples(names, arguments), max_size=3),
       st.data())
def test_streaming_equals_the_whole(parser: str, prose: str, calls: Calls,
                                    data: st.DataObject) -> None:
    text = prose + RENDER[parser](calls)
    check_split(parser, text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)),
                (prose, "", calls))
