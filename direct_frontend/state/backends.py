"""The durable store ``[frontend.responses] backend`` names, opened and migrated.

``sqlite``'s file is ``path`` (relative to the fleet file) when set, else
``responses.db`` in the state directory the service manager gave the daemon
(systemd's ``StateDirectory=`` sets ``$STATE_DIRECTORY``), else in the
user's state directory (``$XDG_STATE_HOME/direct-frontend``, by default
``~/.local/state/direct-frontend``), so the quick start keeps its responses
across restarts with nothing to set. ``memory`` keeps responses in the
process's own store (openai/response_store.py); its conversations live in a
private in-memory SQLite database, so both APIs have one implementation.
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
    durable = Durable(sql, ttl_s=config.ttl_s, lease_s=config.lease_s,
                      conversation_ttl_s=config.conversation_ttl_s,
                      max_bytes_per_owner=config.retain_bytes_per_owner)
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
    """For ``check``: open the backend's database and read its schema version (blocking).

    What it found, in a phrase; raises StoreError when it cannot be used.
    """
    if config.backend == "memory":
        return "memory: nothing to reach"
    sql = sql_store(config, fleet_file, environ)
    try:
        was = sql.migrate()
    finally:
        sql.close()
    where = (str(sqlite_path(config, fleet_file, environ)) if config.backend == "sqlite"
             else "postgres")
    return f"{config.backend} at {where}: reached, schema version {was or 'new'}"
