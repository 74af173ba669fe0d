"""The durable store's backends, each over a real server: a SQLite file, a PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.state.postgres import PostgresStore
from direct_frontend.state.sql import SqlStore
from direct_frontend.state.sqlite import SqliteStore
from tests.support.postgres import PostgresServer, running_postgres


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


@pytest.fixture(scope="session")
def migrated(postgres: PostgresServer) -> str:
    """The name of a database the store's migrations ran on (from empty), which each test's
    store copies: a copy is ready in half the time migrating a new one takes."""
    name = postgres.create()
    store = PostgresStore(postgres.dsn(name))
    assert store.migrate() == 0  # it was empty
    store.close()
    return name


class Clock:
    """Wall time the test moves."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", "postgres"])
def sql(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[SqlStore[Any]]:
    store: SqlStore[Any]
    if request.param == "sqlite":
        store = SqliteStore(tmp_path / "state" / "store.db", clock=clock)
    else:
        server: PostgresServer = request.getfixturevalue("postgres")
        template: str = request.getfixturevalue("migrated")
        store = PostgresStore(server.new_database(template), clock=clock)
    store.migrate()
    yield store
    store.close()
