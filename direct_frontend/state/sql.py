"""The durable store's SQL, one implementation for SQLite and PostgreSQL (blocking calls).

Every method is one transaction on a connection taken from a small pool,
and returns once it has committed: a record :meth:`SqlStore.put_response`
returned for is on disk (SQLite: WAL, ``synchronous = FULL``, so the commit's
fsync is done; PostgreSQL: its commit). The Trio shell (:mod:`.shell`) runs
them on worker threads.

Every row has an owner and every query names it: another owner's id is not
found, exactly as an id nobody made. A stored response is its msgpack
record (openai/response_store.py); a conversation is a row and its items one
row each, numbered in the order they were added, so a page is an index range
and an append costs one row whatever the conversation's length.

The schema is versioned: :data:`MIGRATIONS` are applied in order at open, in
one transaction that holds the database's write lock (SQLite's ``BEGIN
IMMEDIATE``, a PostgreSQL advisory lock), so processes starting together
apply each once.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Final, Generic, Literal, TypeVar, cast

import msgspec

from direct_frontend.openai.conversations import Conversation
from direct_frontend.openai.response_store import (
    Item,
    Lineage,
    StoredResponse,
    decode_record,
    encode_record,
)

#: the schema's versions: each entry takes the database from its index to the next
#: (``{blob}``, ``{real}``, ``{int}``: the dialect's types)
MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        # parent: the response a follow-up continues (it stores only what it adds, and
        # inherits the parent's history: ``inherited`` items); else thread: the conversation
        # whose items numbered below ``upto`` began its history; length: its history's items;
        # hidden: deleted, but held for the history of a follow-up; cancel: a cancel was
        # asked of a running background response (its process reads it as it renews)
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created {real} NOT NULL,
            expires {real} NOT NULL, status TEXT NOT NULL, lease {real},
            size {int} NOT NULL, record {blob} NOT NULL, parent TEXT,
            inherited {int} NOT NULL, length {int} NOT NULL, hidden {int} NOT NULL,
            thread TEXT, upto {int} NOT NULL, cancel {int} NOT NULL)""",
        "CREATE INDEX responses_owner ON responses (owner, created)",
        "CREATE INDEX responses_parent ON responses (parent)",
        "CREATE INDEX responses_expires ON responses (expires)",
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at {int} NOT NULL,
            updated {real} NOT NULL, metadata {blob} NOT NULL, size {int} NOT NULL,
            next_seq {int} NOT NULL)""",
        "CREATE INDEX conversations_owner ON conversations (owner, updated)",
        """CREATE TABLE conversation_items (
            conversation TEXT NOT NULL, seq {int} NOT NULL, item_id TEXT NOT NULL,
            data {blob} NOT NULL, PRIMARY KEY (conversation, seq))""",
        "CREATE UNIQUE INDEX conversation_items_id ON conversation_items (conversation, item_id)",
    ),
    (
        # the Files and Batch APIs (state/batch_sql.py): a file's record and its bytes in
        # parts; a batch's record, the process running it (holder, under a lease), and its
        # lines (each with its result once it has one) until it ends
        """CREATE TABLE files (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created {real} NOT NULL,
            expires {real}, purpose TEXT NOT NULL, size {int} NOT NULL,
            record {blob} NOT NULL)""",
        "CREATE INDEX files_owner ON files (owner, created)",
        "CREATE INDEX files_expires ON files (expires)",
        """CREATE TABLE file_parts (
            file TEXT NOT NULL, seq {int} NOT NULL, data {blob} NOT NULL,
            PRIMARY KEY (file, seq))""",
        """CREATE TABLE batches (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created {real} NOT NULL,
            status TEXT NOT NULL, record {blob} NOT NULL, holder TEXT, lease {real},
            cancel {int} NOT NULL, completed {int} NOT NULL, failed {int} NOT NULL,
            expires {real})""",
        "CREATE INDEX batches_owner ON batches (owner, created)",
        "CREATE INDEX batches_status ON batches (status)",
        """CREATE TABLE batch_lines (
            batch TEXT NOT NULL, ord {int} NOT NULL, line {int} NOT NULL,
            custom_id TEXT NOT NULL, body {blob} NOT NULL, ok {int}, result {blob},
            PRIMARY KEY (batch, ord))""",
    ),
)
SCHEMA_VERSION: Final = len(MIGRATIONS)
#: what a running background response's row is read as once its lease has run out
RUNNING: Final = ("queued", "in_progress")

Order = Literal["asc", "desc"]
_C = TypeVar("_C")


class StoreError(Exception):
    """The database refused or could not be reached (the caller answers 'not stored')."""


class InvalidItem(StoreError):
    """An item the store cannot take as it is (the caller's 400)."""


class DuplicateItem(InvalidItem):
    """An item's id is already in its conversation."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _absent_if_unstorable(default: object) -> Callable[[_F], _F]:
    """A lookup by an id (the first argument) holding a NUL character, which PostgreSQL's
    text cannot hold and so no stored id does, answers ``default``, as for an id nobody
    made: never a database error for what a client sent."""
    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def guarded(self: Any, first: str, *args: Any) -> Any:
            if "\x00" in first:
                return default
            return method(self, first, *args)
        return cast(_F, guarded)
    return wrap


class SqlStore(Generic[_C]):
    """The durable store over one database; see the module's text.

    Subclasses connect (:meth:`_connect`), open a transaction (:meth:`_begin`)
    and name their types; the SQL is written once, with ``?`` placeholders.
    """

    types: ClassVar[dict[str, str]] = {"blob": "BLOB", "real": "REAL", "int": "INTEGER"}
    placeholder = "?"
    #: what the driver raises when a unique key is broken
    integrity: tuple[type[Exception], ...] = ()
    #: what the driver raises at all (answered as :class:`StoreError`)
    errors: tuple[type[Exception], ...] = ()

    def __init__(self, connections: int, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.connections = connections
        self._pool: queue.SimpleQueue[_C] = queue.SimpleQueue()

    # -- what a dialect supplies ----------------------------------------------------------
    def _connect(self) -> _C:
        raise NotImplementedError

    @contextlib.contextmanager
    def _begin(self, conn: _C, write: bool) -> Iterator[None]:
        """One transaction; a ``write`` one holds the write lock from its start."""
        raise NotImplementedError
        yield

    def _close(self, conn: _C) -> None:
        raise NotImplementedError

    def _lock_schema(self, conn: _C) -> None:
        """Serialize migrations between processes (within :meth:`_begin`)."""

    # -- plumbing -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _tx(self, write: bool = True) -> Iterator[_C]:
        """One transaction on a pooled connection (a new one when none is idle).

        A pooled connection whose server went away since (a restart, a
        failover) fails as its transaction begins: it is dropped and the
        transaction begins once more on a new one. A connection that failed
        is never pooled again; one whose transaction was rolled back for
        the caller's exception is.
        """
        conn, pooled = self._take()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self._begin(conn, write))
        except self.errors as exc:
            self._discard(conn)
            if not (pooled and self._stale(exc)):
                raise StoreError(str(exc)) from exc
            conn, _ = self._take(fresh=True)
            try:
                stack.enter_context(self._begin(conn, write))
            except self.errors as again:
                self._discard(conn)
                raise StoreError(str(again)) from again
        broken = True
        try:
            with stack:
                yield conn
            broken = False
        except self.errors as exc:
            raise StoreError(str(exc)) from exc
        except BaseException:
            broken = False  # the caller's: the transaction was rolled back
            raise
        finally:
            if broken:
                self._discard(conn)
            else:
                self._pool.put(conn)

    def _take(self, fresh: bool = False) -> tuple[_C, bool]:
        """A connection, and whether it came from the pool."""
        if not fresh:
            try:
                return self._pool.get_nowait(), True
            except queue.Empty:
                pass
        try:
            return self._connect(), False
        except self.errors as exc:
            raise StoreError(str(exc)) from exc

    def _discard(self, conn: _C) -> None:
        with contextlib.suppress(Exception):
            self._close(conn)

    def _stale(self, exc: Exception) -> bool:
        """Whether a pooled connection failed because its server went away (retry once)."""
        return False

    def _sql(self, statement: str) -> str:
        return statement if self.placeholder == "?" else statement.replace("?", self.placeholder)

    def _run(self, conn: _C, statement: str, params: Sequence[Any] = ()) -> Any:
        return conn.execute(self._sql(statement), params)  # type: ignore[attr-defined]

    def close(self) -> None:
        while True:
            try:
                conn = self._pool.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(Exception):
                self._close(conn)

    def schema_version(self) -> int:
        """The database's schema version (0: none yet), changing nothing; StoreError when
        it cannot be reached."""
        with self._tx(write=False) as conn:
            self._run(conn, "SELECT 1").fetchone()
        try:
            with self._tx(write=False) as conn:
                row = self._run(conn, "SELECT version FROM schema_version").fetchone()
        except StoreError:  # no such table: a new database
            return 0
        return 0 if row is None else int(row[0])

    def migrate(self) -> int:
        """Bring the schema to :data:`SCHEMA_VERSION`; the version it was at."""
        with self._tx() as conn:
            self._lock_schema(conn)
            self._run(conn, "CREATE TABLE IF NOT EXISTS schema_version (version "
                            f"{self.types['int']} NOT NULL)")
            row = self._run(conn, "SELECT version FROM schema_version").fetchone()
            was = 0 if row is None else int(row[0])
            if was > SCHEMA_VERSION:
                raise StoreError(f"the database's schema is version {was}, newer than this "
                                 f"program's {SCHEMA_VERSION}: run the newer program")
            for steps in MIGRATIONS[was:]:
                for statement in steps:
                    self._run(conn, statement.format(**self.types))
            if row is None:
                self._run(conn, "INSERT INTO schema_version (version) VALUES (?)",
                          (SCHEMA_VERSION,))
            elif was < SCHEMA_VERSION:
                self._run(conn, "UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
            return was

    # -- responses --------------------------------------------------------------------------
    def put_response(self, record: StoredResponse, ttl_s: float,
                     lease_s: float | None = None, lineage: Lineage | None = None) -> None:
        """Keep ``record`` (replacing one of its id); committed when this returns.

        ``lineage``: where its history came from. A follow-up of a stored
        response (its parent) writes only what it adds, and its parent's row
        stays as long as it does, so a chain of N turns costs its items once,
        not N times; one made on a conversation refers to the conversation's
        items (it is then read with them as the conversation holds them). A
        parent or conversation gone meanwhile: the record is stored whole.
        ``lease_s``: a running background response's row is read as failed
        unless its process renews the lease within this long.
        """
        now = self.clock()
        lease = None if lease_s is None else now + lease_s
        length = len(record.conversation) + len(record.output)
        lineage = lineage or Lineage()
        with self._tx() as conn:
            inherited, parent, thread = 0, None, None
            if lineage.parent is not None:
                row = self._run(conn, "SELECT length FROM responses WHERE id = ? AND owner = ?",
                                (lineage.parent, record.owner)).fetchone()
                if row is not None and int(row[0]) <= len(record.conversation):
                    inherited, parent = int(row[0]), lineage.parent
            elif lineage.conversation is not None and lineage.inherited:
                row = self._run(conn, "SELECT 1 FROM conversations WHERE id = ? AND owner = ?",
                                (lineage.conversation, record.owner)).fetchone()
                if row is not None and lineage.inherited <= len(record.conversation):
                    inherited, thread = lineage.inherited, lineage.conversation
            own = msgspec.structs.replace(record, conversation=record.conversation[inherited:])
            body = encode_record(own)
            self._run(conn, "DELETE FROM responses WHERE id = ?", (record.id,))
            self._run(conn, "INSERT INTO responses (id, owner, created, expires, status, lease, "
                            "size, record, parent, inherited, length, hidden, thread, upto, "
                            "cancel) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, 0)",
                      (record.id, record.owner, now, now + ttl_s, record.status, lease,
                       len(body), body, parent, inherited, length, thread,
                       lineage.upto if thread else 0))

    def _record(self, conn: _C, response_id: str) -> StoredResponse:
        """The stored response ``response_id``, its history put back together: the rows of
        its chain, oldest first, each after what it inherits (a conversation's items as the
        conversation holds them now)."""
        rows = self._run(conn, """WITH RECURSIVE chain(id, parent, thread, upto, record, depth)
                AS (SELECT id, parent, thread, upto, record, 0 FROM responses WHERE id = ?
                UNION ALL
                SELECT r.id, r.parent, r.thread, r.upto, r.record, c.depth + 1
                FROM responses r JOIN chain c ON r.id = c.parent)
            SELECT parent, thread, upto, record FROM chain ORDER BY depth DESC""",
                         (response_id,)).fetchall()
        history: tuple[bytes, ...] = ()
        record: StoredResponse | None = None
        for parent, thread, upto, body in rows:
            own = decode_record(bytes(body))
            if own is None:
                raise StoreError(f"response {response_id}: a stored record cannot be read")
            if parent is None:
                history = () if thread is None else tuple(bytes(r[0]) for r in self._run(
                    conn, "SELECT data FROM conversation_items WHERE conversation = ? AND "
                          "seq < ? ORDER BY seq", (thread, int(upto))).fetchall())
            record = msgspec.structs.replace(own, conversation=history + own.conversation)
            history = record.history()
        if record is None:
            raise StoreError(f"response {response_id}: no stored row")
        return record

    @_absent_if_unstorable(None)
    def get_response(self, response_id: str, owner: str) -> tuple[StoredResponse, bool] | None:
        """``owner``'s record, and whether it is running under a lease that has run out."""
        now = self.clock()
        with self._tx(write=False) as conn:
            row = self._run(conn, "SELECT status, lease FROM responses WHERE id = ? "
                                  "AND owner = ? AND expires > ? AND hidden = 0",
                            (response_id, owner, now)).fetchone()
            if row is None:
                return None
            record = self._record(conn, response_id)
        lost = row[0] in RUNNING and (row[1] is None or row[1] < now)
        return record, lost

    @_absent_if_unstorable(False)
    def has_response(self, response_id: str, owner: str) -> bool:
        with self._tx(write=False) as conn:
            row = self._run(conn, "SELECT 1 FROM responses WHERE id = ? AND owner = ? AND "
                                  "expires > ? AND hidden = 0",
                            (response_id, owner, self.clock())).fetchone()
        return row is not None

    @_absent_if_unstorable(False)
    def delete_response(self, response_id: str, owner: str) -> bool:
        """Drop ``owner``'s response; one that another continues is hidden instead (its
        row holds their history) and goes when they have."""
        with self._tx() as conn:
            row = self._run(conn, "SELECT 1 FROM responses WHERE id = ? AND owner = ? AND "
                                  "expires > ? AND hidden = 0",
                            (response_id, owner, self.clock())).fetchone()
            if row is None:
                return False
            child = self._run(conn, "SELECT 1 FROM responses WHERE parent = ? LIMIT 1",
                              (response_id,)).fetchone()
            if child is None:
                self._run(conn, "DELETE FROM responses WHERE id = ?", (response_id,))
            else:
                self._run(conn, "UPDATE responses SET hidden = 1 WHERE id = ?", (response_id,))
            return True

    def renew(self, response_ids: Sequence[str], lease_s: float,
              progress: Sequence[StoredResponse] = ()) -> list[str]:
        """Extend the leases of the running background responses of these ids, and write
        the ``progress`` of some (their records as they are now: another process reads
        them so); those of them another process was asked to cancel.

        A response that has ended meanwhile keeps its final record: progress
        only replaces a row still running.
        """
        until = self.clock() + lease_s
        cancelled = []
        with self._tx() as conn:
            for record in progress:
                row = self._run(conn, "SELECT inherited FROM responses WHERE id = ? AND "
                                      "status IN (?, ?)", (record.id, *RUNNING)).fetchone()
                if row is None:
                    continue
                body = encode_record(msgspec.structs.replace(
                    record, conversation=record.conversation[int(row[0]):]))
                self._run(conn, "UPDATE responses SET record = ?, size = ?, status = ? WHERE "
                                "id = ? AND status IN (?, ?)",
                          (body, len(body), record.status, record.id, *RUNNING))
            for response_id in response_ids:
                self._run(conn, "UPDATE responses SET lease = ? WHERE id = ?",
                          (until, response_id))
                row = self._run(conn, "SELECT cancel FROM responses WHERE id = ?",
                                (response_id,)).fetchone()
                if row is not None and int(row[0]):
                    cancelled.append(response_id)
        return cancelled

    @_absent_if_unstorable(False)
    def request_cancel(self, response_id: str, owner: str) -> bool:
        """Ask the process running ``owner``'s background response to cancel it (it reads
        this as it renews its lease); False when no such response is running."""
        with self._tx() as conn:
            cursor = self._run(conn, "UPDATE responses SET cancel = 1 WHERE id = ? AND owner = ?"
                                     " AND hidden = 0 AND status IN (?, ?)",
                               (response_id, owner, *RUNNING))
            return bool(cursor.rowcount)

    # -- conversations --------------------------------------------------------------------
    def create_conversation(self, conversation: Conversation, items: Sequence[Item]) -> None:
        now = self.clock()
        size = len(conversation.metadata) + sum(len(i.data) for i in items)
        with self._tx() as conn:
            self._run(conn, "INSERT INTO conversations (id, owner, created_at, updated, metadata,"
                            " size, next_seq) VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (conversation.id, conversation.owner, conversation.created_at, now,
                       conversation.metadata, size, len(items)))
            self._insert_items(conn, conversation.id, 0, items)

    @_absent_if_unstorable(None)
    def get_conversation(self, conversation_id: str, owner: str) -> Conversation | None:
        with self._tx(write=False) as conn:
            return self._conversation(conn, conversation_id, owner)

    @_absent_if_unstorable(None)
    def update_conversation(self, conversation_id: str, owner: str,
                            metadata: bytes) -> Conversation | None:
        with self._tx() as conn:
            cursor = self._run(conn, "UPDATE conversations SET metadata = ?, updated = ? "
                                     "WHERE id = ? AND owner = ?",
                               (metadata, self.clock(), conversation_id, owner))
            if not cursor.rowcount:
                return None
            return self._conversation(conn, conversation_id, owner)

    @_absent_if_unstorable(False)
    def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        with self._tx() as conn:
            cursor = self._run(conn, "DELETE FROM conversations WHERE id = ? AND owner = ?",
                               (conversation_id, owner))
            if not cursor.rowcount:
                return False
            self._run(conn, "DELETE FROM conversation_items WHERE conversation = ?",
                      (conversation_id,))
            return True

    @_absent_if_unstorable(None)
    def add_items(self, conversation_id: str, owner: str, items: Sequence[Item]) -> int | None:
        """Append ``items``; the number the next item will get (None: not ``owner``'s)."""
        size = sum(len(i.data) for i in items)
        with self._tx() as conn:
            row = self._run(conn, self._for_update(
                "SELECT next_seq FROM conversations WHERE id = ? AND owner = ?"),
                (conversation_id, owner)).fetchone()
            if row is None:
                return None
            first = int(row[0])
            self._insert_items(conn, conversation_id, first, items)
            self._run(conn, "UPDATE conversations SET next_seq = ?, size = size + ?, "
                            "updated = ? WHERE id = ?",
                      (first + len(items), size, self.clock(), conversation_id))
            return first + len(items)

    @_absent_if_unstorable(None)
    def list_items(self, conversation_id: str, owner: str, after: str | None, limit: int,
                   order: Order) -> tuple[list[Item], bool] | None:
        """A page of ``limit`` items after the item ``after`` (None: from the first, in
        ``order``), and whether more follow; None when the conversation is not ``owner``'s.

        An ``after`` that is no item of the conversation raises KeyError.
        """
        with self._tx(write=False) as conn:
            if self._conversation(conn, conversation_id, owner) is None:
                return None
            op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
            params: list[Any] = [conversation_id]
            where = "conversation = ?"
            if after is not None:
                if "\x00" in after:  # no stored id holds one
                    raise KeyError(after)
                row = self._run(conn, "SELECT seq FROM conversation_items WHERE conversation = ?"
                                      " AND item_id = ?", (conversation_id, after)).fetchone()
                if row is None:
                    raise KeyError(after)
                where += f" AND seq {op} ?"
                params.append(int(row[0]))
            rows = self._run(conn, f"SELECT item_id, data FROM conversation_items WHERE {where} "
                                   f"ORDER BY seq {direction} LIMIT ?",
                             (*params, limit + 1)).fetchall()
        items = [Item(row[0], bytes(row[1])) for row in rows]
        return items[:limit], len(items) > limit

    @_absent_if_unstorable(None)
    def items_since(self, conversation_id: str, owner: str,
                    start: int) -> tuple[int, list[tuple[int, bytes]]] | None:
        """The items numbered ``start`` or more, each with its number, and the number the
        next item will get; None when the conversation is not ``owner``'s. A caller
        holding the items before ``start`` reads only the rest (a gap in the numbers
        means an item was deleted: it reads them all again)."""
        with self._tx(write=False) as conn:
            row = self._run(conn, "SELECT next_seq FROM conversations WHERE id = ? AND owner = ?",
                            (conversation_id, owner)).fetchone()
            if row is None:
                return None
            rows = self._run(conn, "SELECT seq, data FROM conversation_items WHERE "
                                   "conversation = ? AND seq >= ? ORDER BY seq",
                             (conversation_id, start)).fetchall()
        return int(row[0]), [(int(r[0]), bytes(r[1])) for r in rows]

    @_absent_if_unstorable(False)
    def get_item(self, conversation_id: str, owner: str, item_id: str) -> Item | bool | None:
        """The item; False when the conversation is not ``owner``'s, None when it has no
        such item."""
        with self._tx(write=False) as conn:
            if self._conversation(conn, conversation_id, owner) is None:
                return False
            if "\x00" in item_id:  # no stored id holds one
                return None
            row = self._run(conn, "SELECT data FROM conversation_items WHERE conversation = ? "
                                  "AND item_id = ?", (conversation_id, item_id)).fetchone()
        return None if row is None else Item(item_id, bytes(row[0]))

    @_absent_if_unstorable(False)
    def delete_item(self, conversation_id: str, owner: str,
                    item_id: str) -> Conversation | bool | None:
        """The conversation once the item is gone; False: not ``owner``'s; None: no such item.

        Numbers are not reused: the items after it keep theirs, so a reader
        holding the first N items sees the delete as a changed count.
        """
        with self._tx() as conn:
            conversation = self._conversation(conn, conversation_id, owner)
            if conversation is None:
                return False
            if "\x00" in item_id:  # no stored id holds one
                return None
            row = self._run(conn, "SELECT LENGTH(data) FROM conversation_items WHERE "
                                  "conversation = ? AND item_id = ?",
                            (conversation_id, item_id)).fetchone()
            if row is None:
                return None
            self._run(conn, "DELETE FROM conversation_items WHERE conversation = ? AND "
                            "item_id = ?", (conversation_id, item_id))
            # a reader's cache of the items is keyed by next_seq: make it differ
            self._run(conn, "UPDATE conversations SET next_seq = next_seq + 1, size = size - ?, "
                            "updated = ? WHERE id = ?",
                      (int(row[0]), self.clock(), conversation_id))
            return conversation

    # -- retention ------------------------------------------------------------------------
    def sweep(self, conversation_ttl_s: float | None, max_bytes_per_owner: int | None,
              batch: int = 500) -> int:
        """Drop expired and deleted responses no follow-up still needs, conversations idle
        past ``conversation_ttl_s``, and, beyond ``max_bytes_per_owner``, each owner's least
        recently continued response chains (whole) and least recently changed conversations
        (each kind on its own); how many of them left.

        At most ``batch`` rows per transaction, so a sweep never holds the
        write lock long.
        """
        now = self.clock()
        dropped = 0
        while True:  # a chain's rows go from its newest back, one layer a pass
            with self._tx() as conn:
                ids = [r[0] for r in self._run(
                    conn, "SELECT id FROM responses r WHERE (expires <= ? OR hidden = 1) AND "
                          "NOT EXISTS (SELECT 1 FROM responses c WHERE c.parent = r.id) LIMIT ?",
                    (now, batch)).fetchall()]
                for response_id in ids:
                    self._run(conn, "DELETE FROM responses WHERE id = ?", (response_id,))
            dropped += len(ids)
            if not ids:
                break
        if conversation_ttl_s is not None:
            with self._tx() as conn:
                stale = [r[0] for r in self._run(
                    conn, "SELECT id FROM conversations WHERE updated <= ? LIMIT ?",
                    (now - conversation_ttl_s, batch)).fetchall()]
                for conversation_id in stale:
                    self._run(conn, "DELETE FROM conversations WHERE id = ?", (conversation_id,))
                    self._run(conn, "DELETE FROM conversation_items WHERE conversation = ?",
                              (conversation_id,))
            dropped += len(stale)
        if max_bytes_per_owner is not None:
            dropped += self._trim_responses(max_bytes_per_owner, batch)
            dropped += self._trim_conversations(max_bytes_per_owner, batch)
        return dropped

    def _over(self, table: str, cap: int) -> list[tuple[str, int]]:
        with self._tx(write=False) as conn:
            rows = self._run(conn, f"SELECT owner, SUM(size) FROM {table} GROUP BY owner "
                                   "HAVING SUM(size) > ?", (cap,)).fetchall()
        return [(owner, int(total) - cap) for owner, total in rows]

    def _trim_responses(self, cap: int, batch: int) -> int:
        """Each owner over ``cap`` loses the response chains it continued least recently,
        whole (the oldest tip first, then its ancestors no other follow-up needs)."""
        dropped = 0
        for owner, excess in self._over("responses", cap):
            while excess > 0:
                with self._tx() as conn:
                    tips = self._run(conn, "SELECT id, size, parent FROM responses r WHERE "
                                           "owner = ? AND NOT EXISTS (SELECT 1 FROM responses c "
                                           "WHERE c.parent = r.id) ORDER BY created LIMIT ?",
                                     (owner, batch)).fetchall()
                    for row_id, size, parent in tips:
                        if excess <= 0:
                            break
                        self._run(conn, "DELETE FROM responses WHERE id = ?", (row_id,))
                        excess -= int(size)
                        dropped += 1
                        while parent is not None and excess > 0:  # up the chain
                            row = self._run(conn, "SELECT size, parent FROM responses r WHERE "
                                                  "id = ? AND NOT EXISTS (SELECT 1 FROM "
                                                  "responses c WHERE c.parent = r.id)",
                                            (parent,)).fetchone()
                            if row is None:
                                break
                            self._run(conn, "DELETE FROM responses WHERE id = ?", (parent,))
                            excess -= int(row[0])
                            dropped += 1
                            parent = row[1]
                if not tips:
                    break
        return dropped

    def _trim_conversations(self, cap: int, batch: int) -> int:
        """Each owner over ``cap`` loses its least recently changed conversations."""
        dropped = 0
        for owner, excess in self._over("conversations", cap):
            while excess > 0:
                with self._tx() as conn:
                    rows = self._run(conn, "SELECT id, size FROM conversations WHERE owner = ? "
                                           "ORDER BY updated LIMIT ?", (owner, batch)).fetchall()
                    for row_id, size in rows:
                        if excess <= 0:
                            break
                        self._run(conn, "DELETE FROM conversations WHERE id = ?", (row_id,))
                        self._run(conn, "DELETE FROM conversation_items WHERE conversation = ?",
                                  (row_id,))
                        excess -= int(size)
                        dropped += 1
                if not rows:
                    break
        return dropped

    # -- helpers ----------------------------------------------------------------------------
    def _for_update(self, statement: str) -> str:
        """``statement`` locking the row it reads (SQLite's transaction holds the lock)."""
        return statement

    def _conversation(self, conn: _C, conversation_id: str, owner: str) -> Conversation | None:
        row = self._run(conn, "SELECT created_at, metadata FROM conversations WHERE id = ? "
                              "AND owner = ?", (conversation_id, owner)).fetchone()
        if row is None:
            return None
        return Conversation(conversation_id, owner, int(row[0]), bytes(row[1]))

    def _insert_items(self, conn: _C, conversation_id: str, first: int,
                      items: Sequence[Item]) -> None:
        if len({item.id for item in items}) < len(items):
            raise DuplicateItem("two items have one id")
        if any("\x00" in item.id for item in items):
            raise InvalidItem("an item's id holds a NUL character")
        try:
            for seq, item in enumerate(items, first):
                self._run(conn, "INSERT INTO conversation_items (conversation, seq, item_id, "
                                "data) VALUES (?, ?, ?, ?)",
                          (conversation_id, seq, item.id, item.data))
        except self.integrity as exc:
            raise DuplicateItem("an item of that id is in the conversation already") from exc
