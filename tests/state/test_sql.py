"""The durable store's SQL on both backends: owners, paging, leases, retention, migrations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from direct_frontend.openai.conversations import Conversation
from direct_frontend.openai.response_store import Item, Lineage, StoredResponse
from direct_frontend.state.sql import (
    SCHEMA_VERSION,
    DuplicateItem,
    InvalidItem,
    SqlStore,
    StoreError,
)
from direct_frontend.state.sqlite import SqliteStore
from tests.state.conftest import Clock


def record(rid: str = "resp_1", owner: str = "k1", status: str = "completed",
           size: int = 10) -> StoredResponse:
    return StoredResponse(rid, b'{"id":"%b","status":"%b"}' % (rid.encode(), status.encode()),
                          (b'{"id":"msg_o"}',), (b"x" * size,), status=status,
                          background=status != "completed", owner=owner)


def conversation(cid: str = "conv_1", owner: str = "k1") -> Conversation:
    return Conversation(cid, owner, 123, b'{"a":"b"}')


def items(*ids: str) -> list[Item]:
    return [Item(i, b'{"id":"%b"}' % i.encode()) for i in ids]


def test_a_response_is_its_owners_alone(sql: SqlStore[Any]) -> None:
    sql.put_response(record(), ttl_s=60)
    found = sql.get_response("resp_1", "k1")
    assert found is not None and found[0] == record() and not found[1]
    assert sql.get_response("resp_1", "k2") is None
    assert not sql.has_response("resp_1", "k2") and sql.has_response("resp_1", "k1")
    assert not sql.delete_response("resp_1", "k2")
    assert sql.delete_response("resp_1", "k1")
    assert sql.get_response("resp_1", "k1") is None


def test_a_response_expires_and_a_sweep_drops_it(sql: SqlStore[Any], clock: Clock) -> None:
    sql.put_response(record(), ttl_s=60)
    clock.now += 61
    assert sql.get_response("resp_1", "k1") is None
    assert sql.sweep(None, None) == 1
    assert sql.sweep(None, None) == 0


def test_a_running_response_without_its_lease_reads_as_lost(sql: SqlStore[Any],
                                                             clock: Clock) -> None:
    sql.put_response(record(status="queued"), ttl_s=600, lease_s=10)
    found = sql.get_response("resp_1", "k1")
    assert found is not None and not found[1]
    clock.now += 8
    sql.renew(["resp_1"], 10)
    clock.now += 8
    found = sql.get_response("resp_1", "k1")
    assert found is not None and not found[1]
    clock.now += 3
    found = sql.get_response("resp_1", "k1")
    assert found is not None and found[1]


def test_an_owner_over_its_bytes_loses_its_oldest(sql: SqlStore[Any], clock: Clock) -> None:
    for i in range(5):
        sql.put_response(record(f"resp_{i}", size=1000), ttl_s=600)
        clock.now += 1
    sql.put_response(record("resp_other", owner="k2", size=1000), ttl_s=600)
    dropped = sql.sweep(None, 3500)
    assert dropped == 2
    assert sql.get_response("resp_0", "k1") is None and sql.get_response("resp_1", "k1") is None
    assert sql.get_response("resp_2", "k1") is not None
    assert sql.get_response("resp_other", "k2") is not None


def test_conversations_are_their_owners_alone(sql: SqlStore[Any]) -> None:
    sql.create_conversation(conversation(), items("a", "b"))
    assert sql.get_conversation("conv_1", "k1") == conversation()
    assert sql.get_conversation("conv_1", "k2") is None
    assert sql.update_conversation("conv_1", "k2", b"{}") is None
    assert sql.add_items("conv_1", "k2", items("c")) is None
    assert sql.list_items("conv_1", "k2", None, 10, "asc") is None
    assert sql.get_item("conv_1", "k2", "a") is False
    assert sql.delete_item("conv_1", "k2", "a") is False
    assert not sql.delete_conversation("conv_1", "k2")
    updated = sql.update_conversation("conv_1", "k1", b'{"x":"y"}')
    assert updated is not None and updated.metadata == b'{"x":"y"}'
    assert sql.delete_conversation("conv_1", "k1")
    assert sql.get_conversation("conv_1", "k1") is None
    assert sql.items_since("conv_1", "k1", 0) is None


def test_items_page_by_cursor_both_ways(sql: SqlStore[Any]) -> None:
    sql.create_conversation(conversation(), items("a", "b", "c"))
    assert sql.add_items("conv_1", "k1", items("d", "e")) == 5
    page, more = sql.list_items("conv_1", "k1", None, 2, "asc") or ([], False)
    assert [i.id for i in page] == ["a", "b"] and more
    page, more = sql.list_items("conv_1", "k1", "b", 2, "asc") or ([], False)
    assert [i.id for i in page] == ["c", "d"] and more
    page, more = sql.list_items("conv_1", "k1", "d", 2, "asc") or ([], True)
    assert [i.id for i in page] == ["e"] and not more
    page, more = sql.list_items("conv_1", "k1", None, 3, "desc") or ([], False)
    assert [i.id for i in page] == ["e", "d", "c"] and more
    page, more = sql.list_items("conv_1", "k1", "c", 3, "desc") or ([], True)
    assert [i.id for i in page] == ["b", "a"] and not more
    with pytest.raises(KeyError):
        sql.list_items("conv_1", "k1", "zz", 3, "asc")


def test_an_item_is_read_and_deleted_by_id(sql: SqlStore[Any]) -> None:
    sql.create_conversation(conversation(), items("a", "b", "c"))
    assert sql.get_item("conv_1", "k1", "b") == items("b")[0]
    assert sql.get_item("conv_1", "k1", "zz") is None
    assert sql.delete_item("conv_1", "k1", "b") == conversation()
    assert sql.delete_item("conv_1", "k1", "b") is None
    after, rows = sql.items_since("conv_1", "k1", 0) or (0, [])
    assert [seq for seq, _ in rows] == [0, 2] and after == 4  # the delete moved the count


def test_an_item_id_is_once_per_conversation(sql: SqlStore[Any]) -> None:
    sql.create_conversation(conversation(), items("a"))
    with pytest.raises(DuplicateItem):
        sql.add_items("conv_1", "k1", items("a"))
    with pytest.raises(DuplicateItem):
        sql.add_items("conv_1", "k1", items("b", "b"))
    assert sql.add_items("conv_1", "k1", items("b")) == 2  # the failed adds left nothing


def test_an_idle_conversation_is_swept(sql: SqlStore[Any], clock: Clock) -> None:
    sql.create_conversation(conversation(), items("a"))
    sql.create_conversation(conversation("conv_2"), items("b"))
    clock.now += 50
    sql.add_items("conv_2", "k1", items("c"))
    clock.now += 60
    assert sql.sweep(100, None) == 1
    assert sql.get_conversation("conv_1", "k1") is None
    assert sql.get_conversation("conv_2", "k1") is not None


def test_migrations_run_once_and_a_newer_schema_is_refused(sql: SqlStore[Any]) -> None:
    assert sql.migrate() == SCHEMA_VERSION
    with sql._tx() as conn:
        sql._run(conn, "UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match="newer"):
        sql.migrate()


def test_sqlite_runs_in_wal_with_full_sync(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    store.migrate()
    with store._tx() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert store.integrity_check() == "ok"
    store.close()


def test_a_file_that_is_no_database_is_a_store_error(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError):
        SqliteStore(garbage).migrate()


def test_an_owner_over_its_bytes_loses_its_stalest_conversations(sql: SqlStore[Any],
                                                                  clock: Clock) -> None:
    big = [Item("a", b"x" * 1000)]
    for i in range(4):
        sql.create_conversation(conversation(f"conv_{i}"), big)
        clock.now += 1
    sql.add_items("conv_0", "k1", items("b"))  # touched last: the stalest is now conv_1
    sql.create_conversation(conversation("conv_o", owner="k2"), big)
    assert sql.sweep(None, 2500) == 2
    assert sql.get_conversation("conv_1", "k1") is None
    assert sql.get_conversation("conv_2", "k1") is None
    assert sql.get_conversation("conv_0", "k1") is not None
    assert sql.get_conversation("conv_o", "k2") is not None
    assert sql.items_since("conv_1", "k1", 0) is None


def test_a_deleted_item_leaves_its_conversations_bytes(sql: SqlStore[Any]) -> None:
    sql.create_conversation(conversation(), [Item("a", b"x" * 1000), Item("b", b"y" * 10)])
    assert sql.delete_item("conv_1", "k1", "a") == conversation()
    assert sql.sweep(None, 100) == 0  # 19 + 10 bytes left: under the cap


def test_an_id_no_database_can_hold_is_not_found_and_no_error(sql: SqlStore[Any]) -> None:
    nul = "conv_\x00"
    sql.create_conversation(conversation(), items("a"))
    assert sql.get_response("resp_\x00", "k1") is None
    assert not sql.has_response("resp_\x00", "k1") and not sql.delete_response("resp_\x00", "k1")
    assert sql.get_conversation(nul, "k1") is None
    assert sql.update_conversation(nul, "k1", b"{}") is None
    assert not sql.delete_conversation(nul, "k1")
    assert sql.add_items(nul, "k1", items("b")) is None
    assert sql.list_items(nul, "k1", None, 5, "asc") is None
    assert sql.items_since(nul, "k1", 0) is None
    assert sql.get_item(nul, "k1", "a") is False
    assert sql.get_item("conv_1", "k1", "a\x00") is None
    assert sql.delete_item("conv_1", "k1", "a\x00") is None
    with pytest.raises(KeyError):
        sql.list_items("conv_1", "k1", "a\x00", 5, "asc")
    with pytest.raises(InvalidItem):
        sql.add_items("conv_1", "k1", items("b\x00"))


def turn(rid: str, history: tuple[bytes, ...], said: bytes, owner: str = "k1") -> StoredResponse:
    """A response continuing ``history`` with the input ``said``, answering ``said`` + !."""
    return StoredResponse(rid, b'{"id":"%b"}' % rid.encode(), (said + b"!",), (*history, said),
                          owner=owner)


def chain(sql: SqlStore[Any], clock: Clock, turns: int, prefix: str = "r",
          owner: str = "k1") -> list[StoredResponse]:
    made: list[StoredResponse] = []
    for i in range(turns):
        parent = made[-1] if made else None
        record = turn(f"{prefix}{i}", parent.history() if parent else (), b"x%d" % i, owner)
        sql.put_response(record, ttl_s=100, lineage=Lineage(None if parent is None else parent.id))
        made.append(record)
        clock.now += 1
    return made


def stored_size(sql: SqlStore[Any], response_id: str) -> int:
    with sql._tx(write=False) as conn:
        row = sql._run(conn, "SELECT size FROM responses WHERE id = ?", (response_id,)).fetchone()
    return -1 if row is None else int(row[0])


def test_a_follow_up_stores_only_what_it_adds(sql: SqlStore[Any], clock: Clock) -> None:
    made = chain(sql, clock, 60)
    for record in (made[0], made[1], made[59]):
        found = sql.get_response(record.id, "k1")
        assert found is not None and found[0] == record
    assert stored_size(sql, made[59].id) == stored_size(sql, made[19].id)  # not growing
    assert sql.get_response(made[59].id, "k2") is None


def test_a_deleted_or_expired_parent_still_gives_its_follow_up_its_history(
        sql: SqlStore[Any], clock: Clock) -> None:
    made = chain(sql, clock, 3)
    assert sql.delete_response(made[1].id, "k1")
    assert sql.get_response(made[1].id, "k1") is None
    assert not sql.delete_response(made[1].id, "k1")  # once
    clock.now += 98.5  # the first has expired, the last has not
    assert sql.get_response(made[0].id, "k1") is None
    sql.sweep(None, None)
    found = sql.get_response(made[2].id, "k1")
    assert found is not None and found[0] == made[2]
    clock.now += 5  # now all have: the chain goes, newest first
    assert sql.sweep(None, None) == 3
    assert stored_size(sql, made[0].id) == -1


def test_a_follow_up_whose_parent_is_gone_stores_it_all(sql: SqlStore[Any], clock: Clock) -> None:
    made = chain(sql, clock, 2)
    assert sql.delete_response(made[1].id, "k1")  # no follow-up: gone at once
    orphan = turn("r9", made[1].history(), b"late")
    sql.put_response(orphan, ttl_s=100, lineage=Lineage(made[1].id))
    found = sql.get_response("r9", "k1")
    assert found is not None and found[0] == orphan


def test_an_owner_over_its_bytes_loses_its_stalest_chain_whole(sql: SqlStore[Any],
                                                               clock: Clock) -> None:
    old = chain(sql, clock, 5, "old")
    new = chain(sql, clock, 5, "new")
    other = chain(sql, clock, 5, "oth", owner="k2")  # as large as "new": within the cap
    total = sum(stored_size(sql, r.id) for r in new)
    assert sql.sweep(None, total) == 5
    assert all(sql.get_response(r.id, "k1") is None for r in old)
    assert all(sql.get_response(r.id, "k1") is not None for r in new)
    assert all(sql.get_response(r.id, "k2") is not None for r in other)


def test_a_response_on_a_conversation_refers_to_its_items(sql: SqlStore[Any],
                                                          clock: Clock) -> None:
    sql.create_conversation(conversation(), items("a", "b"))
    history = tuple(i.data for i in items("a", "b"))
    made = turn("r0", history, b"own")
    sql.put_response(made, ttl_s=100, lineage=Lineage(conversation="conv_1", upto=2,
                                                      inherited=2))
    sql.put_response(turn("r9", (), b"own"), ttl_s=100)  # the same with no history
    assert stored_size(sql, "r0") == stored_size(sql, "r9")
    assert (sql.get_response("r0", "k1") or [None])[0] == made
    sql.add_items("conv_1", "k1", items("c"))  # after it: not its history
    follow = turn("r1", made.history(), b"more")
    sql.put_response(follow, ttl_s=100, lineage=Lineage("r0"))
    assert (sql.get_response("r1", "k1") or [None])[0] == follow
    sql.delete_item("conv_1", "k1", "a")  # read as the conversation holds it now
    found = sql.get_response("r0", "k1")
    assert found is not None and found[0].conversation == (history[1], b"own")
    sql.delete_conversation("conv_1", "k1")
    found = sql.get_response("r1", "k1")
    assert found is not None and found[0].conversation == (b"own", b"own!", b"more")


def test_a_response_on_another_owners_conversation_is_stored_whole(sql: SqlStore[Any]) -> None:
    sql.create_conversation(conversation(owner="k2"), items("a"))
    made = turn("r0", (items("a")[0].data,), b"own")
    sql.put_response(made, ttl_s=100, lineage=Lineage(conversation="conv_1", upto=1,
                                                      inherited=1))
    assert (sql.get_response("r0", "k1") or [None])[0] == made


def test_a_cancel_asked_elsewhere_reaches_the_runner_as_it_renews(sql: SqlStore[Any]) -> None:
    sql.put_response(record(status="in_progress"), ttl_s=600, lease_s=10)
    sql.put_response(record("resp_2", status="in_progress"), ttl_s=600, lease_s=10)
    assert sql.renew(["resp_1", "resp_2"], 10) == []
    assert not sql.request_cancel("resp_1", "k2")  # another owner's: not found
    assert sql.request_cancel("resp_1", "k1")
    assert sql.renew(["resp_1", "resp_2"], 10) == ["resp_1"]
    sql.put_response(record(), ttl_s=600)  # it ended: its final record
    assert not sql.request_cancel("resp_1", "k1")  # nothing runs to cancel


def test_a_running_responses_progress_is_written_until_it_ends(sql: SqlStore[Any]) -> None:
    base = turn("r0", (), b"hi")
    sql.put_response(base, ttl_s=600)
    running = msgspec.structs.replace(turn("r1", base.history(), b"go"), status="in_progress",
                                      background=True, output=())
    sql.put_response(running, ttl_s=600, lease_s=10, lineage=Lineage("r0"))
    moved = msgspec.structs.replace(running, output=(b"so far",), events=(b"e0", b"e1"))
    sql.renew(["r1"], 10, [moved])
    found = sql.get_response("r1", "k1")
    assert found is not None and found[0] == moved  # with its history, as a reader sees it
    ended = msgspec.structs.replace(moved, status="completed", output=(b"all",))
    sql.put_response(ended, ttl_s=600, lineage=Lineage("r0"))
    sql.renew(["r1"], 10, [moved])  # a late write of its progress: the end stays
    assert (sql.get_response("r1", "k1") or [None])[0] == ended


def test_a_restarted_postgres_is_reconnected_to_without_an_error() -> None:
    from direct_frontend.state.postgres import PostgresStore
    from tests.support.postgres import running_postgres

    with running_postgres() as server:
        store = PostgresStore(server.new_database(), connections=2)
        store.migrate()
        store.put_response(record("resp_a"), ttl_s=60)
        server.stop()  # every pooled connection's server is gone
        server.start()
        store.put_response(record("resp_b"), ttl_s=60)
        assert store.get_response("resp_a", "k1") is not None
        assert store.get_response("resp_b", "k1") is not None
        store.close()
