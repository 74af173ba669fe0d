"""The durable store's Trio shell: what a follow-up reads, and the cache in front of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from direct_frontend.http.stored_responses import find, keep
from direct_frontend.openai.conversations import Conversation
from direct_frontend.openai.response_store import Item, ResponseStore, StoredResponse
from direct_frontend.state.backends import sweep_forever
from direct_frontend.state.shell import Durable
from direct_frontend.state.sqlite import SqliteStore
from tests.state.conftest import Clock


class Counting(SqliteStore):
    """A SQLite store that counts the conversation items it reads."""

    read = 0

    def items_since(self, conversation_id: str, owner: str,
                    start: int) -> tuple[int, list[tuple[int, bytes]]] | None:
        found = super().items_since(conversation_id, owner, start)
        if found is not None:
            self.read += len(found[1])
        return found


def items(prefix: str, count: int) -> list[Item]:
    return [Item(f"{prefix}{i}", b'{"id":"%s%d"}' % (prefix.encode(), i)) for i in range(count)]


async def open_pair(path: Path) -> tuple[Durable, Durable, Counting]:
    """Two processes' shells on one file; the second's reads are counted."""
    counting = Counting(path)
    mine = Durable(SqliteStore(path), ttl_s=60, lease_s=30)
    theirs = Durable(counting, ttl_s=60, lease_s=30)
    await mine.open()
    await theirs.open()
    return mine, theirs, counting


async def test_a_follow_up_reads_only_what_others_added(tmp_path: Path) -> None:
    mine, theirs, counting = await open_pair(tmp_path / "s.db")
    conversation = Conversation("conv_1", "k1", 1)
    await theirs.create_conversation(conversation, items("a", 3))
    for turn in range(50):  # this process's own turns: nothing is read back
        await theirs.add_items("conv_1", "k1", items(f"t{turn}_", 2))
        _, history = await theirs.history("conv_1", "k1") or (0, ())
        assert len(history) == 3 + 2 * (turn + 1)
    assert counting.read == 0
    await mine.add_items("conv_1", "k1", items("other", 2))  # another process's turn
    _, history = await theirs.history("conv_1", "k1") or (0, ())
    assert history[-1] == items("other", 2)[1].data
    assert counting.read == 2  # the two new items, not the 105 before them
    assert await mine.delete_item("conv_1", "k1", "a1")
    _, history = await theirs.history("conv_1", "k1") or (0, ())
    assert len(history) == 104 and items("a", 2)[1].data not in history
    assert await theirs.history("conv_1", "k2") is None  # another owner's: not found


async def test_a_cached_response_another_process_deleted_is_gone(tmp_path: Path) -> None:
    mine, theirs, _ = await open_pair(tmp_path / "s.db")
    store = ResponseStore(1 << 20, 60, durable=theirs)
    record = StoredResponse("resp_x", b'{"id":"resp_x"}', (), (), owner="k1")
    assert await keep(store, record)
    assert await find(store, "resp_x", "k1") == record
    assert await find(store, "resp_x", "k2") is None
    assert await mine.delete("resp_x", "k1")
    assert await find(store, "resp_x", "k1") is None
    assert len(store) == 0


async def test_a_running_response_whose_lease_ran_out_reads_failed(tmp_path: Path) -> None:
    durable = Durable(SqliteStore(tmp_path / "s.db"), ttl_s=60, lease_s=0.05)
    await durable.open()
    record = StoredResponse("resp_y", b'{"id":"resp_y","status":"queued","error":null}', (), (),
                            status="queued", background=True, owner="k1")
    assert await durable.put(record, running=True)
    found = await durable.get("resp_y", "k1")
    assert found is not None and found.status == "queued"
    await trio.sleep(0.1)  # the lease's time, passing: what the test is about
    found = await durable.get("resp_y", "k1")
    assert found is not None and found.status == "failed"
    assert b'"response_lost"' in found.response and b'"status":"failed"' in found.response


async def test_a_database_that_fails_says_not_stored(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    durable = Durable(SqliteStore(path), ttl_s=60, lease_s=30)
    await durable.open()
    store = ResponseStore(1 << 20, 60, durable=durable)

    def broken(*args: Any) -> None:
        raise __import__("sqlite3").OperationalError("disk I/O error")

    durable.sql._run = broken  # type: ignore[method-assign]
    record = StoredResponse("resp_z", b"{}", (), (), owner="k1")
    assert not await keep(store, record)
    assert len(store) == 0  # not cached either: nothing claims it was kept


async def test_retention_runs_in_the_background_until_it_is_cancelled(tmp_path: Path) -> None:
    class Watched(Durable):
        swept = trio.Event()

        async def sweep(self) -> int:
            dropped = await super().sweep()
            self.swept.set()
            return dropped

    clock = Clock()
    sql = SqliteStore(tmp_path / "s.db", clock=clock)
    durable = Watched(sql, ttl_s=10, lease_s=30, conversation_ttl_s=10)
    await durable.open()
    await durable.put(StoredResponse("resp_old", b"{}", (), (), owner="k1"))
    await durable.create_conversation(Conversation("conv_old", "k1", 1), items("a", 2))
    clock.now += 11
    await durable.put(StoredResponse("resp_new", b"{}", (), (), owner="k1"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sweep_forever, durable, 0.01)
        await durable.swept.wait()
        nursery.cancel_scope.cancel()
    assert await durable.get_conversation("conv_old", "k1") is None
    assert sql.get_response("resp_old", "k1") is None
    assert sql.get_response("resp_new", "k1") is not None
