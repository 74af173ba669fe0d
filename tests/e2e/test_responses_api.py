"""End to end: stateless ``/v1/responses`` with the official client, a function call round trip.

The engine is scripted: a prompt with ``[weather]`` gets a reasoning block and
a Hermes call, a prompt that carries the tool's result (``[result]``) gets the
answer. Streamed events must come in the Responses API's order with rising
sequence numbers and put together the same items as the full response.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from grpclib.const import Status

from direct_frontend.simulator.faults import FaultPlan
from tests.support.daemon import Daemon, running_daemon
from tests.support.http import http
from tests.support.models import (
    engine_table,
    frontend_table,
    openai_client,
    scripted_daemon,
    simulators,
)

TOOLS: list[Any] = [{
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}]
SCRIPTS = {  # the first marker found wins: the result turn also carries [weather]
    "[result]": "It is sunny in Zürich.",
    "[weather]": ('<think>They want the weather.</think><tool_call>\n{"name": "get_weather", '
                  '"arguments": {"city": "Zürich"}}\n</tool_call>'),
}
QUESTION = "What is the weather in Zürich? [weather]"


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    models = textwrap.dedent("""\
        [[model]]
        name = "agent"
        tool_parser = "hermes"
        reasoning_parser = "qwen3"
        """)
    with scripted_daemon(model_dir, tmp_path_factory.mktemp("responses"), models,
                         engine_table("sim", "vllm", "agent"), SCRIPTS) as daemon:
        yield daemon


def metric_value(scrape: str, name: str) -> float:
    line = next(line for line in scrape.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def kinds(response: Any) -> list[str]:
    return [item.type for item in response.output]


def test_a_function_call_round_trip(daemon: Daemon, client: openai.OpenAI) -> None:
    first = client.responses.create(model="agent", input=QUESTION, tools=TOOLS,
                                    instructions="Be brief.", store=False)
    assert first.status == "completed" and first.object == "response"
    assert kinds(first) == ["reasoning", "function_call"]
    reasoning, call = first.output
    assert reasoning.content is not None
    assert reasoning.content[0].text == "They want the weather."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Zürich"}
    assert call.call_id.startswith("call_")
    assert first.usage is not None and first.usage.output_tokens > 0
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens

    history: list[Any] = [{"role": "user", "content": QUESTION}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id,
                    "output": '{"sky": "sunny"} [result]'})
    second = client.responses.create(model="agent", input=history, tools=TOOLS)
    assert kinds(second) == ["message"]
    assert second.output_text == "It is sunny in Zürich."


def test_streamed_events_make_the_same_items(daemon: Daemon, client: openai.OpenAI) -> None:
    full = client.responses.create(model="agent", input=QUESTION, tools=TOOLS)
    events = list(client.responses.create(model="agent", input=QUESTION, tools=TOOLS,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for needed in ("response.output_item.added", "response.reasoning_text.delta",
                   "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"):
        assert needed in types
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    done = events[-1].response
    assert kinds(done) == kinds(full)
    assert json.loads(arguments) == json.loads(done.output[1].arguments) == {"city": "Zürich"}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    assert done.usage is not None and done.usage.output_tokens == full.usage.output_tokens


def test_text_streams_as_output_text_deltas(daemon: Daemon, client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="agent", input="Say it. [result]", stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "It is sunny in Zürich."
    assert events[-1].response.output_text == text


def test_max_output_tokens_makes_an_incomplete_response(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    cut = client.responses.create(model="agent", input="Say it. [result]", max_output_tokens=3)
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


def call_round(client: openai.OpenAI, **fields: Any) -> tuple[Any, list[Any]]:
    """The first turn (a reasoning block and a call) and the tool's result for the next one."""
    first = client.responses.create(model="agent", input=QUESTION, tools=TOOLS, **fields)
    assert kinds(first) == ["reasoning", "function_call"]
    result = [{"type": "function_call_output", "call_id": first.output[1].call_id,
               "output": '{"sky": "sunny"} [result]'}]
    return first, result


def test_a_follow_up_continues_a_stored_response_as_if_it_sent_the_history(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    """The engine sees the same prompt both ways: the stored turns, not the instructions."""
    first, result = call_round(client, instructions="Be brief.")
    assert first.store is True
    second = client.responses.create(model="agent", previous_response_id=first.id,
                                     input=result, tools=TOOLS)
    assert second.output_text == "It is sunny in Zürich."
    assert second.previous_response_id == first.id
    counted = http.post(daemon.url + "/v1/responses/input_tokens", json={
        "model": "agent", "previous_response_id": first.id, "input": result, "tools": TOOLS})
    assert counted.json() == {"object": "response.input_tokens",
                              "input_tokens": second.usage.input_tokens}  # type: ignore[union-attr]
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    history += [item.model_dump(exclude_none=True) for item in first.output] + result
    stateless = client.responses.create(model="agent", input=history, tools=TOOLS, store=False)
    assert second.usage is not None and stateless.usage is not None
    assert second.usage.input_tokens == stateless.usage.input_tokens
    with_instructions = client.responses.create(model="agent", input=history, tools=TOOLS,
                                                instructions="Be brief.", store=False)
    assert with_instructions.usage is not None
    assert with_instructions.usage.input_tokens > second.usage.input_tokens


def test_a_stored_response_is_retrieved_listed_and_deleted(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    first, result = call_round(client)
    second = client.responses.create(model="agent", previous_response_id=first.id,
                                     input=result, tools=TOOLS)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in items.data] == [
        "message", "reasoning", "function_call", "function_call_output"]
    assert items.data[2].id == first.output[1].id and not items.has_more
    newest = client.responses.input_items.list(second.id, limit=2)
    assert [item.type for item in newest.data] == ["function_call_output", "function_call"]
    assert newest.has_more and newest.last_id == newest.data[1].id
    rest = client.responses.input_items.list(second.id, limit=2, after=newest.last_id)
    assert [item.type for item in rest.data] == ["reasoning", "message"] and not rest.has_more

    scrape = http.get(daemon.url + "/metrics").text
    assert metric_value(scrape, "direct_frontend_responses_stored") >= 2
    assert metric_value(scrape, "direct_frontend_responses_stored_bytes") > 0
    assert 'code="200",endpoint="/v1/responses/{id}"' in scrape  # not one per id
    assert 'code="200",endpoint="/v1/responses/{id}/input_items"' in scrape
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="agent", previous_response_id=first.id, input="again")
    assert caught.value.code == "previous_response_not_found"
    third = client.responses.create(model="agent", previous_response_id=second.id,
                                    input="Thanks. [result]")
    assert third.output_text  # its history does not need the deleted turn's record


def test_a_streamed_response_is_stored_too_and_store_false_keeps_nothing(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    events = list(client.responses.create(model="agent", input="Say it. [result]",
                                          stream=True))
    done = events[-1].response
    assert events[0].response.store is True
    assert client.responses.retrieve(done.id).output_text == "It is sunny in Zürich."
    unkept = client.responses.create(model="agent", input="Say it. [result]", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="agent", input="hi", previous_response_id="resp_1")
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="agent", input=[{"type": "web_search_call"}])
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.input_items.list(done.id, limit=500)
    assert "limit" in str(bad.value)


def test_a_server_that_keeps_nothing_says_so(model_dir: Path,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    text = frontend_table(model_dir, '[frontend.responses]\nstore = false\n\n'
                          '[[model]]\nname = "demo"\n') + "\n" + engine_table("sim", "vllm",
                                                                             "demo")
    with running_daemon(tmp_path_factory.mktemp("unkept"), text) as unkept:
        unkept.wait_serving(1)
        with openai_client(unkept) as client:
            response = client.responses.create(model="demo", input="hi", max_output_tokens=3)
            assert response.store is False
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(response.id)
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(model="demo", input="hi",
                                        previous_response_id=response.id)
            assert "store = false" in str(caught.value)


def test_a_failure_after_the_stream_started_ends_it_as_the_api_does(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    sim = simulators(daemon)["sim"]
    sim.faults = FaultPlan(status=Status.INVALID_ARGUMENT, status_after_tokens=2)
    try:
        events = list(client.responses.create(
            model="agent", input="Tell me a story.", max_output_tokens=50, stream=True,
        ))
    finally:
        sim.faults = FaultPlan()
    types = [e.type for e in events]
    assert types[0] == "response.created" and "response.output_text.delta" in types
    assert types[-2:] == ["error", "response.failed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.message == events[-2].message and failed.error.code == events[-2].code


def test_a_response_larger_than_the_budget_is_not_kept_and_says_why(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    # the memory store: its budget is what is tested (a database keeps what it took)
    text = frontend_table(model_dir, '[frontend.responses]\nbackend = "memory"\n'
                          'max_bytes = 300\n\n'
                          '[[model]]\nname = "demo"\n') + "\n" + engine_table("sim", "vllm",
                                                                             "demo")
    with running_daemon(tmp_path_factory.mktemp("small"), text) as small, \
            openai_client(small) as client:
        small.wait_serving(1)
        response = client.responses.create(model="demo", input="hi", max_output_tokens=3)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
    assert f"response {response.id} is larger than its owner may keep" in caplog.text


def test_the_output_texts_logprobs_are_chats_streamed_and_not(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    said = "Say it. [result]"
    chat = client.chat.completions.create(model="agent", messages=[{"role": "user",
                                                                    "content": said}],
                                          logprobs=True, top_logprobs=2, temperature=0)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    want = [e.model_dump() for e in chat.choices[0].logprobs.content]
    full = client.responses.create(model="agent", input=said, top_logprobs=2, temperature=0,
                                   include=["message.output_text.logprobs"], store=False)
    (message,) = full.output
    got = [e.model_dump() for e in message.content[0].logprobs]  # type: ignore[union-attr]
    assert got == want and all(len(e["top_logprobs"]) == 2 for e in got)
    events = list(client.responses.create(model="agent", input=said, top_logprobs=2,
                                          temperature=0, stream=True, store=False))
    streamed = [e.model_dump() for ev in events if ev.type == "response.output_text.delta"
                for e in ev.logprobs]
    assert streamed == want
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    assert [e.model_dump() for e in done.logprobs] == want


def test_truncation_auto_drops_the_oldest_turns_to_fit_the_context(
    model_dir: Path, tmp_path: Path
) -> None:
    """A conversation that outgrew the model's context: with ``truncation: "auto"`` its
    oldest turns go (the instructions and the question stay); without it, the 400."""
    models = '[[model]]\nname = "short"\ncontext_length = 300\n'
    history: list[Any] = []
    for turn in range(12):
        history += [{"role": "user", "content": f"Tell me about item {turn} in some detail."},
                    {"role": "assistant", "content": f"Item {turn} is a fine item indeed."}]
    ask = {"model": "short", "instructions": "Be brief.", "max_output_tokens": 20,
           "input": [*history, {"role": "user", "content": "Say it. [result]"}]}
    with scripted_daemon(model_dir, tmp_path, models, engine_table("sim", "vllm", "short"),
                         SCRIPTS) as daemon:
        whole = http.post(daemon.url + "/v1/responses", json=ask)
        assert whole.status_code == 400, whole.text
        assert whole.json()["error"]["code"] == "context_length_exceeded"
        cut = http.post(daemon.url + "/v1/responses", json={**ask, "truncation": "auto"})
        assert cut.status_code == 200, cut.text
        body = cut.json()
        assert body["truncation"] == "auto" and body["output"][0]["content"][0]["text"] == \
            "It is sunny in Zürich."
        used = body["usage"]["input_tokens"]
        assert 300 - 20 - 30 < used <= 300 - 20  # as many turns kept as fit, no more
        kept = http.get(f"{daemon.url}/v1/responses/{body['id']}/input_items",
                         params={"limit": 100}).json()
        assert len(kept["data"]) == len(ask["input"])  # the record keeps the whole conversation
        alone = http.post(daemon.url + "/v1/responses", json={
            **ask, "truncation": "auto", "max_output_tokens": 290,
            "input": [{"role": "user", "content": "x " * 400}]})
        assert alone.status_code == 400 and alone.json()["error"]["param"] == "input"
