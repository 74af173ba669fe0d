"""Files and batches in the durable store, on both backends: owners, paging, parts, leases,
results as lines finish, the end's output files, retention."""

from __future__ import annotations

import json
from typing import Any

import pytest

from direct_frontend.openai.batch_lines import Line
from direct_frontend.openai.batches import BatchError, StoredBatch
from direct_frontend.openai.files import StoredFile
from direct_frontend.state.batch_sql import PART_BYTES, BatchSql, OwnerFull
from direct_frontend.state.sql import SqlStore, StoreError
from tests.state.conftest import Clock


@pytest.fixture
def store(sql: SqlStore[Any]) -> BatchSql:
    return BatchSql(sql)


def file(fid: str, owner: str = "k1", size: int = 3, expires: int | None = None) -> StoredFile:
    return StoredFile(id=fid, owner=owner, created_at=1, filename="in.jsonl", purpose="batch",
                      size=size, expires_at=expires)


def batch(bid: str = "batch_1", owner: str = "k1") -> StoredBatch:
    return StoredBatch(id=bid, owner=owner, tenant=owner, endpoint="/v1/completions",
                       input_file_id="file-1", created_at=1, expires_at=86401,
                       metadata=b'{"a":"b"}')


def lines(count: int) -> list[Line]:
    return [Line(i, count - i, f"c{count - i}", b'{"n":%d}' % i) for i in range(count)]


def test_a_file_is_its_owners_alone_and_read_in_parts(store: BatchSql) -> None:
    data = bytes(range(256)) * (PART_BYTES * 5 // 2 // 256)
    store.put_file(file("file-a", size=len(data)), data)
    assert store.get_file("file-a", "k2") is None and store.read_file("file-a", "k2") is None
    assert store.read_part("file-a", "k2", 0) is None and not store.delete_file("file-a", "k2")
    got = store.get_file("file-a", "k1")
    assert got is not None and got.size == len(data)
    parts = [store.read_part("file-a", "k1", seq) for seq in range(4)]
    assert parts[3] is None and b"".join(p or b"" for p in parts) == data
    found = store.read_file("file-a", "k1")
    assert found is not None and found[1] == data
    assert store.get_file("file-a\x00", "k1") is None  # never a database error
    assert store.delete_file("file-a", "k1") and store.get_file("file-a", "k1") is None
    assert store.read_part("file-a", "k1", 0) is None


def test_files_are_listed_by_creation_with_a_cursor(store: BatchSql, clock: Clock) -> None:
    for i in range(5):
        store.put_file(file(f"file-{i}"), b"{}\n")
        clock.now += 1
    store.put_file(file("file-x", owner="k2"), b"{}\n")
    first, more = store.list_files("k1", None, 2, "desc")
    assert [f.id for f in first] == ["file-4", "file-3"] and more
    rest, more = store.list_files("k1", "file-3", 10, "desc")
    assert [f.id for f in rest] == ["file-2", "file-1", "file-0"] and not more
    up, _ = store.list_files("k1", "file-1", 2, "asc")
    assert [f.id for f in up] == ["file-2", "file-3"]
    assert store.list_files("k1", None, 10, "asc", "batch_output") == ([], False)
    with pytest.raises(KeyError):
        store.list_files("k1", "file-x", 10, "desc")  # another owner's is no cursor


def test_a_file_past_its_expiry_is_gone_and_swept(store: BatchSql, clock: Clock) -> None:
    store.put_file(file("file-old", expires=int(clock.now) + 10), b"{}\n")
    store.put_file(file("file-keep"), b"{}\n")
    assert store.get_file("file-old", "k1") is not None
    clock.now += 11
    assert store.get_file("file-old", "k1") is None
    assert [f.id for f in store.list_files("k1", None, 10, "asc")[0]] == ["file-keep"]
    assert store.sweep() == 1 and store.sweep() == 0


def test_a_batch_is_its_owners_alone_and_listed_newest_first(store: BatchSql,
                                                             clock: Clock) -> None:
    for i in range(3):
        store.create_batch(batch(f"batch_{i}"))
        clock.now += 1
    store.create_batch(batch("batch_other", owner="k2"))
    assert store.get_batch("batch_0", "k2") is None
    assert store.request_cancel("batch_0", "k2") is None
    got = store.get_batch("batch_0", "k1")
    assert got is not None and got.metadata == b'{"a":"b"}' and got.status == "validating"
    page, more = store.list_batches("k1", None, 2)
    assert [b.id for b in page] == ["batch_2", "batch_1"] and more
    assert [b.id for b in store.list_batches("k1", "batch_1", 2)[0]] == ["batch_0"]


def test_one_process_holds_a_batch_until_its_lease_runs_out(store: BatchSql,
                                                            clock: Clock) -> None:
    store.create_batch(batch())
    assert [b.id for b in store.claim("a", 10, 4)] == ["batch_1"]
    assert store.claim("b", 10, 4) == []
    clock.now += 8
    assert store.renew("batch_1", "a", 10) == (True, False)
    clock.now += 8
    assert store.claim("b", 10, 4) == []
    clock.now += 3  # a's lease ran out: b takes it up, and a no longer holds it
    assert [b.id for b in store.claim("b", 10, 4)] == ["batch_1"]
    assert store.renew("batch_1", "a", 10) == (False, False)
    with pytest.raises(StoreError):
        store.start("batch_1", "a", lines(2), "m")
    store.release("batch_1", "b")
    assert [b.id for b in store.claim("c", 10, 4)] == ["batch_1"]  # at once


def test_results_are_kept_as_lines_finish_and_the_end_writes_the_files(
        store: BatchSql, clock: Clock) -> None:
    store.create_batch(batch())
    store.claim("a", 10, 1)
    started = store.start("batch_1", "a", lines(4), "m")
    assert started.status == "in_progress" and started.in_progress_at == clock.now
    assert started.total == 4 and started.model == "m"
    pending = store.pending("batch_1")
    assert [line.ord for line in pending] == [0, 1, 2, 3]
    store.put_results("batch_1", [(0, True, b'{"r":"c4"}'), (2, False, b'{"r":"c2"}')])
    store.put_results("batch_1", [(0, True, b'{"r":"again"}')])  # a result is kept once
    assert [line.ord for line in store.pending("batch_1")] == [1, 3]  # what a restart runs
    now = store.get_batch("batch_1", "k1")
    assert now is not None and (now.completed, now.failed) == (1, 1)
    clock.now += 1
    assert store.request_cancel("batch_1", "k1") is not None
    assert store.renew("batch_1", "a", 10) == (True, True)
    clock.now += 1
    ended = store.finish("batch_1", "a", "cancelled", 3600)
    assert ended.status == "cancelled" and ended.cancelled_at == ended.cancelling_at + 1
    assert (ended.completed, ended.failed, ended.total) == (1, 3, 4)
    assert store.pending("batch_1") == []
    assert ended.output_file_id is not None and ended.error_file_id is not None
    output = store.read_file(ended.output_file_id, "k1")
    errors = store.read_file(ended.error_file_id, "k1")
    assert output is not None and errors is not None
    assert output[0].purpose == "batch_output" and output[0].expires_at == clock.now + 3600
    assert output[1] == b'{"r":"c4"}\n'
    error_lines = [json.loads(line) for line in errors[1].splitlines()]
    # in file order: c1 and c3 never ran (cancelled), c2 failed
    assert [e.get("custom_id", e.get("r")) for e in error_lines] == ["c1", "c2", "c3"]
    assert error_lines[0]["error"]["code"] == "batch_cancelled"
    assert store.read_file(ended.output_file_id, "k2") is None
    assert store.claim("b", 10, 4) == []  # ended: nothing to run


def test_a_batch_that_cannot_run_fails_with_its_errors(store: BatchSql, clock: Clock) -> None:
    store.create_batch(batch())
    store.claim("a", 10, 1)
    failed = store.fail("batch_1", "a", [BatchError("empty_file", "empty")], 60)
    assert failed.status == "failed" and failed.failed_at == clock.now
    assert failed.errors == (BatchError("empty_file", "empty"),)
    got = store.get_batch("batch_1", "k1")
    assert got is not None and got.errors == failed.errors
    assert store.request_cancel("batch_1", "k1") == got  # ended: as it is
    clock.now += 61
    assert store.sweep() == 1 and store.get_batch("batch_1", "k1") is None


def test_an_owner_holds_what_it_may_and_no_more(store: BatchSql, clock: Clock) -> None:
    store.put_file(file("file-1"), b"x" * 60, owner_bytes=100)
    with pytest.raises(OwnerFull):
        store.put_file(file("file-2"), b"x" * 41, owner_bytes=100)
    store.put_file(file("file-3", owner="k2"), b"x" * 41, owner_bytes=100)  # another's room
    store.put_file(file("file-4", expires=int(clock.now) + 1), b"x" * 40, owner_bytes=100)
    clock.now += 2  # expired files count no more
    store.put_file(file("file-5"), b"x" * 40, owner_bytes=100)
    for i in range(2):
        store.create_batch(batch(f"batch_{i}"), owner_active=2)
    with pytest.raises(OwnerFull):
        store.create_batch(batch("batch_2"), owner_active=2)
    store.create_batch(batch("batch_3", owner="k2"), owner_active=2)
    store.claim("a", 10, 1)
    store.fail("batch_0", "a", [BatchError("empty_file", "e")], 60)  # ended: room again
    store.create_batch(batch("batch_2"), owner_active=2)


def test_a_claim_takes_turns_between_owners(store: BatchSql, clock: Clock) -> None:
    for i in range(3):
        store.create_batch(batch(f"batch_a{i}", owner="a"))
        clock.now += 1
    store.create_batch(batch("batch_b0", owner="b"))
    clock.now += 1
    store.create_batch(batch("batch_c0", owner="c"))
    taken = [b.id for b in store.claim("p", 10, 3)]
    assert taken == ["batch_a0", "batch_b0", "batch_c0"]  # not a's three, oldest first
    # a process already running one of b's: the next goes to a
    assert [b.id for b in store.claim("q", 10, 1, busy=["b", "c"])] == ["batch_a1"]
