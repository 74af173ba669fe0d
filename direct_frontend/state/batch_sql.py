"""The Files and Batch APIs' SQL, over the durable store's connections (blocking calls).

Each method is one transaction of :class:`~direct_frontend.state.sql.SqlStore`
(SQLite or PostgreSQL), so it returns once committed; the Trio shell
(:mod:`.batch_store`) runs them on worker threads.

A file's bytes live in the database beside its record, in parts of
:data:`PART_BYTES`: every process of a fleet on one PostgreSQL reads what
another wrote (a file under one machine's state directory would be
invisible to the others), an upload is one transaction (its record never
names bytes that are not there), and a download reads a part at a time.

A batch is a row (its record, the process running it and that process's
lease) and, once its input is read, one row per line, each given its
result in the transaction that records the line as done. A process that
takes a batch up after another stopped (a restart, a crash) runs only the
lines without a result. When the batch ends, one transaction writes its
output and error files from those rows, records the end and drops the
lines, so a crash in between leaves it to be finished again, whole.

Every row has an owner and every query a client's call makes names it:
another owner's id is not found, exactly as an id nobody made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final

import msgspec

from direct_frontend.openai.batch_lines import Line, unrun_line
from direct_frontend.openai.batches import (
    ACTIVE,
    BatchError,
    Status,
    StoredBatch,
    decode_batch,
    encode_batch,
)
from direct_frontend.openai.files import BATCH_OUTPUT, StoredFile, new_file_id
from direct_frontend.state.sql import Order, SqlStore, StoreError, _absent_if_unstorable

#: a file's bytes are stored in parts of at most this many bytes
PART_BYTES: Final = 1024 * 1024
#: the most rows one retention transaction drops
SWEEP_BATCH: Final = 500
#: a claim looks at this many times the batches it may take (to choose among owners)
CANDIDATES: Final = 16

_decode_file: Final = msgspec.msgpack.Decoder(StoredFile).decode
_encode_file: Final = msgspec.msgpack.Encoder().encode


class OwnerFull(StoreError):
    """The owner holds what it may already (its caller's 4xx names the limit)."""


def parts_of(data: bytes) -> list[bytes]:
    """``data`` cut in parts of :data:`PART_BYTES` (none for no bytes)."""
    return [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]


class BatchSql:
    """Files and batches in ``sql``'s database; see the module's text."""

    def __init__(self, sql: SqlStore[Any]) -> None:
        self.sql = sql

    def _run(self, conn: Any, statement: str, params: Sequence[Any] = ()) -> Any:
        return self.sql._run(conn, statement, params)

    def _many(self, conn: Any, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        conn.cursor().executemany(self.sql._sql(statement), list(rows))

    # -- files ----------------------------------------------------------------------------
    def put_file(self, file: StoredFile, data: bytes, owner_bytes: int | None = None) -> None:
        """Keep ``file`` and its bytes; committed when this returns. OwnerFull when its
        owner's files would hold more than ``owner_bytes``."""
        with self.sql._tx() as conn:
            if owner_bytes is not None:
                row = self._run(conn, "SELECT COALESCE(SUM(size), 0) FROM files WHERE owner = ?"
                                      " AND (expires IS NULL OR expires > ?)",
                                (file.owner, self.sql.clock())).fetchone()
                if int(row[0]) + len(data) > owner_bytes:
                    raise OwnerFull(f"the owner's files hold {int(row[0])} bytes")
            self._insert_file(conn, file, data)

    def _insert_file(self, conn: Any, file: StoredFile, data: bytes) -> None:
        self._run(conn, "INSERT INTO files (id, owner, created, expires, purpose, size, record)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (file.id, file.owner, self.sql.clock(), file.expires_at, file.purpose,
                   len(data), _encode_file(file)))
        self._many(conn, "INSERT INTO file_parts (file, seq, data) VALUES (?, ?, ?)",
                   ((file.id, seq, part) for seq, part in enumerate(parts_of(data))))

    @_absent_if_unstorable(None)
    def get_file(self, file_id: str, owner: str) -> StoredFile | None:
        with self.sql._tx(write=False) as conn:
            return self._file(conn, file_id, owner)

    def _file(self, conn: Any, file_id: str, owner: str) -> StoredFile | None:
        row = self._run(conn, "SELECT record FROM files WHERE id = ? AND owner = ? AND "
                              "(expires IS NULL OR expires > ?)",
                        (file_id, owner, self.sql.clock())).fetchone()
        return None if row is None else _decode_file(bytes(row[0]))

    @_absent_if_unstorable(None)
    def read_part(self, file_id: str, owner: str, seq: int) -> bytes | None:
        """Part ``seq`` of ``owner``'s file (None: no such file, or no such part)."""
        with self.sql._tx(write=False) as conn:
            if self._file(conn, file_id, owner) is None:
                return None
            row = self._run(conn, "SELECT data FROM file_parts WHERE file = ? AND seq = ?",
                            (file_id, seq)).fetchone()
        return None if row is None else bytes(row[0])

    @_absent_if_unstorable(None)
    def read_file(self, file_id: str, owner: str) -> tuple[StoredFile, bytes] | None:
        """``owner``'s file and all its bytes."""
        with self.sql._tx(write=False) as conn:
            file = self._file(conn, file_id, owner)
            if file is None:
                return None
            rows = self._run(conn, "SELECT data FROM file_parts WHERE file = ? ORDER BY seq",
                             (file_id,)).fetchall()
        return file, b"".join(bytes(row[0]) for row in rows)

    @_absent_if_unstorable(False)
    def delete_file(self, file_id: str, owner: str) -> bool:
        with self.sql._tx() as conn:
            if self._file(conn, file_id, owner) is None:
                return False
            self._drop_files(conn, [file_id])
            return True

    def _drop_files(self, conn: Any, file_ids: Sequence[str]) -> None:
        for file_id in file_ids:
            self._run(conn, "DELETE FROM files WHERE id = ?", (file_id,))
            self._run(conn, "DELETE FROM file_parts WHERE file = ?", (file_id,))

    def list_files(self, owner: str, after: str | None, limit: int, order: Order,
                   purpose: str | None = None) -> tuple[list[StoredFile], bool]:
        """A page of ``owner``'s files (by creation, in ``order``) after the file ``after``,
        and whether more follow; an ``after`` that is no file of the owner's: KeyError."""
        extra = "AND (expires IS NULL OR expires > ?)"
        params: list[Any] = [self.sql.clock()]
        if purpose is not None:
            extra += " AND purpose = ?"
            params.append(purpose)
        rows = self._page("files", "record", owner, after, limit, order, extra, params)
        return [_decode_file(bytes(row[0])) for row in rows[:limit]], len(rows) > limit

    def _page(self, table: str, columns: str, owner: str, after: str | None, limit: int,
              order: Order, extra: str, params: list[Any]) -> list[Any]:
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where = f"owner = ? {extra}"
        values: list[Any] = [owner, *params]
        with self.sql._tx(write=False) as conn:
            if after is not None:
                if "\x00" in after:  # no stored id holds one
                    raise KeyError(after)
                row = self._run(conn, f"SELECT created FROM {table} WHERE id = ? AND owner = ?",
                                (after, owner)).fetchone()
                if row is None:
                    raise KeyError(after)
                where += f" AND (created {op} ? OR (created = ? AND id {op} ?))"
                values += [row[0], row[0], after]
            return list(self._run(conn, f"SELECT {columns} FROM {table} WHERE {where} ORDER BY "
                                        f"created {direction}, id {direction} LIMIT ?",
                                  (*values, limit + 1)).fetchall())

    # -- batches: what a client's calls do ---------------------------------------------------
    def create_batch(self, batch: StoredBatch, owner_active: int | None = None) -> None:
        """Keep a new batch; OwnerFull when its owner has ``owner_active`` batches that have
        not ended already."""
        with self.sql._tx() as conn:
            if owner_active is not None:
                row = self._run(conn, f"SELECT COUNT(*) FROM batches WHERE owner = ? AND "
                                      f"status IN ({', '.join('?' * len(ACTIVE))})",
                                (batch.owner, *ACTIVE)).fetchone()
                if int(row[0]) >= owner_active:
                    raise OwnerFull(f"the owner has {int(row[0])} batches running")
            self._run(conn, "INSERT INTO batches (id, owner, created, status, record, holder, "
                            "lease, cancel, completed, failed, expires) VALUES "
                            "(?, ?, ?, ?, ?, NULL, NULL, 0, 0, 0, NULL)",
                      (batch.id, batch.owner, self.sql.clock(), batch.status,
                       encode_batch(batch)))

    @_absent_if_unstorable(None)
    def get_batch(self, batch_id: str, owner: str) -> StoredBatch | None:
        with self.sql._tx(write=False) as conn:
            return self._batch(conn, batch_id, owner)

    def list_batches(self, owner: str, after: str | None,
                     limit: int) -> tuple[list[StoredBatch], bool]:
        """A page of ``owner``'s batches, newest first, after the batch ``after``
        (KeyError: no batch of the owner's)."""
        rows = self._page("batches", "record, completed, failed", owner, after, limit, "desc",
                          "", [])
        return [_with_counts(row) for row in rows[:limit]], len(rows) > limit

    @_absent_if_unstorable(None)
    def request_cancel(self, batch_id: str, owner: str) -> StoredBatch | None:
        """``owner``'s batch once asked to cancel: ``cancelling`` if it had work left (its
        process reads that as it renews its lease), else as it is."""
        with self.sql._tx() as conn:
            batch = self._batch(conn, batch_id, owner, lock=True)
            if batch is None or batch.status not in ("validating", "in_progress"):
                return batch
            moved = batch.moved("cancelling", self._now())
            self._write(conn, moved, "cancel = 1")
            return moved

    # -- batches: what the runner does -----------------------------------------------------
    def claim(self, holder: str, lease_s: float, limit: int,
              busy: Collection[str] = ()) -> list[StoredBatch]:
        """Up to ``limit`` batches with work left that no process holds (or whose holder's
        lease ran out), now ``holder``'s for ``lease_s``.

        Fair between owners: each next one is the oldest batch of the owner
        with the fewest batches running here (``busy``: the owners of those
        already running, once per batch), so one owner's queue of batches does
        not keep another's waiting behind it.
        """
        now = self.sql.clock()
        taken: list[StoredBatch] = []
        with self.sql._tx() as conn:
            pool = list(self._run(conn, f"SELECT id, owner FROM batches WHERE status IN "
                                        f"({', '.join('?' * len(ACTIVE))}) AND (lease IS NULL "
                                        f"OR lease < ?) ORDER BY created LIMIT ?",
                                  (*ACTIVE, now, limit * CANDIDATES)).fetchall())
            running = Counter(busy)
            while pool and len(taken) < limit:
                row = min(pool, key=lambda candidate: running[candidate[1]])  # oldest of ties
                pool.remove(row)
                batch_id, owner = row
                cursor = self._run(conn, "UPDATE batches SET holder = ?, lease = ? WHERE id = ? "
                                         "AND (lease IS NULL OR lease < ?)",
                                   (holder, now + lease_s, batch_id, now))
                batch = self._batch(conn, batch_id) if cursor.rowcount else None
                if batch is not None:
                    taken.append(batch)
                    running[owner] += 1
        return taken

    def renew(self, batch_id: str, holder: str, lease_s: float) -> tuple[bool, bool]:
        """Extend ``holder``'s lease of the batch: whether it still holds it, and whether a
        cancel was asked."""
        with self.sql._tx() as conn:
            cursor = self._run(conn, "UPDATE batches SET lease = ? WHERE id = ? AND holder = ?",
                               (self.sql.clock() + lease_s, batch_id, holder))
            row = self._run(conn, "SELECT cancel FROM batches WHERE id = ?",
                            (batch_id,)).fetchone()
        return bool(cursor.rowcount), row is not None and bool(int(row[0]))

    def release(self, batch_id: str, holder: str) -> None:
        """``holder`` stops running the batch: another process may take it up at once."""
        with self.sql._tx() as conn:
            self._run(conn, "UPDATE batches SET holder = NULL, lease = NULL WHERE id = ? AND "
                            "holder = ?", (batch_id, holder))

    def start(self, batch_id: str, holder: str, lines: Sequence[Line],
              model: str | None) -> StoredBatch:
        """The batch's input is read: its lines are kept, and it is ``in_progress`` (unless
        it is being cancelled). StoreError when ``holder`` no longer holds it."""
        with self.sql._tx() as conn:
            batch = self._held(conn, batch_id, holder)
            self._many(conn, "INSERT INTO batch_lines (batch, ord, line, custom_id, body, ok, "
                             "result) VALUES (?, ?, ?, ?, ?, NULL, NULL)",
                       ((batch_id, line.ord, line.line, line.custom_id, line.body)
                        for line in lines))
            fields: dict[str, Any] = {"total": len(lines), "model": model}
            now = self._now()
            moved = (batch.moved("in_progress", now, **fields) if batch.status == "validating"
                     else batch.moved(batch.status, now, **fields))
            self._write(conn, moved)
            return moved

    def pending(self, batch_id: str) -> list[Line]:
        """The batch's lines without a result, in run order."""
        with self.sql._tx(write=False) as conn:
            rows = self._run(conn, "SELECT ord, line, custom_id, body FROM batch_lines WHERE "
                                   "batch = ? AND result IS NULL ORDER BY ord",
                             (batch_id,)).fetchall()
        return [Line(int(r[0]), int(r[1]), str(r[2]), bytes(r[3])) for r in rows]

    def put_results(self, batch_id: str, results: Sequence[tuple[int, bool, bytes]]) -> None:
        """Lines done: ``(ord, succeeded, output line)`` each, and the batch's counts."""
        done = [0, 0]
        with self.sql._tx() as conn:
            for ord_, ok, line in results:
                cursor = self._run(conn, "UPDATE batch_lines SET ok = ?, result = ? WHERE "
                                         "batch = ? AND ord = ? AND result IS NULL",
                                   (int(ok), line, batch_id, ord_))
                done[0 if ok else 1] += cursor.rowcount
            self._run(conn, "UPDATE batches SET completed = completed + ?, failed = failed + ? "
                            "WHERE id = ?", (done[0], done[1], batch_id))

    def move(self, batch_id: str, holder: str, status: Status) -> StoredBatch:
        """The batch ``holder`` runs goes on to ``status`` (``finalizing``)."""
        with self.sql._tx() as conn:
            batch = self._held(conn, batch_id, holder)
            moved = batch.moved(status, self._now())
            self._write(conn, moved)
            return moved

    def finish(self, batch_id: str, holder: str, status: Status,
               file_ttl_s: float) -> StoredBatch:
        """End the batch as ``status``: its output file (the lines that succeeded) and error
        file (the others, and those that never ran, as ``status`` says why), in file
        order; the lines dropped. One transaction."""
        with self.sql._tx() as conn:
            batch = self._held(conn, batch_id, holder)
            now = self._now()
            rows = self._run(conn, "SELECT custom_id, ok, result FROM batch_lines WHERE "
                                   "batch = ? ORDER BY line", (batch_id,)).fetchall()
            output: list[bytes] = []
            errors: list[bytes] = []
            unrun = 0
            for custom_id, ok, result in rows:
                if result is None:
                    errors.append(unrun_line(str(custom_id), status))
                    unrun += 1
                else:
                    (output if int(ok) else errors).append(bytes(result))
            expires = int(now + file_ttl_s)
            ids: dict[str, str | None] = {}
            for kind, lines in (("output", output), ("error", errors)):
                ids[kind] = None
                if lines:
                    data = b"\n".join(lines) + b"\n"
                    file = StoredFile(id=new_file_id(), owner=batch.owner, created_at=now,
                                      filename=f"{batch_id}_{kind}.jsonl",
                                      purpose=BATCH_OUTPUT, size=len(data),
                                      expires_at=expires)
                    self._insert_file(conn, file, data)
                    ids[kind] = file.id
            moved = batch.moved(status, now, output_file_id=ids["output"],
                                error_file_id=ids["error"])
            self._run(conn, "UPDATE batches SET failed = failed + ?, holder = NULL, "
                            "lease = NULL, expires = ? WHERE id = ?",
                      (unrun, now + file_ttl_s, batch_id))
            self._write(conn, moved)
            self._run(conn, "DELETE FROM batch_lines WHERE batch = ?", (batch_id,))
            return self._counted(conn, moved)

    def fail(self, batch_id: str, holder: str, errors: Sequence[BatchError],
             file_ttl_s: float) -> StoredBatch:
        """The batch cannot run (its input is wrong, or gone): ``failed`` with ``errors``."""
        with self.sql._tx() as conn:
            batch = self._held(conn, batch_id, holder)
            now = self._now()
            moved = batch.moved("failed", now, errors=tuple(errors))
            self._run(conn, "UPDATE batches SET holder = NULL, lease = NULL, expires = ? WHERE "
                            "id = ?", (now + file_ttl_s, batch_id))
            self._write(conn, moved)
            self._run(conn, "DELETE FROM batch_lines WHERE batch = ?", (batch_id,))
            return moved

    # -- retention ----------------------------------------------------------------------
    def sweep(self) -> int:
        """Drop the files past their expiry and the ended batches past theirs; how many."""
        now = self.sql.clock()
        dropped = 0
        while True:
            with self.sql._tx() as conn:
                files = [r[0] for r in self._run(
                    conn, "SELECT id FROM files WHERE expires <= ? LIMIT ?",
                    (now, SWEEP_BATCH)).fetchall()]
                self._drop_files(conn, files)
                batches = [r[0] for r in self._run(
                    conn, "SELECT id FROM batches WHERE expires <= ? LIMIT ?",
                    (now, SWEEP_BATCH)).fetchall()]
                for batch_id in batches:
                    self._run(conn, "DELETE FROM batches WHERE id = ?", (batch_id,))
            dropped += len(files) + len(batches)
            if len(files) < SWEEP_BATCH and len(batches) < SWEEP_BATCH:
                return dropped

    # -- helpers ----------------------------------------------------------------------------
    def _now(self) -> int:
        """The time a batch's step is stamped with (whole seconds, as OpenAI's)."""
        return int(self.sql.clock())

    def _batch(self, conn: Any, batch_id: str, owner: str | None = None,
               lock: bool = False) -> StoredBatch | None:
        statement = "SELECT record, completed, failed FROM batches WHERE id = ?"
        params: list[Any] = [batch_id]
        if owner is not None:
            statement += " AND owner = ?"
            params.append(owner)
        row = self._run(conn, self.sql._for_update(statement) if lock else statement,
                        params).fetchone()
        return None if row is None else _with_counts(row)

    def _counted(self, conn: Any, batch: StoredBatch) -> StoredBatch:
        found = self._batch(conn, batch.id)
        return batch if found is None else msgspec.structs.replace(
            batch, completed=found.completed, failed=found.failed)

    def _held(self, conn: Any, batch_id: str, holder: str) -> StoredBatch:
        row = self._run(conn, self.sql._for_update("SELECT holder FROM batches WHERE id = ?"),
                        (batch_id,)).fetchone()
        if row is None or row[0] != holder:
            raise StoreError(f"batch {batch_id} is no longer run by this process")
        batch = self._batch(conn, batch_id)
        assert batch is not None
        return batch

    def _write(self, conn: Any, batch: StoredBatch, extra: str = "") -> None:
        sets = "status = ?, record = ?" + (f", {extra}" if extra else "")
        self._run(conn, f"UPDATE batches SET {sets} WHERE id = ?",
                  (batch.status, encode_batch(batch), batch.id))


def _with_counts(row: Sequence[Any]) -> StoredBatch:
    """A batch from its row's ``record, completed, failed`` (the counts are columns, moved
    by each line's result without rewriting the record)."""
    return msgspec.structs.replace(decode_batch(bytes(row[0])), completed=int(row[1]),
                                   failed=int(row[2]))
