"""End to end: agent SDKs run a tool, then return their typed output, through the frontend.

An agent with a function tool and a Pydantic output type sends its tools and
its response format on every turn. The simulated engine is scripted as a model
would answer: the user's question gets a Hermes ``<tool_call>`` (the demo
model's format), the tool's result gets JSON of the output schema. On SGLang
and vLLM the request carries a structural tag allowing either, which the
simulator honours as the engines do (a script it refuses is replaced);
TensorRT-LLM gets no guide, so its model answers unconstrained. Both the
OpenAI Agents SDK (chat completions and Responses models, streamed and not)
and LangChain (``with_structured_output`` with tools, and a hand-made loop)
must call the tool once and end with the typed output. So must they on the
demo fleet itself (config/fleet.toml), whose unscripted engines call a tool
first and answer in the format after (simulator/structural.py).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel
from tokenizers import Tokenizer

from direct_frontend.simulator.scripted import ScriptBook
from direct_frontend.text.demo_model import BUNDLED_DIR
from tests.support.daemon import Daemon, fleet_text, free_port, running_daemon, sim_engine
from tests.support.models import openai_client, simulators

QUESTION = "[agent] What is the weather in Paris?"
TOOL_RESULT = "sunny, 21 degrees"
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
ANSWER = '{"city": "Paris", "degrees": 21, "summary": "sunny"}'
PROSE = "[prose] What is the weather in Rome?"
SCRIPTS = {  # the first marker found wins: the tool's result comes after the question
    TOOL_RESULT: ANSWER,
    "[agent]": CALL,
    "[prose]": "It is sunny in Rome.",
}


class Weather(BaseModel):
    city: str
    degrees: int
    summary: str


EXPECTED = Weather(city="Paris", degrees=21, summary="sunny")


@pytest.fixture(scope="module", params=["sglang", "vllm", "trtllm"])
def fleet(request: pytest.FixtureRequest, model_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The demo fleet's model (its template read as Hermes) on one simulated engine of a kind."""
    engine = sim_engine("a", request.param, decode_us_per_token=0, prefill_us_per_token=0,
                        eos_probability=0.0)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with running_daemon(tmp_path_factory.mktemp(f"agents-{request.param}"),
                        fleet_text(model_dir, [engine])) as daemon:
        daemon.wait_serving(1)
        for sim in simulators(daemon).values():
            sim.core.scripts = ScriptBook(tokenizer, SCRIPTS)
        yield daemon


def kind_of(daemon: Daemon) -> str:
    kinds = {sim.kind for sim in simulators(daemon).values()}
    assert len(kinds) == 1
    return kinds.pop()


# -- OpenAI Agents SDK ----------------------------------------------------------------------


def run_agent(daemon: Daemon, api: str, stream: bool) -> tuple[Any, list[str]]:
    """An Agents SDK agent with one tool and a Pydantic output, run once; (output, tool calls)."""
    import agents

    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return TOOL_RESULT

    async def main() -> Any:
        client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            model: agents.Model = (
                agents.OpenAIChatCompletionsModel(model="demo", openai_client=client)
                if api == "chat" else
                agents.OpenAIResponsesModel(model="demo", openai_client=client))
            agent = agents.Agent(name="forecaster", instructions="Answer with the weather.",
                                 tools=[get_weather], output_type=Weather, model=model)
            if not stream:
                return (await agents.Runner.run(agent, QUESTION, max_turns=4)).final_output
            streamed = agents.Runner.run_streamed(agent, QUESTION, max_turns=4)
            async for _ in streamed.stream_events():
                pass
            return streamed.final_output

    return asyncio.run(main()), called


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agents_sdk_agent_runs_its_tool_and_returns_its_typed_output(
    fleet: Daemon, api: str, stream: bool
) -> None:
    output, called = run_agent(fleet, api, stream)
    assert called == ["Paris"]
    assert output == EXPECTED


# -- LangChain ------------------------------------------------------------------------------


def chat_model(daemon: Daemon) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="demo", base_url=daemon.url + "/v1", api_key="unused",
                      max_retries=0, temperature=0)


def weather_tool(called: list[str]) -> Any:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return TOOL_RESULT

    return get_weather


def test_langchain_structured_output_with_tools_calls_then_answers(fleet: Daemon) -> None:
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage

    called: list[str] = []
    get_weather = weather_tool(called)
    model = chat_model(fleet).with_structured_output(
        Weather, tools=[get_weather], strict=True, include_raw=True)
    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    first = model.invoke(messages)
    assert first["parsed"] is None
    raw = first["raw"]
    assert [c["name"] for c in raw.tool_calls] == ["get_weather"]
    messages += [raw, ToolMessage(get_weather.invoke(raw.tool_calls[0]["args"]),
                                  tool_call_id=raw.tool_calls[0]["id"])]
    second = model.invoke(messages)
    assert called == ["Paris"] and second["parsing_error"] is None
    assert second["parsed"] == EXPECTED


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_langchain_tool_loop_with_a_response_format_ends_typed(
    fleet: Daemon, stream: bool
) -> None:
    from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

    called: list[str] = []
    get_weather = weather_tool(called)
    model = chat_model(fleet).bind_tools([get_weather], response_format=Weather, strict=True)

    def ask(messages: list[BaseMessage]) -> Any:
        if not stream:
            return model.invoke(messages)
        whole: Any = None
        for chunk in model.stream(messages):
            whole = chunk if whole is None else whole + chunk
        return whole

    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    for _ in range(4):
        reply = ask(messages)
        messages.append(AIMessage(content=reply.content, tool_calls=reply.tool_calls))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]),
                                        tool_call_id=call["id"]))
    assert called == ["Paris"]
    assert Weather.model_validate_json(reply.content) == EXPECTED


# -- what the constraint does on each kind --------------------------------------------------


def test_tools_with_a_format_constrain_where_the_engine_takes_a_structural_tag(
    fleet: Daemon
) -> None:
    """The model would answer prose: SGLang and vLLM hold it to a call or the format,
    TensorRT-LLM (no guide sent) lets it."""
    tools: Any = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": False}}}]
    response_format: Any = {"type": "json_schema", "json_schema": {
        "name": "weather", "strict": True,
        "schema": {**Weather.model_json_schema(), "additionalProperties": False}}}
    with openai_client(fleet) as client:
        reply = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": PROSE}], tools=tools,
            response_format=response_format)
    content = reply.choices[0].message.content or ""
    if kind_of(fleet) == "trtllm":
        assert content == SCRIPTS["[prose]"]
    else:
        Weather.model_validate(json.loads(content))


# -- the demo fleet, unscripted -------------------------------------------------------------

DEMO_FLEET = Path(__file__).parents[2] / "config" / "fleet.toml"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """config/fleet.toml as shipped, on free ports."""
    text = DEMO_FLEET.read_text().replace('"127.0.0.1:8000"', '"127.0.0.1:0"')
    text = text.replace('tokenizer = "demo-model"', f'tokenizer = "{BUNDLED_DIR}"')
    text = re.sub(r"127\.0\.0\.1:3006\d", lambda _: f"127.0.0.1:{free_port()}", text)
    with running_daemon(tmp_path_factory.mktemp("agents-demo"), text) as daemon:
        daemon.wait_serving(2)
        yield daemon


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_runs_its_tool_then_ends_typed_on_the_demo_fleet(demo: Daemon, api: str) -> None:
    output, called = run_agent(demo, api, stream=False)
    assert len(called) == 1 and called[0]  # the simulator's own arguments
    assert isinstance(output, Weather)


def test_a_langchain_loop_runs_its_tool_then_ends_typed_on_the_demo_fleet(demo: Daemon) -> None:
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage

    called: list[str] = []
    get_weather = weather_tool(called)
    model = chat_model(demo).with_structured_output(
        Weather, tools=[get_weather], strict=True, include_raw=True)
    messages: list[BaseMessage] = [HumanMessage("What is the weather in Paris?")]
    for _ in range(4):
        reply = model.invoke(messages)
        raw = reply["raw"]
        if not raw.tool_calls:
            break
        messages.append(raw)
        messages += [ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
                     for call in raw.tool_calls]
    assert len(called) == 1 and isinstance(reply["parsed"], Weather)
