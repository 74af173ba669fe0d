"""The durable store in PostgreSQL: one database shared by a fleet of replicas and workers.

Any process reads what any other wrote, so a conversation or a response
chain started on one replica continues on another with nothing between
them but the database. A call returns once its transaction has committed.
The driver (psycopg) is imported when this backend is used, not before.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Final

from direct_frontend.state.sql import SqlStore, StoreError

if TYPE_CHECKING:
    import psycopg

#: the advisory lock migrations hold (any number: the same in every process)
MIGRATION_LOCK: Final = 0x64665F73
#: how long a connection attempt waits
CONNECT_TIMEOUT_S: Final = 10


class PostgresStore(SqlStore["psycopg.Connection[Any]"]):
    """The store in the database ``dsn`` names (a libpq connection string or URL)."""

    types: ClassVar[dict[str, str]] = {"blob": "BYTEA", "real": "DOUBLE PRECISION", "int": "BIGINT"}
    placeholder = "%s"

    def __init__(self, dsn: str, connections: int = 4,
                 clock: Callable[[], float] = time.time) -> None:
        try:
            import psycopg
        except ImportError as exc:  # pragma: no cover - a packaging mistake
            raise StoreError("the postgres backend needs psycopg: pip install "
                             "'direct-frontend[postgres]'") from exc
        super().__init__(connections, clock)
        self.dsn = dsn
        self.integrity = (psycopg.IntegrityError,)
        self.errors = (psycopg.Error,)

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg

        # autocommit: each transaction is exactly a ``transaction()`` block
        return psycopg.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True)

    @contextlib.contextmanager
    def _begin(self, conn: psycopg.Connection[Any], write: bool) -> Iterator[None]:
        with conn.transaction():
            yield

    def _close(self, conn: psycopg.Connection[Any]) -> None:
        conn.close()

    def _stale(self, exc: Exception) -> bool:
        import psycopg

        return isinstance(exc, psycopg.OperationalError)

    def _lock_schema(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))

    def _for_update(self, statement: str) -> str:
        return statement + " FOR UPDATE"
