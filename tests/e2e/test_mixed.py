"""End to end with a mixed fleet: one simulated SGLang, vLLM and TensorRT-LLM engine.

The daemon runs in-process on loopback (tests/support/daemon.py), each simulator
speaks its own kind's real gRPC contract with its quirks, and the official
``openai`` client talks to the daemon. Round robin over the three engines
puts each batch of three requests on each engine once (checked on the
simulators' own counters), so every kind must produce the same text and the
same usage as the others, streaming or not.

The fleet's served model name is the model directory: a TensorRT-LLM engine
reports no served name, only ``model_id`` (the path it was launched with),
and the simulator reports the model directory there, as the real adapter
reports its launch path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.daemon import (
    Daemon,
    fleet_text,
    raw_stream,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import sdk_http

KINDS = ("sglang", "vllm", "trtllm")
FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(
        model_dir,
        [sim_engine(kind, kind, **FAST, context_length=1024) for kind in KINDS],
        frontend_extra='[frontend.routing]\npolicy = "round_robin"',
    ).replace('served_model_name = "demo"', f'served_model_name = "{model_dir.resolve()}"')
    with running_daemon(tmp_path_factory.mktemp("mixed"), text) as d:
        d.wait_serving(3)
        yield d


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    # Closed after each test: an idle keep-alive connection would hold up the shutdown.
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       http_client=sdk_http()) as client:
        yield client


@pytest.fixture()
def model(daemon: Daemon) -> str:
    return str(daemon.fleet.frontend.served_model_name)


def once_per_kind(daemon: Daemon, send: Callable[[], Any]) -> list[Any]:
    """Send three requests; round robin must have put one on each engine."""
    sims = daemon.supervisor.simulators
    before = {kind: sims[kind].stats.requests for kind in KINDS}
    results = [send() for _ in KINDS]
    assert {kind: sims[kind].stats.requests - before[kind] for kind in KINDS} == dict.fromkeys(
        KINDS, 1
    )
    return results


def test_every_kind_gives_the_same_chat_text_and_usage(
    daemon: Daemon, client: openai.OpenAI, model: str
) -> None:
    def whole() -> Any:
        return client.chat.completions.create(model=model, messages=CHAT, max_tokens=30)

    def streamed() -> tuple[str, list[Any]]:
        chunks = list(client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=30, stream=True,
            stream_options={"include_usage": True},
        ))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    replies = once_per_kind(daemon, whole)
    texts = {r.choices[0].message.content for r in replies}
    assert len(texts) == 1 and len(texts.pop() or "") > 20
    prompt = replies[0].usage.prompt_tokens
    assert prompt > 5
    for reply in replies:
        assert reply.choices[0].finish_reason == "length"
        usage = reply.usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            prompt, 30, prompt + 30,
        )

    streams = once_per_kind(daemon, streamed)
    assert {text for text, _ in streams} == {replies[0].choices[0].message.content}
    for _, chunks in streams:
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1
        assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (prompt, 30)


def test_every_kind_gives_the_same_completion_text(
    daemon: Daemon, client: openai.OpenAI, model: str
) -> None:
    def whole() -> Any:
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=20)

    def streamed() -> str:
        parts = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=20, stream=True
        )
        return "".join(p.choices[0].text for p in parts if p.choices)

    replies = once_per_kind(daemon, whole)
    texts = {r.choices[0].text for r in replies}
    assert len(texts) == 1
    assert all(r.usage.completion_tokens == 20 for r in replies)
    assert set(once_per_kind(daemon, streamed)) == texts


def test_every_kind_stops_at_the_same_stop_string(
    daemon: Daemon, client: openai.OpenAI, model: str
) -> None:
    reference = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40)
    text = reference.choices[0].message.content or ""
    middle = len(text) // 3
    stop = text[middle : middle + 7]  # spans several tokens
    assert stop.strip()
    cut = text.index(stop)

    def whole() -> Any:
        return client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=40, stop=[stop]
        )

    for reply in once_per_kind(daemon, whole):
        assert reply.choices[0].message.content == text[:cut]
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens < 40


def test_discovery_per_kind(daemon: Daemon) -> None:
    children = daemon.supervisor.children
    infos = {kind: children[kind].info for kind in KINDS}
    assert infos["sglang"].context_length == 1024  # server_args.context_length
    assert infos["vllm"].context_length == 1024  # max_model_len
    assert infos["trtllm"].context_length is None  # never trusted
    # ... so it serves under [frontend] default_context_length
    assert children["trtllm"].handle.context_length == 131_072
    assert children["vllm"].handle.context_length == 1024
    assert infos["vllm"].block_size == 16 and infos["trtllm"].block_size is None
    assert infos["sglang"].incarnation and infos["vllm"].incarnation
    assert not infos["trtllm"].served_name_known


@pytest.mark.parametrize("kind", KINDS)
def test_client_disconnect_aborts_on_every_kind(
    kind: str, model_dir: Path, tmp_path: Path
) -> None:
    name = str(model_dir.resolve())
    slow = sim_engine(kind, kind, decode_us_per_token=20000, prefill_us_per_token=0,
                      eos_probability=0.0)
    text = fleet_text(model_dir, [slow]).replace(
        'served_model_name = "demo"', f'served_model_name = "{name}"'
    )
    with running_daemon(tmp_path, text) as d:
        d.wait_serving(1)
        engine = d.supervisor.simulators[kind]
        body = {"model": name, "messages": CHAT, "max_tokens": 1000, "stream": True}
        with raw_stream(d.url, body, events=3):
            wait_for(lambda: engine.stats.running == 1, what="the engine to run the request")
        wait_for(lambda: engine.stats.running == 0, what="the engine slot to be freed")
        wait_for(lambda: engine.stats.aborts_received == 1, what="the engine to get an Abort")
        assert engine.stats.abort_request_ids == engine.stats.request_ids[-1:]
