"""The durable store in one SQLite file: the embedded backend for one machine.

Sync policy: the database runs in WAL mode with ``synchronous = FULL``, so
a transaction's commit returns after the WAL is fsynced: a record the
daemon acknowledged survives a crash of the daemon (SIGKILL) and of the
machine. WAL lets readers run beside the one writer, and every process of
``run --workers`` opens the same file; a writer that finds the database
locked waits up to ``busy_timeout`` for it. ``path`` ``:memory:`` is a
private in-memory database (the ``memory`` backend's conversations).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from direct_frontend.state.sql import SqlStore, StoreError

#: how long a writer waits for another process's transaction before it fails
BUSY_TIMEOUT_MS: Final = 10_000
MEMORY: Final = ":memory:"


class SqliteStore(SqlStore[sqlite3.Connection]):
    """The store in ``path`` (created with its directory, mode 0700, if absent)."""

    integrity = (sqlite3.IntegrityError,)
    errors = (sqlite3.Error,)

    def __init__(self, path: Path | str, connections: int = 4,
                 clock: Callable[[], float] = time.time) -> None:
        memory = str(path) == MEMORY
        super().__init__(1 if memory else connections, clock)
        self.path = str(path)
        self._shared: sqlite3.Connection | None = None  # :memory: is one connection
        self._lock = threading.Lock()
        if not memory:
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _connect(self) -> sqlite3.Connection:
        if self.path == MEMORY:
            if self._shared is None:
                self._shared = sqlite3.connect(MEMORY, check_same_thread=False,
                                               isolation_level=None)
            return self._shared
        try:
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=BUSY_TIMEOUT_MS / 1000)
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise StoreError(f"{self.path}: cannot use WAL (journal mode {mode})")
            conn.execute("PRAGMA synchronous = FULL")
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from exc
        return conn

    @contextlib.contextmanager
    def _begin(self, conn: sqlite3.Connection, write: bool) -> Iterator[None]:
        with self._lock if self.path == MEMORY else contextlib.nullcontext():
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise

    def _close(self, conn: sqlite3.Connection) -> None:
        if conn is not self._shared:
            conn.close()

    def integrity_check(self) -> str:
        """``PRAGMA integrity_check``'s answer: ``ok`` for an intact database."""
        with self._tx() as conn:
            return "; ".join(str(row[0]) for row in conn.execute("PRAGMA integrity_check"))
