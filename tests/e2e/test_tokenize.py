"""``POST /tokenize`` and ``/detokenize`` end to end: the served model's tokenizer, vLLM's bodies.

A chat is tokenized exactly as a generation request of the same messages
is (the engine's prompt: the simulator reports its length as usage), and
the ids round-trip through ``/detokenize``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from direct_frontend.text.model_dir import TextModel
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine
from tests.support.http import http

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("a", eos_probability=0.0, context_length=3000)])
    with running_daemon(tmp_path_factory.mktemp("tokenize"), text) as running:
        running.wait_serving(1)
        yield running


def post(daemon: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(daemon.url + path, json={"model": "demo", **body}, timeout=30)


def test_a_prompt_is_tokenized_as_a_completion_would_be(
    daemon: Daemon, text_model: TextModel
) -> None:
    reply = post(daemon, "/tokenize", {"prompt": "Once upon a time", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ids = text_model.encode("Once upon a time", add_special_tokens=True)
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == 3000  # the engine's context, as /v1/models says
    assert body["token_strs"] == [text_model.id_to_token(i) for i in ids]
    bare = post(daemon, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False})
    assert bare.json()["tokens"] == text_model.encode("Once upon a time")
    assert bare.json()["token_strs"] is None
    completion = post(daemon, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_chat_is_tokenized_as_its_generation_request_is(
    daemon: Daemon, text_model: TextModel
) -> None:
    for tools in (None, TOOLS):
        extra = {} if tools is None else {"tools": tools}
        body = post(daemon, "/tokenize", {"messages": CHAT, **extra}).json()
        chat = post(daemon, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **extra})
        assert body["count"] == chat.json()["usage"]["prompt_tokens"], tools
        rendered = text_model.render_chat(CHAT, tools=tools)  # type: ignore[arg-type]
        assert body["tokens"] == text_model.encode(rendered)
    without = post(daemon, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    rendered = text_model.render_chat(CHAT, add_generation_prompt=False)  # type: ignore[arg-type]
    assert without.json()["tokens"] == text_model.encode(rendered)
    assert without.json()["count"] < body["count"]


def test_token_ids_come_back_as_their_text(daemon: Daemon, text_model: TextModel) -> None:
    ids = post(daemon, "/tokenize", {"messages": CHAT}).json()["tokens"]
    reply = post(daemon, "/detokenize", {"tokens": ids})
    assert reply.status_code == 200
    assert reply.json() == {"prompt": text_model.decode(ids, skip_special_tokens=False)}
    assert reply.json()["prompt"] == text_model.render_chat(CHAT)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**7]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_bodies_are_a_clear_4xx(
    daemon: Daemon, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    reply = post(daemon, path, body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_only_post_is_served(daemon: Daemon) -> None:
    reply = http.get(daemon.url + "/tokenize", timeout=10)
    assert reply.status_code == 405 and reply.headers["allow"] == "POST"
