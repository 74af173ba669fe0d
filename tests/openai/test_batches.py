"""The Files and Batch APIs' objects, bodies and lines (sans-IO): OpenAI's shapes (read back
by the official client's own models), OpenAI's validation errors, the run order, the output
file's lines."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import openai.types
import pytest

from direct_frontend.openai.batch_lines import (
    KEY_CHARS,
    BatchInput,
    line_body,
    outcome,
    read_input,
    refusal,
    result_line,
    unrun_line,
)
from direct_frontend.openai.batches import (
    BatchError,
    StoredBatch,
    decode_batch,
    encode_batch,
    parse_create,
)
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.files import StoredFile, check_upload, expiry_of, page

CHAT = "/v1/chat/completions"


def jsonl(*requests: Any) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                    for r in requests)


def chat(custom_id: str, *texts: str, model: str = "m", url: str = CHAT) -> dict[str, Any]:
    messages = [{"role": "user", "content": t} for t in texts]
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": messages}}


def test_the_objects_are_what_the_official_client_reads() -> None:
    batch = StoredBatch(id="batch_1", owner="o", tenant="o", endpoint=CHAT,
                        input_file_id="file-1", created_at=5, expires_at=6,
                        metadata=b'{"k":"v"}', errors=(BatchError("empty_file", "e", None, 3),),
                        total=4, completed=2, failed=1)
    read = openai.types.Batch.model_validate_json(batch.render())
    assert read.status == "validating" and read.metadata == {"k": "v"}
    assert read.request_counts is not None and read.request_counts.completed == 2
    assert read.errors is not None and read.errors.data is not None
    assert read.errors.data[0].line == 3 and read.errors.data[0].code == "empty_file"
    assert decode_batch(encode_batch(batch)) == batch
    moved = batch.moved("cancelling", 9)
    assert moved.status == "cancelling" and moved.cancelling_at == 9
    stored = StoredFile(id="file-1", owner="o", created_at=5, filename="a.jsonl",
                        purpose="batch", size=12, expires_at=None)
    file = openai.types.FileObject.model_validate_json(stored.render())
    assert file.bytes == 12 and file.purpose == "batch" and file.object == "file"
    listed = json.loads(page([stored], False))
    assert listed["data"][0]["id"] == "file-1" and listed["has_more"] is False


@pytest.mark.parametrize(("raw", "param"), [
    ({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": "f", "endpoint": "/v1/moderations", "completion_window": "24h"},
     "endpoint"),
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "1h"},
     "completion_window"),
    ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": [1]},
     "metadata"),
    ({"input_file_id": 3, "endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
])
def test_a_create_body_is_checked_as_openai_checks_it(raw: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIHTTPError) as refused:
        parse_create(raw)
    assert refused.value.status == 400 and refused.value.param == param


def test_an_upload_is_a_batch_jsonl_file() -> None:
    assert check_upload("in.jsonl", "batch", jsonl(chat("a", "x"), b"", chat("b", "y")),
                        10) == 2
    for name, purpose, data, param in (("in.jsonl", "fine-tune", b"{}\n", "purpose"),
                                       ("in.txt", "batch", b"{}\n", "file"),
                                       ("in.jsonl", "batch", b"{}\n{nope\n", "file"),
                                       ("in.jsonl", "batch", b"[1]\n", "file"),
                                       ("in.jsonl", "batch", b"\n \n", "file"),
                                       ("in.jsonl", "batch", b"{}\n" * 3, "file")):
        with pytest.raises(OpenAIHTTPError) as refused:
            check_upload(name, purpose, data, 2)
        assert refused.value.param == param
    assert expiry_of(None, None) is None and expiry_of("created_at", "3600") == 3600
    for anchor, seconds in (("last_active_at", "3600"), ("created_at", "60"),
                            ("created_at", "²")):
        with pytest.raises(OpenAIHTTPError):
            expiry_of(anchor, seconds)


def errors_of(data: bytes, endpoint: str = CHAT, max_lines: int = 10) -> list[tuple[Any, ...]]:
    found = read_input(data, endpoint, max_lines)
    assert isinstance(found, list)
    return [(e.code, e.line, e.param) for e in found]


def test_a_batch_input_reports_what_openai_reports() -> None:
    assert errors_of(b"") == [("empty_file", None, None)]
    assert errors_of(jsonl(chat("a", "x"), b"{oops", chat("a", "y"),
                           chat("b", "y", url="/v1/completions"), chat("c", "z", model="n"),
                           {**chat("d", "w"), "method": "GET"},
                           {"custom_id": "e", "method": "POST", "url": CHAT, "body": 3},
                           {"method": "POST", "url": CHAT, "body": {}})) == [
        ("invalid_json_line", 2, None), ("duplicate_custom_id", 3, "custom_id"),
        ("url_mismatch", 4, "url"), ("model_mismatch", 5, "body.model"),
        ("invalid_request", 6, "method"), ("invalid_request", 7, "body"),
        ("invalid_request", 8, "custom_id")]
    many = jsonl(*(chat(f"c{i}", "x") for i in range(4)))
    assert errors_of(many, max_lines=3) == [("too_many_tasks", None, None)]


def test_lines_sharing_a_prefix_run_together_and_at_flex() -> None:
    system = "You are a careful assistant. " * 4
    data = jsonl(chat("a1", "alpha one"), chat("b1", system, "beta"),
                 chat("a2", "alpha one"), chat("b2", system, "gamma"),
                 chat("c", "another"), chat("b3", system, "beta"))
    found = read_input(data, CHAT, 10)
    assert isinstance(found, BatchInput) and found.model == "m"
    order = [line.custom_id for line in found.lines]
    # each group is contiguous, and a group keeps the file's order
    assert order.index("a2") == order.index("a1") + 1
    assert order.index("b3") == order.index("b1") + 1
    assert abs(order.index("b2") - order.index("b1")) <= 2
    assert [line.ord for line in found.lines] == list(range(6))
    assert sorted(line.line for line in found.lines) == list(range(1, 7))
    body = msgspec.json.decode(found.lines[0].body)
    assert body["service_tier"] == "flex" and "messages" in body
    assert msgspec.json.decode(line_body({"model": "m", "service_tier": "priority"}))[
        "service_tier"] == "flex"  # a line asks for no tier of its own
    long = "x" * (KEY_CHARS * 2)
    kept = read_input(jsonl(chat("z", long + "b"), chat("y", long + "a")), CHAT, 10)
    assert isinstance(kept, BatchInput)
    assert [line.custom_id for line in kept.lines] == ["z", "y"]  # past the key: file order


def test_a_line_that_cannot_run_in_a_batch_is_refused() -> None:
    assert refusal(line_body({"model": "m"})) is None
    stream = refusal(line_body({"model": "m", "stream": True}))
    assert stream is not None and stream.param == "stream"
    background = refusal(line_body({"model": "m", "background": True}))
    assert background is not None and background.param == "background"


def test_results_are_openai_output_lines() -> None:
    assert (outcome(200), outcome(400), outcome(429, 1.0), outcome(503, 0.5),
            outcome(500, 1.0)) == ("completed", "failed", "retry", "retry", "failed")
    assert outcome(429) == "failed"  # no retry-after: it never fits (a rate limit's refusal)
    line = json.loads(result_line("c1", 200, "r1", b'{"id":"x"}'))
    assert line["id"].startswith("batch_req_") and line["custom_id"] == "c1"
    assert line["response"] == {"status_code": 200, "request_id": "r1", "body": {"id": "x"}}
    assert line["error"] is None
    error = json.loads(result_line("c2", 400, "r2", b'{"error":{"message":"m"}}'))
    assert error["response"]["body"]["error"]["message"] == "m"
    odd = json.loads(result_line("c3", 500, "r3", b"not json"))
    assert odd["response"]["body"] == "not json"
    expired = json.loads(unrun_line("c4", "expired"))
    assert expired["response"] is None and expired["error"]["code"] == "batch_expired"
    assert json.loads(unrun_line("c5", "cancelled"))["error"]["code"] == "batch_cancelled"
