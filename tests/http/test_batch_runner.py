"""The batch runner over a real SQLite store, its lines answered by a stand-in for the
endpoints (the runner's one input: a line's status, body and request id): a line the
server had no room for is asked again, a batch past its window ends expired, and a cancel
asked through the database (as another process's API asks it) stops a batch running here.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from direct_frontend.fleet.schema import BatchesConfig
from direct_frontend.http.batch_runner import BatchRunner, Dispatch
from direct_frontend.http.identity import Caller
from direct_frontend.http.internal import Answer
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.batches import StoredBatch
from direct_frontend.openai.files import StoredFile
from direct_frontend.state.batch_store import BatchStore
from direct_frontend.state.shell import Durable
from direct_frontend.state.sqlite import SqliteStore

CONFIG = BatchesConfig(concurrency=2, lease_s=0.5)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[BatchStore]:
    durable = Durable(SqliteStore(tmp_path / "state.db"), ttl_s=60, lease_s=1)
    await durable.open()
    yield BatchStore(durable)
    await durable.close()


async def batch_of(store: BatchStore, count: int, expires_in: int = 3600) -> str:
    data = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                "url": "/v1/completions",
                                "body": {"model": "m", "prompt": f"p{i}"}}).encode() + b"\n"
                    for i in range(count))
    now = int(time.time())
    await store.put_file(StoredFile(id="file-in", owner="o", created_at=now,
                                    filename="in.jsonl", purpose="batch", size=len(data)), data)
    await store.create_batch(StoredBatch(id="batch_x", owner="o", tenant="t",
                                         endpoint="/v1/completions", input_file_id="file-in",
                                         created_at=now, expires_at=now + expires_in))
    return "batch_x"


async def until_ended(store: BatchStore, batch_id: str) -> StoredBatch:
    with trio.fail_after(20):
        while True:
            batch = await store.get_batch(batch_id, "o")
            assert batch is not None
            if not batch.active:
                return batch
            await trio.sleep(0.02)


async def lines_of(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    found = await store.read_file(file_id, "o")
    assert found is not None
    return [json.loads(line) for line in found[1].splitlines()]


async def running(store: BatchStore, dispatch: Dispatch, nursery: trio.Nursery,
                  clock: Callable[[], float] = time.time,
                  metrics: Metrics | None = None) -> BatchRunner:
    runner = BatchRunner(store, lambda: CONFIG, dispatch, metrics, clock=clock)
    await nursery.start(runner.run)
    return runner


async def test_a_line_the_server_had_no_room_for_is_asked_again(store: BatchStore) -> None:
    asked: dict[str, int] = {}
    seen: list[tuple[str, str, str]] = []

    async def dispatch(path: str, body: bytes, caller: Caller) -> Answer:
        prompt = json.loads(body)["prompt"]
        seen.append((path, caller.owner, caller.tenant))
        asked[prompt] = asked.get(prompt, 0) + 1
        if prompt == "p1" and asked[prompt] == 1:  # saturated: try again in a moment
            return Answer(429, b'{"error":{"message":"saturated"}}', "r-busy", 0.01)
        if prompt == "p3":  # a rate limit it can never fit: no retry-after
            return Answer(429, b'{"error":{"message":"too large"}}', "r-never")
        return Answer(200, b'{"prompt":"%s"}' % prompt.encode(), f"r-{prompt}")

    batch_id = await batch_of(store, 4)
    metrics = Metrics()
    async with trio.open_nursery() as nursery:
        await running(store, dispatch, nursery, metrics=metrics)
        ended = await until_ended(store, batch_id)
        nursery.cancel_scope.cancel()
    assert ended.status == "completed" and (ended.completed, ended.failed) == (3, 1)
    assert asked == {"p0": 1, "p1": 2, "p2": 1, "p3": 1}
    assert set(seen) == {("/v1/completions", "o", "t")}  # as the batch's owner and tenant
    output = await lines_of(store, ended.output_file_id)
    assert [line["response"]["request_id"] for line in output] == ["r-p0", "r-p1", "r-p2"]
    failed = await lines_of(store, ended.error_file_id)
    assert [(line["custom_id"], line["response"]["status_code"]) for line in failed] == [
        ("c3", 429)]
    assert metrics.registry.get_sample_value("direct_frontend_batch_lines_total",
                                             {"outcome": "retried"}) == 1


async def test_a_batch_past_its_window_ends_expired(store: BatchStore) -> None:
    started = trio.Event()

    async def dispatch(path: str, body: bytes, caller: Caller) -> Answer:
        if json.loads(body)["prompt"] == "p0":
            return Answer(200, b"{}", "r0")
        started.set()
        await trio.sleep_forever()  # an answer slower than the batch's window
        raise AssertionError("unreachable")

    batch_id = await batch_of(store, 4, expires_in=2)  # whole seconds: 1–2 s from now
    async with trio.open_nursery() as nursery:
        await running(store, dispatch, nursery)
        ended = await until_ended(store, batch_id)
        nursery.cancel_scope.cancel()
    assert started.is_set()
    assert ended.status == "expired" and ended.expired_at is not None
    assert (ended.completed, ended.failed, ended.total) == (1, 3, 4)
    errors = await lines_of(store, ended.error_file_id)
    assert [line["custom_id"] for line in errors] == ["c1", "c2", "c3"]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}


async def test_a_cancel_asked_through_the_database_stops_the_batch(store: BatchStore) -> None:
    running_lines: list[str] = []
    stopped: list[str] = []
    two_run = trio.Event()

    async def dispatch(path: str, body: bytes, caller: Caller) -> Answer:
        prompt = json.loads(body)["prompt"]
        running_lines.append(prompt)
        if len(running_lines) == 2:
            two_run.set()
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(prompt)
        raise AssertionError("unreachable")

    batch_id = await batch_of(store, 5)
    async with trio.open_nursery() as nursery:
        await running(store, dispatch, nursery)
        with trio.fail_after(10):
            await two_run.wait()
        cancelling = await store.request_cancel(batch_id, "o")  # another process's API
        assert cancelling is not None and cancelling.status == "cancelling"
        ended = await until_ended(store, batch_id)
        nursery.cancel_scope.cancel()
    assert ended.status == "cancelled"
    assert sorted(running_lines) == sorted(stopped) == ["p0", "p1"]  # concurrency 2; aborted
    assert ended.failed == 5 and ended.output_file_id is None
