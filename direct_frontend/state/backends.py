"""The durable store ``[frontend.responses] backend`` names, opened and migrated.

``sqlite``'s file is ``path`` (relative to the fleet file) when set, else
``responses.db`` in the state directory the service manager gave the daemon
(systemd's ``StateDirectory=`` sets ``$STATE_DIRECTORY``), else in the
user's state directory (``$XDG_STATE_HOME/direct-frontend``, by default
``~/.local/state/direct-frontend``), so the quick start keeps its responses
across restarts with nothing to set. ``memory`` keeps responses in the
process's own store (openai/response_store.py); its conversations live in a
private in-memory SQLite database, so both APIs have one implementation,
and are dropped after ``ttl_s`` idle and beyond an owner's ``max_bytes``
(``max_bytes_per_owner``) unless ``conversation_ttl_s`` and
``retain_bytes_per_owner`` say otherwise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import trio

from direct_frontend.fleet.schema import ResponsesConfig
from direct_frontend.state.postgres import PostgresStore
from direct_frontend.state.shell import Durable
from direct_frontend.state.sql import SCHEMA_VERSION, SqlStore, StoreError
from direct_frontend.state.sqlite import MEMORY, SqliteStore

log = logging.getLogger("direct_frontend.state")

FILE_NAME: Final = "responses.db"


def sqlite_path(config: ResponsesConfig, fleet_file: Path,
                environ: Mapping[str, str] = os.environ) -> Path:
    """Where the sqlite backend's database is (see the module's text)."""
    if config.path is not None:
        return fleet_file.parent / config.path
    state = environ.get("STATE_DIRECTORY")
    if state:  # systemd may list several, colon-separated: the first is ours
        return Path(state.split(":")[0]) / FILE_NAME
    xdg = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "direct-frontend" / FILE_NAME


def sql_store(config: ResponsesConfig, fleet_file: Path,
              environ: Mapping[str, str] = os.environ) -> SqlStore[Any]:
    """The backend's SQL store, not yet opened (``memory``: an in-memory database)."""
    if config.backend == "postgres":
        assert config.dsn is not None  # the loader checks it
        return PostgresStore(config.dsn, config.connections)
    if config.backend == "sqlite":
        return SqliteStore(sqlite_path(config, fleet_file, environ), config.connections)
    return SqliteStore(MEMORY)


async def open_durable(config: ResponsesConfig, fleet_file: Path,
                       environ: Mapping[str, str] = os.environ) -> Durable:
    """The store, its schema migrated (StoreError: the database cannot be used)."""
    sql = sql_store(config, fleet_file, environ)
    memory = config.backend == "memory"
    # in memory, conversations are bounded as responses are: by age and an owner's bytes
    durable = Durable(
        sql, ttl_s=config.ttl_s, lease_s=config.lease_s,
        conversation_ttl_s=config.conversation_ttl_s or (config.ttl_s if memory else None),
        max_bytes_per_owner=config.retain_bytes_per_owner or (
            config.max_bytes_per_owner or config.max_bytes if memory else None))
    was = await durable.open()
    if config.backend != "memory":
        where = (str(sqlite_path(config, fleet_file, environ)) if config.backend == "sqlite"
                 else "postgres")
        log.info("stored responses and conversations: %s (schema %s)", where,
                 f"migrated from version {was}" if was != SCHEMA_VERSION else "current")
    return durable


async def sweep_forever(durable: Durable, interval_s: float) -> None:
    """Retention, every ``interval_s``, in small transactions beside the requests."""
    while True:
        await trio.sleep(interval_s)
        try:
            dropped = await durable.sweep()
        except StoreError as exc:
            log.warning("retention pass failed (the next one tries again): %s", exc)
            continue
        if dropped:
            log.info("retention: %d stored objects left", dropped)


def check_reachable(config: ResponsesConfig, fleet_file: Path,
                    environ: Mapping[str, str] = os.environ) -> str:
    """For ``check``: reach the backend's database and read its schema version, changing
    nothing (blocking). What it found, in a phrase; StoreError when it cannot be used."""
    if config.backend == "memory":
        return "memory: kept by each process, lost when it exits"
    if config.backend == "sqlite":
        path = sqlite_path(config, fleet_file, environ)
        if not path.exists():
            parent = path.parent
            while not parent.exists():
                parent = parent.parent
            if not os.access(parent, os.W_OK | os.X_OK):
                raise StoreError(f"{path} cannot be created: {parent} is not writable")
            return f"sqlite at {path}: created at start"
        where = f"sqlite at {path}"
    else:
        where = f"postgres at {_postgres_place(config.dsn or '')}"
    sql = sql_store(config, fleet_file, environ)
    try:
        version = sql.schema_version()
    finally:
        sql.close()
    if version > SCHEMA_VERSION:
        raise StoreError(f"{where}: schema version {version} is newer than this program's "
                         f"{SCHEMA_VERSION}")
    state = ("current" if version == SCHEMA_VERSION
             else f"version {version}, migrated to {SCHEMA_VERSION} at start")
    return f"{where}: reached, schema {state}"


def _postgres_place(dsn: str) -> str:
    """Where a DSN points, without its credentials."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(dsn)
    except Exception:  # a DSN psycopg cannot read: the connection attempt says why
        return "the configured dsn"
    return f"host {parts.get('host', 'localhost')}, database {parts.get('dbname', '(default)')}"
