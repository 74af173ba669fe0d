"""Fuzzing the generation endpoints: no body, however hostile, gets a 5xx.

The real daemon runs in-process (tests/support/daemon.py) over one simulated
engine of each kind with round-robin routing, and every generated body is
sent three times, so each kind's dialect sees it. Bodies put extreme values
(the int32/uint32/int64/uint64 edges, 1e308, 1e999, NaN and Infinity
literals, strings and floats where integers belong) in every numeric field
the parser accepts, nest unknown and free-form fields to random depths, and
break types. Every answer must be a 2xx or a 4xx; every error is an OpenAI
error body; every response names its request in ``x-request-id``; a stream
that started never ends with a server error.

Derandomized (a fixed seed) and bounded, so CI sees the same examples each run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine

KINDS = ("sglang", "vllm", "trtllm")
FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0}
#: a raw JSON number json.dumps cannot write (it overflows a double)
HUGE = "__1e999__"

EDGE_INTS = [
    0, -1, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
    -(2**31), -(2**63) - 1, 10**12, 10**30,
]
EDGE_FLOATS = [
    0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, -2.5, 1e-308, 1e308, -1e308, 3.5e38,
    float("nan"), float("inf"), float("-inf"),
]
WRONG = [None, True, False, "", "1", "NaN", "Infinity", "-1e999", HUGE, [], {}, [1], {"a": 1}]

edge_numbers = st.one_of(
    st.sampled_from(EDGE_INTS), st.integers(-2, 40), st.sampled_from(EDGE_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True),
)
any_value = st.one_of(edge_numbers, st.sampled_from(WRONG))


def nested(depth: int) -> bytes:
    """Objects and arrays alternating ``depth`` levels deep around a number, as raw JSON
    (json.dumps itself would overflow the stack on the deepest)."""
    opens = b"".join(b"[" if level % 2 else b'{"k":' for level in range(depth))
    closes = b"".join(b"]" if level % 2 else b"}" for level in reversed(range(depth)))
    return opens + b"1" + closes


DEEP = re.compile(rb'"__deep(\d+)__"')
depths = st.one_of(st.integers(0, 70), st.sampled_from([127, 128, 129, 1000, 5000]))
deep_values = depths.map(lambda depth: f"__deep{depth}__")  # spliced in by encode()


def encode(body: dict[str, Any]) -> bytes:
    """``body`` as JSON, with the raw numbers and deep nests json.dumps cannot write."""
    raw = json.dumps(body).encode().replace(json.dumps(HUGE).encode(), b"1e999")
    return DEEP.sub(lambda m: nested(int(m.group(1))), raw)

NUMERIC_FIELDS = [
    "max_tokens", "max_completion_tokens", "min_tokens", "n", "top_k", "seed",
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty",
]
CHAT_ONLY = ["top_logprobs"]
COMPLETION_ONLY = ["best_of", "logprobs"]


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": "demo"}
    if chat:
        message: dict[str, Any] = {"role": "user", "content": "Tell me about the sea."}
        if draw(st.booleans()):
            message[draw(st.sampled_from(["extra", "content", "name"]))] = draw(
                st.one_of(any_value, deep_values)
            )
        body["messages"] = [message]
    else:
        body["prompt"] = draw(st.one_of(
            st.just("Once upon a time"),
            st.lists(st.one_of(st.integers(0, 300), st.sampled_from(EDGE_INTS)),
                     min_size=1, max_size=4),
            st.lists(st.lists(st.sampled_from(EDGE_INTS), min_size=1, max_size=2),
                     min_size=1, max_size=1),
            any_value,
        ))
    fields = NUMERIC_FIELDS + (CHAT_ONLY if chat else COMPLETION_ONLY)
    for name in draw(st.lists(st.sampled_from(fields), max_size=5, unique=True)):
        body[name] = draw(any_value)
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(st.one_of(
            st.lists(st.sampled_from(EDGE_INTS), max_size=3), any_value
        ))
    if draw(st.booleans()):
        body["logit_bias"] = {str(draw(st.sampled_from(EDGE_INTS))): draw(edge_numbers)}
    if draw(st.booleans()):
        where = draw(st.sampled_from(["unknown", "chat_template_kwargs", "tools", "stop"]))
        deep = draw(deep_values)
        if where == "unknown":
            body["x_unknown"] = deep
        elif where == "chat_template_kwargs":
            body[where] = {"x": deep}
        elif where == "tools":
            body[where] = [{"type": "function",
                            "function": {"name": "f", "parameters": {"x": deep}}}]
        else:
            body[where] = deep
    stream = draw(st.sampled_from([None, True, False]))
    if stream is not None:
        body["stream"] = stream
    if not draw(st.integers(0, 9)):  # now and then a broken type in a required field
        body["messages" if chat else "prompt"] = draw(any_value)
    return ("/v1/chat/completions" if chat else "/v1/completions"), encode(body)


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # TensorRT-LLM reports no context length, so only its contract bounds max_tokens.
    text = fleet_text(
        model_dir,
        [sim_engine(kind, kind, **FAST) for kind in KINDS],
        frontend_extra='max_tokens_default = 8\n[frontend.routing]\npolicy = "round_robin"',
    )
    with running_daemon(tmp_path_factory.mktemp("fuzz"), text) as d:
        d.wait_serving(3)
        yield d


@pytest.fixture(scope="module")
def poster(daemon: Daemon) -> Iterator[httpx.Client]:
    """One client for every example: its connection setup is not what is tested."""
    with httpx.Client(base_url=daemon.url, timeout=10) as client:
        yield client


def check_answer(response: httpx.Response) -> None:
    status = response.status_code
    assert 200 <= status < 500, (status, response.text)
    assert response.headers.get("x-request-id"), dict(response.headers)
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert b'"server_error"' not in response.content, response.text
        assert response.content.endswith(b"data: [DONE]\n\n")


@settings(
    max_examples=200, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=bodies())
def test_no_body_gets_a_5xx(poster: httpx.Client, request: tuple[str, bytes]) -> None:
    path, body = request
    for _ in KINDS:  # round robin: each kind gets it once
        check_answer(poster.post(path, content=body))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 2**31}, None),  # carried by vLLM, sent as "disabled" to the int32 kinds
        ({"top_k": 2**32}, "top_k"),
        ({"min_tokens": 2**32}, "min_tokens"),
        ({"stop_token_ids": [2**32]}, "stop_token_ids[0]"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"max_tokens": 2**31 - 1}, "max_tokens"),  # prompt + budget beyond int32
        ({"x": "__deep1000__"}, None),
        ({"logit_bias": {"2147483648": 0}}, "logit_bias.2147483648"),  # vLLM's keys are int32
    ],
)
def test_the_reported_overflows_are_answered(
    poster: httpx.Client, fields: dict[str, Any], param: str | None
) -> None:
    body = encode({"model": "demo", "prompt": "Once upon a time", **fields})
    for _ in KINDS:
        response = poster.post("/v1/completions", content=body)
        check_answer(response)
        if "top_k" in fields and param is None:
            assert response.status_code == 200
        else:
            assert response.status_code == 400
            assert response.json()["error"]["param"] == param


def test_an_unexpected_failure_is_an_openai_500_logged_once(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    """A body the server hands over wrongly (an int, not bytes) breaks the handler itself."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": 42, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []}
    assert daemon.app is not None
    with caplog.at_level("ERROR", logger="direct_frontend.http"):
        trio.from_thread.run(daemon.app, scope, receive, send, trio_token=daemon.token)
    start, body = sent
    assert start["status"] == 500
    request_id = dict(start["headers"])[b"x-request-id"]
    assert len(request_id) == 16
    assert json.loads(body["body"])["error"]["code"] == "internal_error"
    failures = [r for r in caplog.records if r.name == "direct_frontend.http"]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert "TypeError" in caplog.text
