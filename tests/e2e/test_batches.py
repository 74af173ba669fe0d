"""End to end: the Files and Batch APIs through the official client, unmodified.

One daemon keeps its state in a SQLite file and has two API keys: each key's files and
batches are its own, and the other's are OpenAI's 404. Its models: ``demo`` (instant
simulated engines), ``slow`` (20 ms a token, for a batch to cancel) and ``embed`` (an
embedding engine).
"""

from __future__ import annotations

import io
import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.daemon import Daemon, running_daemon, wait_for
from tests.support.models import FAST, engine_table, frontend_table, simulators

KEYS = ("sk-batch-one", "sk-batch-two")
SLOW = "decode_us_per_token = 20000\nprefill_us_per_token = 0\neos_probability = 0.0"
EMBEDDER = FAST + "\nembedding_dim = 8\ncontext_length = 64"


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    directory = tmp_path_factory.mktemp("batches")
    extra = textwrap.dedent(f"""\
        [frontend.auth]
        api_keys = ["{KEYS[0]}", "{KEYS[1]}"]

        [frontend.responses]
        backend = "sqlite"
        path = "{directory / 'state' / 'responses.db'}"

        [frontend.batches]
        concurrency = 4

        [[model]]
        name = "demo"

        [[model]]
        name = "slow"

        [[model]]
        name = "embed"
        """)
    text = "\n".join([frontend_table(model_dir, extra),
                      engine_table("sim", "vllm", "demo", FAST),
                      engine_table("sim-slow", "sglang", "slow", SLOW),
                      engine_table("emb", "vllm", "embed", EMBEDDER)])
    with running_daemon(directory, text) as daemon:
        daemon.wait_serving(3)
        yield daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEYS[0], max_retries=0) as c:
        yield c


@pytest.fixture
def other(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEYS[1], max_retries=0) as c:
        yield c


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list[dict[str, Any]], name: str = "in.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(jsonl(lines))), purpose="batch").id


def ended(client: openai.OpenAI, batch_id: str, timeout: float = 30) -> Any:
    found: list[Any] = []

    def done() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in ("completed", "failed", "cancelled", "expired")

    wait_for(done, timeout, "the batch to end")
    return found[0]


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_file_is_uploaded_listed_read_and_deleted(client: openai.OpenAI,
                                                    other: openai.OpenAI) -> None:
    data = jsonl([{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "demo", "messages": []}}])
    made = client.files.create(file=("mine.jsonl", io.BytesIO(data)), purpose="batch")
    assert made.id.startswith("file-") and made.object == "file" and made.bytes == len(data)
    assert made.filename == "mine.jsonl" and made.purpose == "batch"
    assert made.expires_at is not None and made.expires_at > made.created_at
    assert client.files.retrieve(made.id).bytes == len(data)
    assert client.files.content(made.id).content == data
    assert made.id in [f.id for f in client.files.list(purpose="batch")]
    assert made.id not in [f.id for f in other.files.list()]
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    gone = client.files.delete(made.id)
    assert gone.deleted and gone.id == made.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)


def test_an_upload_no_batch_could_read_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"Must be \.jsonl"):
        client.files.create(file=("notes.txt", io.BytesIO(b"{}\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 2"):
        client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n{broken\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


def chat_line(custom_id: str, text: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "user", "content": text}],
                     "max_tokens": 5, **body}}


def test_a_chat_batch_runs_and_writes_openai_output_files(client: openai.OpenAI,
                                                          other: openai.OpenAI) -> None:
    lines = [chat_line(f"req-{i}", f"question {i % 3}") for i in range(8)]
    lines.append(chat_line("bad", "x", max_tokens=-1))
    lines.append(chat_line("streamed", "x", stream=True))
    file_id = upload(client, lines)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.id.startswith("batch_") and batch.status == "validating"
    assert batch.metadata == {"job": "nightly"} and batch.expires_at == batch.created_at + 86400
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    done = ended(client, batch.id)
    assert done.status == "completed" and done.model == "demo"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (10, 8, 2)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    output = lines_of(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(8)]
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        assert line["response"]["body"]["object"] == "chat.completion"
        assert line["response"]["body"]["usage"]["completion_tokens"] == 5
    errors = {line["custom_id"]: line for line in lines_of(client, done.error_file_id)}
    assert errors["bad"]["response"]["status_code"] == 400
    assert errors["bad"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert errors["streamed"]["response"]["body"]["error"]["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)  # type: ignore[arg-type]
    listed = client.batches.list(limit=1)
    assert listed.data[0].id == batch.id and listed.has_more is not None


@pytest.mark.parametrize(("endpoint", "body", "check"), [
    ("/v1/completions", {"model": "demo", "prompt": "once upon", "max_tokens": 3},
     lambda body: body["object"] == "text_completion"),
    ("/v1/responses", {"model": "demo", "input": "hi", "max_output_tokens": 3},
     lambda body: body["object"] == "response" and body["status"] == "incomplete"),
    ("/v1/embeddings", {"model": "embed", "input": ["a", "b"]},
     lambda body: len(body["data"]) == 2 and len(body["data"][0]["embedding"]) == 8),
])
def test_every_endpoint_runs_in_a_batch(client: openai.OpenAI, endpoint: str,
                                        body: dict[str, Any], check: Any) -> None:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": body}
             for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, lines),
                                  endpoint=endpoint,  # type: ignore[arg-type]
                                  completion_window="24h")
    done = ended(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    output = lines_of(client, done.output_file_id)
    assert len(output) == 3 and all(check(line["response"]["body"]) for line in output)


def test_a_batch_whose_lines_are_wrong_fails_with_openais_errors(
        client: openai.OpenAI) -> None:
    lines = [chat_line("a", "x"), {**chat_line("b", "y"), "url": "/v1/completions"},
             chat_line("a", "z")]
    batch = client.batches.create(input_file_id=upload(client, lines),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = ended(client, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    assert done.errors is not None and done.errors.data is not None
    assert [(e.code, e.line) for e in done.errors.data] == [
        ("url_mismatch", 2), ("duplicate_custom_id", 3)]
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id="file-x", endpoint="/v1/chat/completions",
                              completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nobody", endpoint="/v1/chat/completions",
                              completion_window="24h")


def test_a_cancel_stops_new_lines_and_aborts_the_running_ones(
        daemon: Daemon, client: openai.OpenAI, other: openai.OpenAI) -> None:
    lines = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "slow", "prompt": f"p{i}", "max_tokens": 500}}
             for i in range(20)]
    batch = client.batches.create(input_file_id=upload(client, lines),
                                  endpoint="/v1/completions", completion_window="24h")
    slow = simulators(daemon)["sim-slow"]
    wait_for(lambda: slow.stats.running >= 4, 10, "the batch's lines to run")
    assert slow.stats.running <= 4  # [frontend.batches] concurrency
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = ended(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts is not None and done.request_counts.failed == 20
    assert done.output_file_id is None
    errors = lines_of(client, done.error_file_id)
    assert sorted(line["custom_id"] for line in errors) == sorted(f"s{i}" for i in range(20))
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    wait_for(lambda: slow.stats.running == 0, 10, "the aborts to reach the engine")
    assert slow.stats.requests == 4 and slow.stats.aborted + slow.stats.cancellations >= 4
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(ended(client, upload_and_run(client)).id)


def upload_and_run(client: openai.OpenAI) -> str:
    batch = client.batches.create(input_file_id=upload(client, [chat_line("x", "y")]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    started = time.monotonic()
    while client.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() - started < 30
        time.sleep(0.05)
    return batch.id
