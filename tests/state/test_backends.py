"""Which database ``[frontend.responses]`` names, where it is, and ``check`` reaching it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from direct_frontend.fleet.describe import describe_fleet, to_jsonable
from direct_frontend.fleet.load import FleetError, parse_fleet
from direct_frontend.fleet.schema import ResponsesConfig
from direct_frontend.state.backends import check_reachable, sqlite_path
from direct_frontend.state.sql import SCHEMA_VERSION, StoreError
from direct_frontend.state.sqlite import SqliteStore
from tests.support.daemon import free_port
from tests.support.postgres import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
FLEET = Path("/etc/df/fleet.toml")
SQLITE = ResponsesConfig(backend="sqlite")


def test_the_sqlite_file_is_the_fleet_files_then_systemds_then_the_users() -> None:
    explicit = dataclasses.replace(SQLITE, path="state/r.db")
    assert sqlite_path(explicit, FLEET, {"STATE_DIRECTORY": "/x"}) == Path("/etc/df/state/r.db")
    assert sqlite_path(SQLITE, FLEET, {"STATE_DIRECTORY": "/var/lib/df:/other"}) == Path(
        "/var/lib/df/responses.db")
    assert sqlite_path(SQLITE, FLEET, {"XDG_STATE_HOME": "/home/u/st"}) == Path(
        "/home/u/st/direct-frontend/responses.db")
    assert sqlite_path(SQLITE, FLEET, {}) == (
        Path.home() / ".local" / "state" / "direct-frontend" / "responses.db")


@pytest.mark.parametrize(("keys", "field", "message"), [
    ('backend = "postgres"', "backend", "the postgres backend needs dsn"),
    ('backend = "redis"', "backend", "'redis' is not a valid store backend"),
    ('dsn = "postgresql://x"', "dsn", "dsn is for the postgres backend, not 'sqlite'"),
    ('backend = "postgres"\ndsn = "x"\npath = "a.db"', "path", "path is for the sqlite"),
    ('backend = "sqlite"\npath = "~/a.db"', "path", "'~' is not expanded"),
    ("connections = 0", "connections", ""),
])
def test_backend_settings_are_checked_with_line_and_field(keys: str, field: str,
                                                          message: str) -> None:
    text = (ROOT / "config" / "fleet.toml").read_text().replace(
        '[frontend.responses]\nbackend = "sqlite"\n', "[frontend.responses]\n" + keys + "\n")
    with pytest.raises(FleetError) as caught:
        parse_fleet(text, ROOT / "config" / "fleet.toml")
    line = str(caught.value).splitlines()[0]
    assert f"frontend.responses.{field}: " in line and message in line
    assert "fleet.toml:" in line  # with its line number


def test_check_reaches_sqlite_without_creating_it(tmp_path: Path) -> None:
    config = dataclasses.replace(SQLITE, path="state/r.db")
    fleet = tmp_path / "fleet.toml"
    assert check_reachable(config, fleet).endswith("created at start")
    assert not (tmp_path / "state").exists()
    SqliteStore(tmp_path / "state" / "r.db").migrate()
    assert check_reachable(config, fleet).endswith("reached, schema current")


def test_check_refuses_a_newer_schema_and_garbage(tmp_path: Path) -> None:
    config = dataclasses.replace(SQLITE, path="r.db")
    store = SqliteStore(tmp_path / "r.db")
    store.migrate()
    with store._tx() as conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    store.close()
    with pytest.raises(StoreError, match="newer"):
        check_reachable(config, tmp_path / "fleet.toml")
    (tmp_path / "r.db").write_bytes(b"garbage" * 1000)
    with pytest.raises(StoreError):
        check_reachable(config, tmp_path / "fleet.toml")


def test_check_reaches_postgres_and_says_when_it_cannot(postgres: PostgresServer) -> None:
    config = ResponsesConfig(backend="postgres", dsn=postgres.new_database())
    assert "reached, schema version 0" in check_reachable(config, FLEET)
    closed = ResponsesConfig(backend="postgres",
                             dsn=f"host=127.0.0.1 port={free_port()} user=x password=hunter2")
    with pytest.raises(StoreError):
        check_reachable(closed, FLEET)


def test_the_check_command_exits_2_when_the_store_cannot_be_reached(tmp_path: Path) -> None:
    text = (ROOT / "config" / "fleet.toml").read_text().replace(
        'backend = "sqlite"', f'backend = "postgres"\ndsn = "postgresql://u:hunter2@127.0.0.1:'
        f'{free_port()}/db?connect_timeout=2"').replace(
        'tokenizer = "demo-model"', f'tokenizer = "{ROOT / "config" / "demo-model"}"')
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(text)
    checked = subprocess.run([sys.executable, "-m", "direct_frontend.cli", "check", str(fleet)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 2
    assert "frontend.responses: the postgres store cannot be used" in checked.stderr
    assert "hunter2" not in checked.stderr + checked.stdout


def test_the_dsn_is_never_shown(tmp_path: Path) -> None:
    text = (ROOT / "config" / "fleet.toml").read_text().replace(
        'backend = "sqlite"', 'backend = "postgres"\ndsn = "postgresql://u:hunter2@db/x"')
    config = parse_fleet(text, ROOT / "config" / "fleet.toml")
    shown = json.dumps(to_jsonable(config)) + describe_fleet(config) + repr(config)
    assert "hunter2" not in shown and "<redacted>" in shown


def test_a_daemon_whose_store_cannot_be_reached_says_so_and_exits_1(tmp_path: Path) -> None:
    text = (ROOT / "config" / "fleet.toml").read_text().replace(
        'backend = "sqlite"', f'backend = "postgres"\ndsn = "postgresql://u:hunter2@127.0.0.1:'
        f'{free_port()}/db?connect_timeout=2"').replace(
        'tokenizer = "demo-model"', f'tokenizer = "{ROOT / "config" / "demo-model"}"').replace(
        "127.0.0.1:8000", f"127.0.0.1:{free_port()}")
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(text)
    ran = subprocess.run([sys.executable, "-m", "direct_frontend.cli", "run", str(fleet),
                          "--no-watch"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1
    assert "cannot start: [frontend.responses] store: connection failed" in ran.stderr
    assert "hunter2" not in ran.stderr + ran.stdout
