"""End to end: tool calls and reasoning parsed in the router, read by the official client.

Each model of the fleet names its parsers; its simulated engine is scripted
(``ScriptBook``) to answer a marked prompt with real-shaped output of that
model family. Streaming and not, the client must read the same
``tool_calls`` / ``reasoning_content``; malformed output comes back as
content and is counted per parser. The quick-start fleet (demo model, its
template detected as Hermes) serves forced calls (``tool_choice`` required
and named) that the simulator writes under the JSON-schema constraint.
"""

from __future__ import annotations

import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.simulator.scripted import ScriptBook
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine, wait_for
from tests.support.http import http
from tests.support.models import engine_table, frontend_table, openai_client, simulators

TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"]}}},
]
WEATHER = ("get_weather", {"city": "Zürich"})
TIME = ("get_time", {"zone": "CET"})

SCRIPTS = {
    "[hermes]": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"city": "Zürich"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                 '"arguments": {"zone": "CET"}}\n</tool_call>'),
    "[coder]": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
                "</function>\n</tool_call>"),
    "[mistral]": '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}',
    "[think]": "<think>They want the weather; 天气 first.</think>It is sunny in Zürich.",
    "[llama]": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}',
    "[llama-bare]": '{"name": "get_time", "parameters": {"zone": "CET"}}',
    "[pythonic]": "[get_weather(city='Zürich'), get_time(zone='CET')]",
    "[mistral-old]": ('[TOOL_CALLS] [{"name": "get_weather", '
                      '"arguments": {"city": "Zürich"}}]'),
    "[ds3]": ("Let me look. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
              'get_weather\n```json\n{"city": "Zürich"}\n```<｜tool▁call▁end｜>'
              "<｜tool▁calls▁end｜>"),
    "[ds31]": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
               '{"city": "Zürich"}<｜tool▁call▁end｜>'
               "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
               '{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "[kimi]": ("<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|>\n'
               "<|tool_calls_section_end|>"),
    "[harmony]": ("<|channel|>analysis<|message|>Call the weather tool.<|end|><|start|>assistant"
                  "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                  '{"city": "Zürich"}<|call|>'),
    "[magistral]": "[THINK]Weather first.[/THINK]It is sunny.",
    "[r1]": "<think>Weather first.</think>It is sunny.",
    "[broken]": '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call> sorry',
    "[cut]": '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
}
#: model -> (its [[model]] keys, the marker its engine answers, what the client must read)
CASES: dict[str, tuple[str, str, tuple[str, str, list[tuple[str, dict[str, Any]]]]]] = {
    "hermes": ('tool_parser = "hermes"', "[hermes]", ("Let me look.\n", "", [WEATHER, TIME])),
    "coder": ('tool_parser = "qwen3_coder"', "[coder]", ("", "", [WEATHER])),
    "mistral": ('tool_parser = "mistral"\nreasoning_parser = "none"', "[mistral]",
                ("", "", [WEATHER])),
    "thinker": ('tool_parser = "hermes"\nreasoning_parser = "qwen3"', "[think]",
                ("It is sunny in Zürich.", "They want the weather; 天气 first.", [])),
    "llama": ('tool_parser = "llama3_json"\nreasoning_parser = "none"', "[llama]",
              ("", "", [WEATHER])),
    "llama-bare": ('tool_parser = "llama3_json"\nreasoning_parser = "none"', "[llama-bare]",
                   ("", "", [TIME])),
    "pythonic": ('tool_parser = "pythonic"\nreasoning_parser = "none"', "[pythonic]",
                 ("", "", [WEATHER, TIME])),
    "mistral-old": ('tool_parser = "mistral"\nreasoning_parser = "none"', "[mistral-old]",
                    ("", "", [WEATHER])),
    "ds3": ('tool_parser = "deepseek_v3"\nreasoning_parser = "none"', "[ds3]",
            ("Let me look. ", "", [WEATHER])),
    "ds31": ('tool_parser = "deepseek_v31"\nreasoning_parser = "none"', "[ds31]",
             ("", "", [WEATHER, TIME])),
    "kimi": ('tool_parser = "kimi_k2"\nreasoning_parser = "none"', "[kimi]",
             ("", "", [WEATHER])),
    "harmony": ('tool_parser = "harmony"\nreasoning_parser = "harmony"', "[harmony]",
                ("", "Call the weather tool.", [WEATHER])),
    "magistral": ('tool_parser = "mistral"\nreasoning_parser = "mistral"', "[magistral]",
                  ("It is sunny.", "Weather first.", [])),
    "r1": ('tool_parser = "none"\nreasoning_parser = "deepseek_r1"', "[r1]",
           ("It is sunny.", "Weather first.", [])),
}


def fleet(model_dir: Path) -> str:
    models = "".join(f'[[model]]\nname = "{name}"\n{keys}\n\n'
                     for name, (keys, _, _) in CASES.items())
    models += '[[model]]\nname = "migrating"\ntool_parser = "hermes"\nreasoning_parser = "none"\n'
    engines = "\n".join(engine_table(f"sim-{name}", "vllm", name) for name in CASES)
    engines += "\n" + "\n".join(engine_table(f"mig-{x}", "sglang", "migrating") for x in "ab")
    return frontend_table(model_dir, textwrap.dedent(models)) + "\n" + engines


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with running_daemon(tmp_path_factory.mktemp("tools"), fleet(model_dir)) as daemon:
        daemon.wait_serving(len(CASES) + 2)
        for sim in simulators(daemon).values():
            sim.core.scripts = ScriptBook(tokenizer, SCRIPTS)
        yield daemon


def ask(marker: str) -> list[Any]:
    return [{"role": "user", "content": f"What is the weather in Zürich? {marker}"}]


def read_full(client: openai.OpenAI, model: str, marker: str, **extra: Any) -> tuple[Any, str]:
    reply = client.chat.completions.create(model=model, messages=ask(marker), tools=TOOLS,
                                           **extra)
    choice = reply.choices[0]
    return choice.message, choice.finish_reason


def read_stream(client: openai.OpenAI, model: str, marker: str,
                **extra: Any) -> tuple[dict[str, Any], str, list[Any]]:
    """The stream put together as a client does, its finish reason, and every call delta."""
    content, reasoning, pieces = "", "", []
    calls: dict[int, dict[str, Any]] = {}
    finish = ""
    for chunk in client.chat.completions.create(model=model, messages=ask(marker), tools=TOOLS,
                                                stream=True, **extra):
        for choice in chunk.choices:
            delta = choice.delta
            indexes = [piece.index for piece in delta.tool_calls or ()]
            assert len(indexes) == len(set(indexes)), f"one entry per call in a chunk: {delta}"
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or ():
                pieces.append(piece)
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                if piece.id is not None:
                    assert call["id"] is None, "a call's id comes once, in its first delta"
                    assert piece.type == "function" and piece.function.name
                    call["id"] = piece.id
                call["name"] += (piece.function.name or "") if piece.id else ""
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning,
            "calls": [calls[i] for i in sorted(calls)]}, finish, pieces


def summary_of_message(message: Any) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
    return (message.content or "", getattr(message, "reasoning_content", None) or "", calls)


@pytest.mark.parametrize("model", list(CASES))
def test_the_client_reads_calls_and_reasoning_streaming_and_not(
    daemon: Daemon, client: openai.OpenAI, model: str
) -> None:
    _, marker, expected = CASES[model]
    message, finish = read_full(client, model, marker)
    assert summary_of_message(message) == expected
    assert finish == ("tool_calls" if expected[2] else "stop")
    for call in message.tool_calls or ():
        assert call.id.startswith("call_") and len(call.id) == 29 and call.type == "function"

    streamed, stream_finish, pieces = read_stream(client, model, marker)
    assert stream_finish == finish
    assert (streamed["content"], streamed["reasoning"],
            [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]]) == expected
    # only a call's first delta names it
    assert sum(p.function.name is not None for p in pieces) == len(expected[2])
    assert "<tool_call>" not in streamed["content"] and "<think>" not in streamed["content"]


def test_malformed_output_is_content_and_counted(daemon: Daemon, client: openai.OpenAI) -> None:
    message, finish = read_full(client, "hermes", "[broken]")
    assert message.tool_calls is None and finish == "stop"
    assert message.content == SCRIPTS["[broken]"]
    streamed, _, pieces = read_stream(client, "hermes", "[broken]")
    assert streamed["content"] == SCRIPTS["[broken]"] and not pieces
    # a full reply holds a call back until it closed well: a cut one is content
    message, finish = read_full(client, "hermes", "[cut]")
    assert message.tool_calls is None and message.content == SCRIPTS["[cut]"]
    wait_for(lambda: 'direct_frontend_parser_malformed_total{parser="hermes"} 3.0'
             in metrics_text(daemon), what="three malformed calls counted")


def metrics_text(daemon: Daemon) -> str:
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as response:
        return str(response.read().decode())


@pytest.mark.parametrize("stream", [False, True])
def test_each_of_several_choices_has_its_own_parser(
    daemon: Daemon, client: openai.OpenAI, stream: bool
) -> None:
    reply = client.chat.completions.create(model="thinker", messages=ask("[think]"), tools=TOOLS,
                                           n=2, stream=stream)
    reasoning = ["", ""]
    content = ["", ""]
    if stream:
        for chunk in reply:
            for choice in chunk.choices:
                reasoning[choice.index] += getattr(choice.delta, "reasoning_content", None) or ""
                content[choice.index] += choice.delta.content or ""
    else:
        for choice in reply.choices:
            reasoning[choice.index] = getattr(choice.message, "reasoning_content", None) or ""
            content[choice.index] = choice.message.content or ""
    _, _, (want_content, want_reasoning, _) = CASES["thinker"]
    assert content == [want_content] * 2 and reasoning == [want_reasoning] * 2


def test_tool_choice_none_offers_no_tools_and_parses_no_calls(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    message, finish = read_full(client, "hermes", "[hermes]", tool_choice="none")
    assert message.tool_calls is None and finish == "stop"
    assert message.content == SCRIPTS["[hermes]"]


def test_parallel_tool_calls_false_keeps_the_first(daemon: Daemon, client: openai.OpenAI) -> None:
    message, finish = read_full(client, "hermes", "[hermes]", parallel_tool_calls=False)
    assert summary_of_message(message)[2] == [WEATHER] and finish == "tool_calls"


def test_include_reasoning_false_drops_it(daemon: Daemon, client: openai.OpenAI) -> None:
    message, _ = read_full(client, "thinker", "[think]", extra_body={"include_reasoning": False})
    assert summary_of_message(message) == ("It is sunny in Zürich.", "", [])


def test_a_tool_round_trip_renders_through_the_template(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    first, _ = read_full(client, "hermes", "[hermes]")
    history: list[Any] = [*ask("no marker"), first.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": '{"ok": true}'}
                for c in first.tool_calls]
    reply = client.chat.completions.create(model="hermes", messages=history, tools=TOOLS,
                                           max_tokens=5)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_stream_migrating_mid_call_keeps_its_parser(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    sims = simulators(daemon)
    expected = read_stream(client, "migrating", "[hermes]")[0]
    sims["mig-a"].faults = FaultPlan(die_after_tokens=12, only_request=1)
    for _ in range(2):  # round robin reaches the failing engine within two requests
        streamed, finish, _ = read_stream(client, "migrating", "[hermes]")
        ids = [c.pop("id") for c in streamed["calls"]]
        assert streamed == {**expected, "calls": [
            {k: v for k, v in c.items() if k != "id"} for c in expected["calls"]]}
        assert finish == "tool_calls" and len(set(ids)) == 2
    assert sims["mig-a"].fault_stats.died
    daemon.wait_serving(len(CASES) + 2)


# -- the quick-start fleet: forced calls ----------------------------------------------------


@pytest.fixture(scope="module")
def demo(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("a", decode_us_per_token=0,
                                             prefill_us_per_token=0, eos_probability=0.0)])
    with running_daemon(tmp_path_factory.mktemp("demo-tools"), text) as daemon:
        daemon.wait_serving(1)
        yield daemon


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_on_the_demo_fleet(demo: Daemon, stream: bool, choice: str) -> None:
    tool_choice: Any = ("required" if choice == "required"
                        else {"type": "function", "function": {"name": "get_time"}})
    with openai_client(demo) as client:
        if stream:
            streamed, finish, _ = read_stream(client, "demo", "", tool_choice=tool_choice)
            calls = [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]]
            content = streamed["content"]
        else:
            message, finish = read_full(client, "demo", "", tool_choice=tool_choice)
            calls = [(c.function.name, json.loads(c.function.arguments))
                     for c in message.tool_calls]
            content = message.content or ""
    assert finish == "tool_calls" and content == "" and calls
    name = "get_weather" if choice == "required" else "get_time"  # the simulator: first branch
    assert all(n == name for n, _ in calls)
    key = "city" if name == "get_weather" else "zone"
    assert all(isinstance(args[key], str) for _, args in calls)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_through_responses_on_the_demo_fleet(
    demo: Daemon, stream: bool, choice: str
) -> None:
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                                 "name": "get_time"}
    with openai_client(demo) as client:
        made = client.responses.create(model="demo", input="The time?", tools=flat,
                                       tool_choice=tool_choice, stream=stream)
        response = list(made)[-1].response if stream else made
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in response.output)
    name = "get_weather" if choice == "required" else "get_time"
    assert all(c.name == name and isinstance(json.loads(c.arguments), dict) for c in calls)


def test_a_reload_changes_a_models_parser_and_refuses_an_unknown_one(
    model_dir: Path, tmp_path: Path
) -> None:
    def text(parser: str) -> str:
        return (frontend_table(model_dir, f'[[model]]\nname = "m"\ntool_parser = "{parser}"\n')
                + "\n" + engine_table("sim-m", "vllm", "m"))

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with running_daemon(tmp_path, text("hermes")) as daemon, openai_client(daemon) as client:
        daemon.wait_serving(1)
        for sim in simulators(daemon).values():
            sim.core.scripts = ScriptBook(tokenizer, SCRIPTS)
        assert read_full(client, "m", "[hermes]")[0].tool_calls
        fleet_file = tmp_path / "fleet.toml"
        fleet_file.write_text(text("hermez"))
        refused = http.post(daemon.url + "/fleet/reload").json()
        assert not refused["ok"] and "unknown parser 'hermez'" in json.dumps(refused)
        assert read_full(client, "m", "[hermes]")[0].tool_calls  # the running fleet serves on
        fleet_file.write_text(text("none"))
        running = simulators(daemon)["sim-m"]
        assert http.post(daemon.url + "/fleet/reload").json()["ok"]
        # the model's engine starts anew with its new settings (its simulator too, unscripted):
        # waited for, not raced (the old one may answer first on a quiet machine only)
        wait_for(lambda: simulators(daemon).get("sim-m") not in (None, running), 10.0,
                 "the reloaded engine's simulator")
        daemon.wait_serving(1)
        for sim in simulators(daemon).values():
            sim.core.scripts = ScriptBook(tokenizer, SCRIPTS)
        message, finish = read_full(client, "m", "[hermes]")
        assert message.tool_calls is None and message.content == SCRIPTS["[hermes]"]
        assert finish == "stop"


def test_continuous_usage_stats_on_a_parsed_stream(daemon: Daemon, client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="thinker", messages=ask("[think]"), tools=TOOLS, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    ))
    parsed = [c for c in chunks if c.choices and (
        c.choices[0].delta.content or getattr(c.choices[0].delta, "reasoning_content", None))]
    assert parsed and all(c.usage is not None for c in parsed)
    counts = [c.usage.completion_tokens for c in parsed if c.usage is not None]
    assert counts == sorted(counts)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= counts[-1]
