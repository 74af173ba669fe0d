"""Response rendering (checked with the official openai types), metrics and logging."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from direct_frontend.errors import ErrorKind
from direct_frontend.http.openai_schema import engine_failed, error_body
from direct_frontend.http.render import ChunkRenderer, Usage, render_full, render_models
from direct_frontend.observability.logging import (
    configure_logging,
    current_request_id,
    log_once,
    new_request_id,
    redact,
)
from direct_frontend.observability.metrics import ENGINE_STATES, Metrics

MODEL = 'org/model "v2"'  # quotes prove the model name is JSON-escaped


def sse_data(event: bytes) -> str:
    """The payload of exactly one SSE ``data:`` event."""
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    assert event.count(b"\n\n") == 1
    return event[len(b"data: ") : -2].decode()


# ---------------------------------------------------------------- streamed chat chunks


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_parses_with_openai_types(include_usage: bool) -> None:
    r = ChunkRenderer("chat", "abc123", MODEL, 1_700_000_000, include_usage)
    texts = ["Hel", "lo, ", 'wörld "quoted"\n', "\u2028 \t\\ </s>", ""]
    chunks = [ChatCompletionChunk.model_validate_json(sse_data(r.role_chunk()))]
    chunks += [ChatCompletionChunk.model_validate_json(sse_data(r.text(t))) for t in texts]
    chunks.append(ChatCompletionChunk.model_validate_json(sse_data(r.finish("stop", "</s>"))))
    for c in chunks:
        assert c.id == "chatcmpl-abc123"
        assert c.object == "chat.completion.chunk"
        assert c.created == 1_700_000_000
        assert c.model == MODEL
        assert len(c.choices) == 1
        assert c.choices[0].index == 0
        assert c.usage is None
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert [c.choices[0].delta.content for c in chunks[1:-1]] == texts
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop"
    assert last.delta.content is None
    assert last.model_extra == {"stop_reason": "</s>"}

    usage_event = r.usage(10, 5, 4)
    if not include_usage:
        assert usage_event == b""
    else:
        u = ChatCompletionChunk.model_validate_json(sse_data(usage_event))
        assert u.choices == []
        assert u.usage is not None
        assert (u.usage.prompt_tokens, u.usage.completion_tokens, u.usage.total_tokens) == (
            10,
            5,
            15,
        )
        assert u.usage.prompt_tokens_details is not None
        assert u.usage.prompt_tokens_details.cached_tokens == 4
        # OpenAI sends "usage": null on every other chunk when usage was asked for.
        assert '"usage":null' in sse_data(r.text("x"))
    assert r.done() == b"data: [DONE]\n\n"


def test_finish_with_token_id_stop_reason_and_length() -> None:
    r = ChunkRenderer("chat", "x", "m", 1, False)
    c = ChatCompletionChunk.model_validate_json(sse_data(r.finish("stop", 128009)))
    assert c.choices[0].model_extra == {"stop_reason": 128009}
    c = ChatCompletionChunk.model_validate_json(sse_data(r.finish("length", None)))
    assert c.choices[0].finish_reason == "length"
    assert c.choices[0].model_extra == {"stop_reason": None}


def test_error_event_carries_the_openai_error() -> None:
    r = ChunkRenderer("chat", "x", "m", 1, True)
    err = engine_failed("engine went away")
    data = json.loads(sse_data(r.error(err)))
    assert data == json.loads(error_body(err))
    assert data["error"]["message"] == "engine went away"
    assert data["error"]["code"] == "engine_error"


def test_lone_surrogate_does_not_break_the_stream() -> None:
    r = ChunkRenderer("chat", "x", "m", 1, False)
    c = ChatCompletionChunk.model_validate_json(sse_data(r.text("a\ud800b")))
    assert c.choices[0].delta.content == "a?b"


# ---------------------------------------------------------------- streamed completion chunks


def test_completion_stream_parses_with_openai_types() -> None:
    r = ChunkRenderer("completion", "abc", MODEL, 42, True)
    assert r.role_chunk() == b""
    raw = json.loads(sse_data(r.text('one "two"\n')))
    # Streamed text chunks carry finish_reason null (as OpenAI and vLLM send), which the
    # client reads without validation; Completion's strict model demands a reason, so
    # validate the rest of the chunk with a reason filled in.
    assert raw["choices"][0]["finish_reason"] is None
    raw["choices"][0]["finish_reason"] = "stop"
    c = Completion.model_validate(raw)
    assert (c.id, c.object, c.created, c.model) == ("cmpl-abc", "text_completion", 42, MODEL)
    assert c.choices[0].text == 'one "two"\n'

    fin = Completion.model_validate_json(sse_data(r.finish("length", None)))
    assert fin.choices[0].finish_reason == "length"
    assert fin.choices[0].text == ""

    u = Completion.model_validate_json(sse_data(r.usage(3, 2, 0)))
    assert u.choices == []
    assert u.usage is not None
    assert u.usage.total_tokens == 5


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown response kind"):
        ChunkRenderer("embedding", "x", "m", 1, False)  # type: ignore[arg-type]


# ---------------------------------------------------------------- full responses and models


def test_render_full_chat() -> None:
    body = render_full("chat", "r1", MODEL, 7, "Hi there", "stop", "\n\n", Usage(12, 3, 8))
    c = ChatCompletion.model_validate_json(body)
    assert (c.id, c.object, c.created, c.model) == ("chatcmpl-r1", "chat.completion", 7, MODEL)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == "Hi there"
    assert c.choices[0].finish_reason == "stop"
    assert c.choices[0].model_extra == {"stop_reason": "\n\n"}
    assert c.usage is not None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (12, 3, 15)
    assert c.usage.prompt_tokens_details is not None
    assert c.usage.prompt_tokens_details.cached_tokens == 8


def test_render_full_completion() -> None:
    body = render_full("completion", "r2", "m", 7, "text", "length", None, Usage(1, 16))
    c = Completion.model_validate_json(body)
    assert (c.id, c.object) == ("cmpl-r2", "text_completion")
    assert c.choices[0].text == "text"
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None
    assert c.usage.total_tokens == 17


def test_render_full_scrubs_surrogates() -> None:
    c = ChatCompletion.model_validate_json(
        render_full("chat", "r", "m", 1, "x\udcff", "stop", None, Usage(1, 1))
    )
    assert c.choices[0].message.content == "x?"


def test_render_models() -> None:
    body = json.loads(render_models(["a", "b/c"], 99))
    assert body["object"] == "list"
    models = [Model.model_validate(m) for m in body["data"]]
    assert [(m.id, m.object, m.created, m.owned_by) for m in models] == [
        ("a", "model", 99, "direct-frontend"),
        ("b/c", "model", 99, "direct-frontend"),
    ]
    assert json.loads(render_models([], 1, owned_by="x")) == {"object": "list", "data": []}


# ---------------------------------------------------------------- metrics


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in the text exposition format."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    assert found is not None, f"no sample {name}{{{want}}}"
    return float(found.group(1))


def test_metrics_render_all_names() -> None:
    m = Metrics()
    m.request_started()
    m.request_finished("chat", 200, 0.5)
    m.observe_ttft(0.05)
    m.observe_inter_token(0.02, 1)
    m.add_tokens(10, 20)
    m.request_cancelled()
    m.set_engine_state("e1", "serving")
    m.set_engine_in_flight("e1", 3)
    m.engine_request("e1", "ok")
    m.malformed_engine_message("e1")
    m.engine_error("e1", ErrorKind.TIMEOUT)
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in (
        "requests_total",
        "request_duration_seconds",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "in_flight_requests",
        "engine_state",
        "engine_in_flight",
        "engine_requests_total",
        "prompt_tokens_total",
        "completion_tokens_total",
        "cancelled_requests_total",
        "malformed_engine_messages_total",
        "engine_errors_total",
    ):
        base = "direct_frontend_" + name.removesuffix("_total")
        assert re.search(rf"^# TYPE {base}(_total)? ", text, re.MULTILINE), name
    assert "_created" not in text  # noise series are off
    assert sample(text, "direct_frontend_requests_total", endpoint="chat", status="200") == 1
    assert sample(text, "direct_frontend_request_duration_seconds_count", endpoint="chat") == 1
    assert sample(text, "direct_frontend_in_flight_requests") == 0
    assert sample(text, "direct_frontend_prompt_tokens_total") == 10
    assert sample(text, "direct_frontend_completion_tokens_total") == 20
    assert sample(text, "direct_frontend_cancelled_requests_total") == 1
    assert sample(text, "direct_frontend_engine_in_flight", engine="e1") == 3
    assert sample(text, "direct_frontend_engine_requests_total", engine="e1", outcome="ok") == 1
    assert sample(text, "direct_frontend_malformed_engine_messages_total", engine="e1") == 1
    assert sample(text, "direct_frontend_engine_errors_total", engine="e1", kind="timeout") == 1
    assert sample(text, "direct_frontend_time_to_first_token_seconds_count") == 1


def test_fresh_instances_do_not_share_state() -> None:
    a, b = Metrics(), Metrics()
    a.request_cancelled()
    assert sample(a.render()[0].decode(), "direct_frontend_cancelled_requests_total") == 1
    assert sample(b.render()[0].decode(), "direct_frontend_cancelled_requests_total") == 0


def test_inter_token_latency_splits_the_gap_per_token() -> None:
    m = Metrics()
    m.observe_inter_token(0.04, 4)  # four tokens at 10 ms each
    m.observe_inter_token(0.5, 1)
    m.observe_inter_token(0.1, 0)  # nothing to attribute
    text = m.render()[0].decode()
    name = "direct_frontend_inter_token_latency_seconds"
    assert sample(text, name + "_count") == 5
    assert sample(text, name + "_sum") == pytest.approx(0.54)
    assert sample(text, name + "_bucket", le="0.005") == 0
    assert sample(text, name + "_bucket", le="0.01") == 4  # le is inclusive
    assert sample(text, name + "_bucket", le="0.3") == 4
    assert sample(text, name + "_bucket", le="0.5") == 5
    assert sample(text, name + "_bucket", le="+Inf") == 5


def test_engine_state_is_one_hot_and_forget_engine_drops_series() -> None:
    m = Metrics()
    m.set_engine_state("e1", "joining")
    m.set_engine_state("e1", "draining")
    m.set_engine_state("e2", "serving")
    m.engine_error("e1", "protocol")
    text = m.render()[0].decode()
    for state in ENGINE_STATES:
        want = 1 if state == "draining" else 0
        assert sample(text, "direct_frontend_engine_state", engine="e1", state=state) == want
    assert sample(text, "direct_frontend_engine_state", engine="e2", state="serving") == 1
    with pytest.raises(ValueError, match="unknown engine state"):
        m.set_engine_state("e1", "sleeping")  # type: ignore[arg-type]

    m.forget_engine("e1")
    m.forget_engine("never-seen")
    text = m.render()[0].decode()
    assert 'engine="e1"' not in text
    assert sample(text, "direct_frontend_engine_state", engine="e2", state="serving") == 1


# ---------------------------------------------------------------- logging


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """Our handler on a buffer, removed afterwards so other tests see a clean root logger."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    stream = io.StringIO()
    yield stream
    for h in root.handlers:
        if h not in before:
            root.removeHandler(h)
    root.setLevel(level)


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logging_lines_with_request_id(log_stream: io.StringIO) -> None:
    configure_logging(json=True, level="debug", stream=log_stream)
    log = logging.getLogger("direct_frontend.test")
    log.debug("no request yet", extra={"engine": "e1", "count": 3, "odd": object()})
    token = current_request_id.set("req-1")
    try:
        log.info("in request %s", "x")
        log.info("explicit", extra={"request_id": "req-2"})
        try:
            raise RuntimeError("kaput")
        except RuntimeError:
            log.exception("failed")
    finally:
        current_request_id.reset(token)
    first, second, third, fourth = json_lines(log_stream)
    assert first["level"] == "DEBUG"
    assert first["logger"] == "direct_frontend.test"
    assert first["msg"] == "no request yet"
    assert (first["engine"], first["count"]) == ("e1", 3)
    assert first["odd"].startswith("<object")
    assert "request_id" not in first
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert second["msg"] == "in request x"
    assert second["request_id"] == "req-1"
    assert third["request_id"] == "req-2"
    assert fourth["level"] == "ERROR"
    assert fourth["request_id"] == "req-1"
    assert "RuntimeError: kaput" in fourth["exc"]


def test_json_logging_survives_surrogates(log_stream: io.StringIO) -> None:
    configure_logging(json=True, stream=log_stream)
    logging.getLogger("t").warning("bad \udcff text")
    assert json_lines(log_stream)[0]["msg"] == "bad \udcff text"


def test_text_logging_is_one_readable_line(log_stream: io.StringIO) -> None:
    configure_logging(json=False, level="INFO", stream=log_stream)
    log = logging.getLogger("t")
    log.debug("hidden")
    token = current_request_id.set("abcd")
    try:
        log.warning("hello", extra={"engine": "e 1", "n": 2})
    finally:
        current_request_id.reset(token)
    (line,) = log_stream.getvalue().splitlines()
    assert re.fullmatch(r"\S+Z WARNING t: hello request_id=abcd engine=\"e 1\" n=2", line), line


def test_configure_logging_replaces_its_own_handler(log_stream: io.StringIO) -> None:
    root = logging.getLogger()
    configure_logging(json=True, stream=io.StringIO())
    configure_logging(json=True, stream=log_stream)
    logging.getLogger("t").warning("once")
    assert len(json_lines(log_stream)) == 1
    assert sum(1 for h in root.handlers if isinstance(h.formatter, logging.Formatter)) >= 1
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging(json=True, level="chatty")


def test_log_once(log_stream: io.StringIO) -> None:
    configure_logging(json=True, stream=log_stream)
    log = logging.getLogger("t")
    key = "malformed:" + new_request_id()
    assert log_once(log, key, "bad message from %s", "e1", extra={"engine": "e1"}) is True
    assert log_once(log, key, "bad message from %s", "e1") is False
    (line,) = json_lines(log_stream)
    assert line["msg"] == "bad message from e1"
    assert line["level"] == "WARNING"
    assert line["engine"] == "e1"


def test_request_ids_and_redaction() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    assert redact("") == ""
    assert redact("short") == "***"
    secret = "sk-abcdefghijklmnop"
    assert redact(secret) == "sk-a***"
    assert "efgh" not in redact(secret)
