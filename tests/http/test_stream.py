"""The one writer (http/stream.py) and the chat renderer it runs, on events fed by hand.

The stair is a coroutine the test writes: it sends the events a real one
would, in order, so what goes out (the ASGI messages) and the status are
the writer's alone. No socket: ``send`` collects, ``receive`` is the
client.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from direct_frontend.http.asgi import Message
from direct_frontend.http.completions import CompletionsRenderer
from direct_frontend.http.disconnect import Disconnect
from direct_frontend.http.stream import Renderer, Writer
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.errors import engine_failed
from direct_frontend.openai.parse import parse_chat_request, parse_completion_request
from direct_frontend.pipeline.ratelimit import RateLimited, Refusal, Standing, Window
from direct_frontend.pipeline.relay_events import Batch, Failed, Finished, Opened, Usage
from direct_frontend.pipeline.serve_events import (
    ADMITTED,
    Charged,
    Placed,
    Prepared,
    StairEvent,
)
from direct_frontend.text.model_dir import TextModel

PROMPT = 7


def batch(text: str, completion: int, cached: int = 0) -> Batch:
    return Batch(text, 1, None, (), (), PROMPT, completion, cached)


def finished(last: Batch, completion: int, cached: int = 0) -> Finished:
    return Finished(last, "length", None, None, Usage(PROMPT, completion, cached))


class Client:
    """An ASGI client: what the app sent it, and (``leaves``) whether it hangs up."""

    def __init__(self, leaves: bool = False) -> None:
        self.sent: list[Message] = []
        self.leaves = leaves

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def receive(self) -> Message:
        if self.leaves:
            return {"type": "http.disconnect"}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    @property
    def status(self) -> int:
        return int(next(m["status"] for m in self.sent if m["type"] == "http.response.start"))

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    def header(self, name: bytes) -> bytes | None:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return dict(start["headers"]).get(name)


def run(client: Client, events: list[tuple[StairEvent, int]] | Callable[[Writer], Awaitable[None]],
        render: Callable[[Prepared | None], Renderer], *,
        anthropic: bool = False, disconnect: Disconnect | None = None) -> tuple[int, object]:
    """The writer's status and result after the stair ``events`` describe."""
    async def walk(writer: Writer) -> str:
        assert not callable(events)
        for event, index in events:
            await writer(event, index)
        return "walked"

    async def main() -> tuple[int, object]:
        writer = Writer(client.send, client.receive, [(b"x-request-id", b"r1")], Metrics(),
                        anthropic=anthropic, disconnect=disconnect)
        return await writer.run(render, events if callable(events) else walk)

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def chunks(body: bytes) -> list[str]:
    return [event.removeprefix("data: ") for event in body.decode().split("\n\n") if event]


def prepared(text_model: TextModel, body: dict[str, Any], prompts: int = 1) -> Prepared:
    raw = json.dumps({"model": "m", **body}).encode()
    request = (parse_chat_request(raw) if "messages" in body else parse_completion_request(raw))
    return Prepared(request, "r1", (PROMPT,) * prompts, text_model.token_bytes)


def start(ready: Prepared) -> list[tuple[StairEvent, int]]:
    return [(ready, 0), (Charged(None), 0), (ADMITTED, 0), (Placed(PROMPT), 0)]


def test_a_stream_goes_out_with_its_first_output_and_ends_once(text_model: TextModel) -> None:
    ready = prepared(text_model, {"messages": [{"role": "user", "content": "hi"}],
                                  "stream": True})
    first, last = batch("Hello", 1), batch(" there", 2)
    client = Client()
    status, result = run(client, [*start(ready), (Opened(Usage(PROMPT, 0), "a"), 0),
                                  (first, 0), (finished(last, 2), 0)],
                         lambda p: CompletionsRenderer("chat", ready))
    assert (status, result) == (200, "walked")
    assert client.sent[0]["type"] == "http.response.start"
    assert client.header(b"content-type") == b"text/event-stream; charset=utf-8"
    assert client.sent[-1]["more_body"] is False
    events = chunks(client.body)
    assert events[-1] == "[DONE]"
    parsed = [ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
    assert parsed[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
    assert text == "Hello there" and parsed[-1].choices[0].finish_reason == "length"


def test_a_failure_is_an_http_error_before_the_head_and_an_error_event_after(
    text_model: TextModel,
) -> None:
    ready = prepared(text_model, {"messages": [{"role": "user", "content": "hi"}],
                                  "stream": True})
    failed = Failed(engine_failed("gone"), Usage(PROMPT, 0))
    before = Client()
    status, _ = run(before, [*start(ready), (failed, 0)],
                    lambda p: CompletionsRenderer("chat", ready))
    assert status == before.status == failed.error.status
    assert json.loads(before.body)["error"]["message"] == failed.error.message

    after = Client()
    status, _ = run(after, [*start(ready), (Opened(Usage(PROMPT, 0), "a"), 0),
                            (batch("Hel", 1), 0), (failed, 0)],
                    lambda p: CompletionsRenderer("chat", ready))
    assert status == after.status == 200
    events = chunks(after.body)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == (
        failed.error.message)


def test_a_refusal_over_a_rate_limit_is_the_endpoints_429(text_model: TextModel) -> None:
    standing = Standing(Window(2, 0, 30.0), None)
    refusal = Refusal("requests", 1, 30.0, standing)

    async def over(writer: Writer) -> None:
        raise RateLimited(refusal, "other")

    for anthropic, named in ((False, b"x-ratelimit-limit-requests"),
                             (True, b"anthropic-ratelimit-requests-limit")):
        client = Client()
        status, _ = run(client, over, lambda p: Renderer(), anthropic=anthropic)
        assert status == client.status == 429
        assert client.header(b"retry-after") == b"30" and client.header(named) == b"2"


def test_the_rate_limits_go_out_with_the_answer(text_model: TextModel) -> None:
    ready = prepared(text_model, {"prompt": "hi"})
    charged = Charged(Standing(Window(60, 59, 1.0), None))
    events: list[tuple[StairEvent, int]] = [
        (ready, 0), (charged, 0), (ADMITTED, 0), (Placed(PROMPT), 0),
        (Opened(Usage(PROMPT, 0), "a"), 0), (finished(batch("ok", 1), 1), 0)]
    client = Client()
    status, _ = run(client, events, lambda p: CompletionsRenderer("completion", ready))
    assert status == 200 and client.header(b"x-ratelimit-remaining-requests") == b"59"
    assert Completion.model_validate_json(client.body).choices[0].text == "ok"


def test_a_client_that_leaves_cancels_the_walk_from_its_admission(
    text_model: TextModel,
) -> None:
    ready = prepared(text_model, {"prompt": "hi"})
    reached: list[str] = []

    async def walk(writer: Writer) -> None:
        for event, _ in start(ready)[:3]:
            await writer(event)
        reached.append("admitted")
        await trio.sleep(3600)  # waiting for an engine
        reached.append("placed")

    client = Client(leaves=True)
    assert run(client, walk, lambda p: CompletionsRenderer("completion", ready)) == (499, None)
    assert reached == ["admitted"] and client.sent == []


class Unread(Client):
    """A client whose ``receive`` no one may read: its server tells its disconnect."""

    async def receive(self) -> Message:
        raise AssertionError("the writer read receive although its server tells the disconnect")


@pytest.mark.parametrize("when", ["before", "while"])
def test_a_disconnect_the_server_tells_cancels_the_walk_from_its_admission(
    text_model: TextModel, when: str,
) -> None:
    """No task reads ``receive``: the server fires the :class:`Disconnect`, before the
    admission (it is watched from there on) or while the request waits for an engine."""
    ready = prepared(text_model, {"prompt": "hi"})
    reached: list[str] = []
    disconnect = Disconnect()

    async def walk(writer: Writer) -> None:
        if when == "before":
            disconnect.fire()
        for event, _ in start(ready)[:3]:
            await writer(event)
        reached.append("admitted")
        if when == "while":
            disconnect.fire()
        await trio.sleep(3600)  # waiting for an engine
        reached.append("placed")

    client = Unread()
    assert run(client, walk, lambda p: CompletionsRenderer("completion", ready),
               disconnect=disconnect) == (499, None)
    assert reached == ["admitted"] and client.sent == []


def test_a_disconnect_before_the_admission_of_a_refused_request_is_its_refusal(
    text_model: TextModel,
) -> None:
    """Not watched yet: the refusal is answered and counted as itself, not as a client
    that left; a request that ends without one is answered as usual."""
    ready = prepared(text_model, {"prompt": "hi"})
    failed = Failed(engine_failed("gone"), Usage(PROMPT, 0))
    disconnect = Disconnect()
    disconnect.fire()
    client = Unread()
    status, _ = run(client, [(ready, 0), (failed, 0)],
                    lambda p: CompletionsRenderer("completion", ready), disconnect=disconnect)
    assert status == client.status == failed.error.status
    quiet = Unread()
    status, result = run(quiet, [*start(ready), (Opened(Usage(PROMPT, 0), "a"), 0),
                                 (finished(batch("ok", 1), 1), 0)],
                         lambda p: CompletionsRenderer("completion", ready),
                         disconnect=Disconnect())
    assert (status, result) == (200, "walked")
    assert Completion.model_validate_json(quiet.body).choices[0].text == "ok"


def test_an_unexpected_error_before_the_head_is_raised_and_after_it_ends_the_stream(
    text_model: TextModel,
) -> None:
    ready = prepared(text_model, {"prompt": "hi", "stream": True})

    def broken(events: int) -> Callable[[Writer], Awaitable[None]]:
        async def walk(writer: Writer) -> None:
            stair: list[tuple[StairEvent, int]] = [
                *start(ready), (Opened(Usage(PROMPT, 0), "a"), 0)]
            for event, index in stair[:events]:
                await writer(event, index)
            raise KeyError("a bug")
        return walk

    with pytest.raises(KeyError):
        run(Client(), broken(4), lambda p: CompletionsRenderer("completion", ready))
    client = Client()
    assert run(client, broken(5), lambda p: CompletionsRenderer("completion", ready))[0] == 500
    events = chunks(client.body)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])


def test_several_choices_count_each_prompt_once_and_each_choices_output(
    text_model: TextModel,
) -> None:
    """Two prompts, two choices each (choice ``p × n + j``); the cached tokens are each
    prompt's first choice's, as a lone request reports them."""
    ready = prepared(text_model, {"prompt": ["a", "b"], "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}}, prompts=2)
    events: list[tuple[StairEvent, int]] = list(start(ready))
    for index in (0, 1, 2, 3):
        events.append((Opened(Usage(PROMPT, 0, 3), "a"), index))
    for index, (completion, cached) in enumerate(((2, 3), (4, 5), (1, 1), (3, 9))):
        events.append((finished(batch(f"t{index}", completion, cached), completion, cached),
                       index))
    client = Client()
    status, _ = run(client, events, lambda p: CompletionsRenderer("completion", ready))
    assert status == 200
    parsed = [json.loads(e) for e in chunks(client.body)[:-1]]
    assert {c["choices"][0]["index"] for c in parsed if c["choices"]} == {0, 1, 2, 3}
    usage = parsed[-1]["usage"]
    assert parsed[-1]["choices"] == [] and usage["prompt_tokens"] == 2 * PROMPT
    assert usage["completion_tokens"] == 2 + 4 + 1 + 3
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3 + 1
