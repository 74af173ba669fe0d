"""End to end: Anthropic's ``/v1/messages`` with the official ``anthropic`` client.

The engine is scripted as for the Responses API: a prompt with ``[weather]``
gets a reasoning block and a Hermes call, one carrying the tool's result
(``[result]``) the answer. The SDK's own stream accumulator must put together
the same Message as the non-streaming answer.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from grpclib.const import Status

from direct_frontend.simulator.faults import FaultPlan
from tests.e2e.test_responses_api import QUESTION, SCRIPTS
from tests.support.daemon import Daemon
from tests.support.http import http, sdk2_http
from tests.support.models import engine_table, scripted_daemon, simulators

TOOLS: list[Any] = [{
    "name": "get_weather", "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}]
KEY = "sk-messages-test-key"


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    models = textwrap.dedent(f"""\
        [frontend.auth]
        api_keys = ["{KEY}"]

        [[model]]
        name = "agent"
        tool_parser = "hermes"
        reasoning_parser = "qwen3"
        """)
    with scripted_daemon(model_dir, tmp_path_factory.mktemp("messages"), models,
                         engine_table("sim", "vllm", "agent"), SCRIPTS) as daemon:
        yield daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=daemon.url, api_key=KEY, max_retries=0,
                             http_client=sdk2_http()) as client:
        yield client


def kinds(message: Any) -> list[str]:
    return [block.type for block in message.content]


def test_a_tool_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model="agent", max_tokens=200, tools=TOOLS,
                                   system="Be brief.",
                                   messages=[{"role": "user", "content": QUESTION}])
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert kinds(first) == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    thinking, call = first.content
    assert thinking.thinking == "They want the weather."  # type: ignore[union-attr]
    assert call.name == "get_weather" and call.input == {"city": "Zürich"}  # type: ignore[union-attr]
    assert first.usage.output_tokens > 0

    second = client.messages.create(model="agent", max_tokens=200, tools=TOOLS, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id,  # type: ignore[union-attr]
             "content": '{"sky": "sunny"} [result]'}]},
    ])
    assert kinds(second) == ["text"] and second.stop_reason == "end_turn"
    assert second.content[0].text == "It is sunny in Zürich."  # type: ignore[union-attr]


def test_the_sdks_stream_accumulates_the_same_message(client: anthropic.Anthropic) -> None:
    ask: dict[str, Any] = {"model": "agent", "max_tokens": 200, "tools": TOOLS,
                           "messages": [{"role": "user", "content": QUESTION}]}
    full = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "input_json" in types and "thinking" in types and "message_delta" in types
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in full.content]
    assert streamed.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == full.usage.output_tokens

    with client.messages.stream(model="agent", max_tokens=50, messages=[
            {"role": "user", "content": "Say it. [result]"}]) as stream:
        text = "".join(stream.text_stream)
    assert text == "It is sunny in Zürich."


def test_stop_sequences_and_max_tokens_are_the_stop_reasons(client: anthropic.Anthropic) -> None:
    said = [{"role": "user", "content": "Say it. [result]"}]
    stopped = client.messages.create(model="agent", max_tokens=50, messages=said,  # type: ignore[arg-type]
                                     stop_sequences=["sunny"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "sunny"
    assert stopped.content[0].text == "It is "  # type: ignore[union-attr]
    cut = client.messages.create(model="agent", max_tokens=2, messages=said)  # type: ignore[arg-type]
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_usage_and_count_tokens_agree(client: anthropic.Anthropic) -> None:
    said: Any = [{"role": "user", "content": "Say it once more. [result]"}]
    counted = client.messages.count_tokens(model="agent", messages=said, system="Be brief.")
    answered = client.messages.create(model="agent", max_tokens=5, messages=said,
                                      system="Be brief.")
    usage = answered.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    again = client.messages.create(model="agent", max_tokens=5, messages=said,
                                   system="Be brief.")
    assert again.usage.cache_read_input_tokens  # the engine had the prompt cached
    assert again.usage.input_tokens < counted.input_tokens


def test_errors_come_in_anthropics_shape(daemon: Daemon, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post("/v1/messages", cast_to=object, body={
            "model": "agent", "messages": [{"role": "user", "content": "hi"}]})
    assert missing.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5,
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(model="agent", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert "image" in str(image.value)
    denied = http.post(daemon.url + "/v1/messages", headers={"x-api-key": "wrong"}, json={
        "model": "agent", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert denied.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"


def test_a_failure_after_the_stream_started_is_an_error_event(
    daemon: Daemon, client: anthropic.Anthropic
) -> None:
    sim = simulators(daemon)["sim"]
    sim.faults = FaultPlan(status=Status.INVALID_ARGUMENT, status_after_tokens=2)
    seen: list[str] = []
    try:
        with pytest.raises(anthropic.APIStatusError), client.messages.stream(
                model="agent", max_tokens=50,
                messages=[{"role": "user", "content": "Tell me a story."}]) as stream:
            seen.extend(event.type for event in stream)
    finally:
        sim.faults = FaultPlan()
    assert seen[0] == "message_start" and "text" in seen


def test_the_sdk_lists_and_retrieves_models_in_anthropics_shape(
    daemon: Daemon, client: anthropic.Anthropic
) -> None:
    listed = list(client.models.list())
    assert [m.id for m in listed] == ["agent"] and listed[0].type == "model"
    assert listed[0].display_name == "agent" and listed[0].created_at.year >= 2026
    one = client.models.retrieve("agent")
    assert one.id == "agent" and one.type == "model"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    page = client.get("/v1/models", cast_to=object, options={"params": {"after_id": "agent"}})
    assert page == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    with pytest.raises(anthropic.BadRequestError):
        client.get("/v1/models", cast_to=object, options={"params": {"limit": 0}})
    plain = http.get(daemon.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert plain.json()["object"] == "list"  # an OpenAI client still gets OpenAI's shape
