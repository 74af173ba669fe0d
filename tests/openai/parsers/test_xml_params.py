"""GLM-4.5+, MiniMax-M2 and DeepSeek DSML calls: tagged key/value pairs, at every split point."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.openai.parsers.detect import detect
from tests.support.parsers import check_malformed, check_output, check_split, make

Calls = list[tuple[str, dict[str, Any]]]

SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "tags": {"type": "array"}}}, "now": {"type": "object", "properties": {}}}
glm = make("glm45", tools=SCHEMAS)
minimax = make("minimax_m2", tools=SCHEMAS)
WEATHER = ("get_weather", {"city": "Zürich <old town>", "days": 3, "metric": True,
                           "tags": ["a", 1]})


def test_glm45_calls_with_newlines_and_typed_values() -> None:
    text = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Zürich <old town></arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
            '<arg_key>tags</arg_key>\n<arg_value>["a", 1]</arg_value>\n</tool_call>')
    check_output(glm, text, ("Let me check.", "", [WEATHER]),
                 markers=("<tool_call>", "<arg_key>", "<arg_value>"))


def test_glm47_calls_without_newlines_and_one_without_arguments() -> None:
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich <old town>"
            "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric"
            "</arg_key><arg_value>true</arg_value><arg_key>tags</arg_key><arg_value>"
            '["a", 1]</arg_value></tool_call><tool_call>now</tool_call>')
    check_output(glm, text, ("", "", [WEATHER, ("now", {})]))


def test_glm_reasoning_then_a_call() -> None:
    factory = make("glm45", "glm45", tools=SCHEMAS)
    text = "<think>Weather, so the tool.</think><tool_call>now\n</tool_call>"
    check_output(factory, text, ("", "Weather, so the tool.", [("now", {})]))


def test_minimax_m2_section_with_two_invokes_and_any_quoting() -> None:
    text = ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
            '<parameter name="city">Zürich <old town></parameter>\n'
            "<parameter name='days'>3</parameter>\n<parameter name=metric>true</parameter>\n"
            '<parameter name="tags">["a", 1]</parameter>\n</invoke>\n<invoke name="now">\n'
            "</invoke>\n</minimax:tool_call>")
    check_output(minimax, text, ("Checking.\n", "", [WEATHER, ("now", {})]),
                 markers=("<minimax:tool_call>", "<invoke name=", "<parameter"))


def test_minimax_m2_thinks_from_the_start() -> None:
    factory = make("minimax_m2", "minimax_m2", tools=SCHEMAS)
    text = ('Weather, so the tool.</think><minimax:tool_call><invoke name="now"></invoke>'
            "</minimax:tool_call>")
    check_output(factory, text, ("", "Weather, so the tool.", [("now", {})]))


@pytest.mark.parametrize(("parser", "text"), [
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zü"),  # cut short
    ("glm45", "<tool_call>get_weather\nnot a pair\n</tool_call>"),
    ("glm45", "<tool_call>unknown_tool</tool_call>"),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Zü'),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather">oops</invoke>'
                   "</minimax:tool_call>"),
])
def test_malformed_calls_come_back_as_content(parser: str, text: str) -> None:
    # the section's markers are not the call's: they are dropped, as for every sectioned format
    expected = text.replace("<minimax:tool_call>", "").replace("</minimax:tool_call>", "")
    check_malformed(make(parser, tools=SCHEMAS), text, expected)


D = "｜DSML｜"


@pytest.mark.parametrize(("parser", "section"), [("deepseek_v32", "function_calls"),
                                                 ("deepseek_v4", "tool_calls")])
def test_deepseek_dsml_calls_typed_by_their_string_attribute(parser: str, section: str) -> None:
    text = (f'Sure.\n\n<{D}{section}>\n<{D}invoke name="get_weather">\n'
            f'<{D}parameter name="city" string="true">杭州 <old town></{D}parameter>\n'
            f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
            f'<{D}parameter name="metric" string="false">true</{D}parameter>\n'
            f'<{D}parameter name="tags">["a", 1]</{D}parameter>\n</{D}invoke>\n'
            f'<{D}invoke name="now">\n</{D}invoke>\n</{D}{section}>')
    calls = [("get_weather", {"city": "杭州 <old town>", "days": 3, "metric": True,
                              "tags": ["a", 1]}), ("now", {})]
    check_output(make(parser, tools=SCHEMAS), text, ("Sure.\n\n", "", calls),
                 markers=(f"<{D}invoke", f"<{D}parameter"))
    text_007 = (f'<{D}{section}><{D}invoke name="get_weather"><{D}parameter name="days" '
                f'string="true">007</{D}parameter></{D}invoke></{D}{section}>')
    check_output(make(parser, tools=SCHEMAS), text_007, ("", "", [("get_weather",
                                                                    {"days": "007"})]))


def test_detected_from_their_templates() -> None:
    glm_template = "<|assistant|><think>{{ m }}<tool_call>{{ f }}<arg_key>k</arg_key>"
    found = detect(glm_template)
    assert (found.tool_parser, found.reasoning_parser) == ("glm45", "glm45")
    minimax_template = "<think></think><minimax:tool_call><invoke name=..."
    found = detect(minimax_template)
    assert (found.tool_parser, found.reasoning_parser) == ("minimax_m2", "minimax_m2")
    assert detect(None, "glm4_moe").tool_parser == "glm45"
    assert detect("{{ '<｜DSML｜function_calls>' }}").tool_parser == "deepseek_v32"
    assert detect("{{ dsml }}｜DSML｜tool_calls<｜Assistant｜><think>").tool_parser == (
        "deepseek_v4")


def _glm(calls: Calls) -> str:
    return "".join("<tool_call>" + n + "\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{json.dumps(v, ensure_ascii=False)}</arg_value>\n"
        for k, v in a.items()) + "</tool_call>" for n, a in calls)


def _minimax(calls: Calls) -> str:
    body = "".join(f'<invoke name="{n}">\n' + "".join(
        f'<parameter name="{k}">{json.dumps(v, ensure_ascii=False)}</parameter>\n'
        for k, v in a.items()) + "</invoke>\n" for n, a in calls)
    return f"<minimax:tool_call>\n{body}</minimax:tool_call>" if calls else ""


def _dsml(calls: Calls) -> str:
    def pair(k: str, v: Any) -> str:
        if isinstance(v, str):
            return f'<{D}parameter name="{k}" string="true">{v}</{D}parameter>\n'
        return (f'<{D}parameter name="{k}" string="false">{json.dumps(v)}'
                f"</{D}parameter>\n")

    body = "".join(f'<{D}invoke name="{n}">\n' + "".join(pair(k, v) for k, v in a.items())
                   + f"</{D}invoke>\n" for n, a in calls)
    return f"<{D}tool_calls>\n{body}</{D}tool_calls>" if calls else ""


RENDER = {"glm45": _glm, "minimax_m2": _minimax, "deepseek_v4": _dsml}
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
values = st.one_of(st.integers(), st.booleans(), st.none(),
                   st.text(st.characters(blacklist_characters="<"), max_size=8),
                   st.lists(st.integers(), max_size=3))
prose = st.lists(st.sampled_from(["a", " ", "é", "\n", "<", "<tool", "<minimax", "<arg",
                                  "<｜DSML"]), max_size=10).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(RENDER)), prose,
       st.lists(st.tuples(names, st.dictionaries(names, values, max_size=3)), max_size=3),
       st.data())
def test_streaming_equals_the_whole(parser: str, text_before: str, calls: Calls,
                                    data: st.DataObject) -> None:
    text = text_before + RENDER[parser](calls)
    check_split(parser, text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)),
                (text_before, "", calls))
