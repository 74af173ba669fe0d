"""End to end: the real daemon on loopback, simulated SGLang engines, the official openai client."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.crossings import crossings
from tests.support.daemon import (
    Daemon,
    fleet_text,
    raw_stream,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import http, sdk_http
from tests.support.metrics import sample

# multibyte characters split over tokens (é, 中, 🚀): what the stream must reassemble
FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0,
        "multibyte_probability": 0.05}


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("e2e")
    text = fleet_text(
        model_dir,
        [
            sim_engine("a", **FAST, context_length=512),
            sim_engine("b", **FAST, context_length=512),
            sim_engine("wrong", **FAST, served_model_name="other-model"),
        ],
        frontend_extra="max_body_bytes = 20000",
    )
    with running_daemon(tmp, text) as d:
        d.wait_serving(2)
        yield d


@pytest.fixture()
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                         http_client=sdk_http())


CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def stream_chat(client: openai.OpenAI, **kwargs: object) -> tuple[str, list[object]]:
    stream = client.chat.completions.create(model="demo", messages=CHAT, stream=True, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_streaming_and_non_streaming_give_the_same_text(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=40)
    streamed, chunks = stream_chat(client, max_tokens=40)
    assert full.choices[0].message.content == streamed
    assert len(streamed) > 20
    assert full.choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 40


def test_streaming_usage_is_reported_once_at_the_end(client: openai.OpenAI) -> None:
    _, chunks = stream_chat(client, max_tokens=12, stream_options={"include_usage": True})
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is usage[0]
    assert usage[0].completion_tokens == 12
    assert usage[0].prompt_tokens > 5


def test_completions_endpoint_streaming_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=25)
    parts = client.completions.create(
        model="demo", prompt="Once upon a time", max_tokens=25, stream=True
    )
    streamed = "".join(p.choices[0].text for p in parts if p.choices)
    assert full.choices[0].text == streamed and streamed


def test_stop_string_is_not_emitted_and_ends_the_stream(client: openai.OpenAI) -> None:
    reference = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=60)
    text = reference.choices[0].message.content or ""
    words = text.split()
    stop = " ".join(words[4:6])  # spans several tokens, so it crosses chunk boundaries
    cut = text.index(stop)
    full = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=60, stop=[stop])
    streamed, chunks = stream_chat(client, max_tokens=60, stop=[stop])
    assert full.choices[0].message.content == text[:cut] == streamed
    assert full.choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert full.usage is not None and full.usage.completion_tokens < 60


def test_models_health_ready_metrics_and_request_id(daemon: Daemon, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["demo"]
    assert http.get(daemon.url + "/health").status_code == 200
    ready = http.get(daemon.url + "/ready").json()
    assert ready == {"ready": True, "serving": 2, "engines": 3, "waiting_for_pools": []}
    response = http.post(
        daemon.url + "/v1/chat/completions",
        json={"model": "demo", "messages": CHAT, "max_tokens": 3},
    )
    assert response.status_code == 200
    assert len(response.headers["x-request-id"]) >= 8
    metrics = http.get(daemon.url + "/metrics").text
    for name in (
        "direct_frontend_requests_total",
        "direct_frontend_time_to_first_token_seconds",
        "direct_frontend_inter_token_latency_seconds",
        "direct_frontend_in_flight_requests",
        'direct_frontend_engine_state{engine="wrong",state="refused"} 1.0',
        'direct_frontend_engine_state{engine="a",state="serving"} 1.0',
        "direct_frontend_engine_in_flight",
    ):
        assert name in metrics
    # once the chat above has finished, nothing is in flight: a scrape does not count itself
    wait_for(
        lambda: sample(http.get(daemon.url + "/metrics").text,
                       "direct_frontend_in_flight_requests") == 0,
        what="no request in flight",
    )  # fmt: skip


def test_an_engine_serving_another_model_is_never_selected(daemon: Daemon) -> None:
    wrong = daemon.supervisor.simulators["wrong"]
    before = wrong.stats.requests
    for _ in range(6):
        r = http.post(
            daemon.url + "/v1/completions",
            json={"model": "demo", "prompt": "hello", "max_tokens": 2},
        )
        assert r.status_code == 200
    assert wrong.stats.requests == before
    child = daemon.supervisor.children["wrong"]
    assert child.state.value == "refused"
    assert "other-model" in child.last_error


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'{"model":"demo"}', 400, "messages"),
        (b'{"model":"demo","messages":"hi"}', 400, "messages"),
        (b'{"model":"demo","messages":[{"role":"user","content":"x"}],"temperature":9}', 400,
         "temperature"),
        (b'{"model":"nope","messages":[{"role":"user","content":"x"}]}', 404, "model"),
        (b'{"model":"demo","messages":[{"role":"user","content":"' + b"x" * 30000 + b'"}]}', 413,
         None),
        (b'{"model":"demo","messages":[{"role":"user","content":"x"}],"max_tokens":100000}', 400,
         "max_tokens"),
    ],
)
def test_bad_requests_get_openai_errors(
    daemon: Daemon, body: bytes, status: int, param: str | None
) -> None:
    r = http.post(daemon.url + "/v1/chat/completions", content=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_unknown_route_and_wrong_method(daemon: Daemon) -> None:
    assert http.get(daemon.url + "/v1/nothing").status_code == 404
    r = http.get(daemon.url + "/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]


def test_prompt_longer_than_the_context_is_rejected_before_dispatch(daemon: Daemon) -> None:
    sims = daemon.supervisor.simulators
    before = sims["a"].stats.requests + sims["b"].stats.requests
    r = http.post(
        daemon.url + "/v1/completions",
        json={"model": "demo", "prompt": list(range(10, 700)), "max_tokens": 1},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert sims["a"].stats.requests + sims["b"].stats.requests == before


def test_multibyte_text_round_trips_through_the_stream(client: openai.OpenAI) -> None:
    streamed, _ = stream_chat(client, max_tokens=80)
    streamed.encode("utf-8")  # never half a character
    assert "\ufffd" not in streamed
    assert not streamed.isascii()  # there were characters to reassemble


def test_client_disconnect_aborts_the_engine_request(model_dir: Path, tmp_path: Path) -> None:
    slow = sim_engine("slow", decode_us_per_token=20000, prefill_us_per_token=0,
                      eos_probability=0.0)
    with running_daemon(tmp_path, fleet_text(model_dir, [slow])) as d:
        d.wait_serving(1)
        engine = d.supervisor.simulators["slow"]
        body = {"model": "demo", "messages": CHAT, "max_tokens": 1000, "stream": True}
        with raw_stream(d.url, body, events=4):
            wait_for(lambda: engine.stats.running == 1, what="the engine to run the request")
        wait_for(lambda: engine.stats.running == 0, what="the engine slot to be freed")
        wait_for(lambda: engine.stats.aborts_received == 1, what="the engine to get an Abort")
        assert engine.stats.abort_request_ids == engine.stats.request_ids[-1:]
        metrics = http.get(d.url + "/metrics").text
        assert "direct_frontend_cancelled_requests_total 1.0" in metrics


def test_no_serving_engine_gives_503(model_dir: Path, tmp_path: Path) -> None:
    nobody = {"name": "down", "url": "grpc://127.0.0.1:1", "kind": "sglang"}
    extra = "[frontend.faults]\nwait_for_engine_s = 0.2"  # after waiting that long for one
    with running_daemon(tmp_path, fleet_text(model_dir, [nobody], frontend_extra=extra)) as d:
        started = time.monotonic()
        r = http.post(
            d.url + "/v1/chat/completions", json={"model": "demo", "messages": CHAT}
        )
        assert time.monotonic() - started >= 0.2
        assert r.status_code == 503
        assert "retry-after" in r.headers
        assert http.get(d.url + "/ready").status_code == 503


def test_a_clients_request_id_is_answered_back_and_a_malformed_one_replaced(
    daemon: Daemon,
) -> None:
    body = {"model": "demo", "messages": CHAT, "max_tokens": 4}
    for stream in (False, True):
        answers = [http.post(daemon.url + "/v1/chat/completions",
                              json={**body, "stream": stream},
                              headers={"x-request-id": "trace-7f3a.9c2e"}) for _ in range(2)]
        assert all(a.status_code == 200 for a in answers)  # one id twice: both served
        assert [a.headers["x-request-id"] for a in answers] == ["trace-7f3a.9c2e"] * 2
    for bad in ("has space", "x" * 129, "quote\""):
        answer = http.post(daemon.url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": bad})
        assert answer.status_code == 200 and len(answer.headers["x-request-id"]) == 16
    missing = http.get(daemon.url + "/nowhere", headers={"x-request-id": "trace-404"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "trace-404"


def test_one_access_log_line_per_request_and_none_for_probes(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="direct_frontend.access")
    answer = http.post(daemon.url + "/v1/chat/completions", headers={"x-request-id": "t-1"},
                        json={"model": "demo", "messages": CHAT, "max_tokens": 2})
    http.get(daemon.url + "/health", headers={"x-request-id": "t-2"})
    http.get(daemon.url + "/nowhere", headers={"x-request-id": "t-3"})

    def lines() -> list[logging.LogRecord]:  # each is written once its answer is sent
        return [r for r in caplog.records if r.name == "direct_frontend.access"
                and r.__dict__["request_id"].startswith(("t-1.", "t-2.", "t-3."))]

    wait_for(lambda: len(lines()) >= 2, what="the access-log lines")
    assert [r.getMessage() for r in lines()] == ["POST /v1/chat/completions 200",
                                                 "GET /nowhere 404"]
    first = lines()[0].__dict__
    assert first["method"] == "POST" and first["status"] == 200 and first["model"] == "demo"
    assert first["request_id"].startswith("t-1.") and first["duration_ms"] > 0
    assert first["client"].startswith("127.0.0.1:") and answer.headers["x-request-id"] == "t-1"


def test_every_answer_carries_a_request_id(daemon: Daemon) -> None:
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/fleet"):
        answer = http.get(daemon.url + path)
        assert answer.status_code == 200 and len(answer.headers["x-request-id"]) == 16, path
        assert answer.headers.get_list("x-request-id") == [answer.headers["x-request-id"]]


#: a whole request crosses http/ <-> pipeline/ this way and no other (tests/support/crossings.py)
ONE_WALK = {("in", "Stair.serve"), ("out", "Writer.__call__")}
#: a background response: its stair's rest runs later, into the response's log
BACKGROUND_WALK = ONE_WALK | {("in", "Later.run"), ("out", "_Run.__call__")}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "n": 2, "logprobs": True}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 5, "stream": True, "echo": True}),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 5}),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 5, "stream": True}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 5, "stream": True}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 5}),
])
def test_a_request_crosses_into_the_pipeline_once_and_its_events_come_out_once(
    daemon: Daemon, path: str, body: dict[str, object],
) -> None:
    with crossings(daemon) as seen:
        reply = http.post(daemon.url + path, json={"model": "demo", **body}, timeout=10)
    assert reply.status_code == 200, reply.text
    assert seen == ONE_WALK


def test_a_background_response_crosses_twice_more_for_the_rest_of_its_walk(
    daemon: Daemon,
) -> None:
    with crossings(daemon) as seen:
        queued = http.post(daemon.url + "/v1/responses", json={
            "model": "demo", "input": "Hello", "max_output_tokens": 5, "background": True,
        }, timeout=10).json()
        wait_for(lambda: http.get(f"{daemon.url}/v1/responses/{queued['id']}").json()[
            "status"] == "incomplete", what="the background response (max_output_tokens)")
    assert seen == BACKGROUND_WALK and len(seen) <= 4
