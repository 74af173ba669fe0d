"""``run --workers``: the parent's and the worker's plain parts (sans-IO where they can be)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from direct_frontend.control.private_nats import log_line
from direct_frontend.control.workers import (
    WorkerRole,
    reserve_port,
    resolve_count,
    worker_replicas,
)
from direct_frontend.fleet.load import FleetError, parse_fleet
from direct_frontend.fleet.schema import ReplicasConfig

FRONTEND = ('[frontend]\nserved_model_name = "x"\ntokenizer = "t"\nallow_empty_fleet = true\n')


def test_a_role_travels_through_the_environment() -> None:
    role = WorkerRole(1, 4, "127.0.0.1", 8123, "nats://127.0.0.1:4222", Path("/tmp/w"), 77)
    assert WorkerRole.from_env(role.env()) == role
    assert WorkerRole.from_env({}) is None
    assert role.ready_file == Path("/tmp/w/ready-1")


def test_auto_is_one_worker_per_core() -> None:
    assert resolve_count(3) == 3
    assert resolve_count(0) == (os.cpu_count() or 1)


def test_the_parents_nats_only_when_the_file_names_none() -> None:
    role = WorkerRole(0, 2, "127.0.0.1", 1, "nats://127.0.0.1:9", Path("/tmp/w"),
                      cluster="direct-frontend.workers-0a1b")
    assert WorkerRole.from_env(role.env()) == role
    private = worker_replicas(ReplicasConfig(peer_timeout_s=7.0), role)
    assert private.nats == "nats://127.0.0.1:9" and private.peer_timeout_s == 7.0
    # the parent's token (a file in its private directory), its namespace, no open server
    assert private.token_file == "/tmp/w/nats-token" and not private.insecure
    assert private.cluster == "direct-frontend.workers-0a1b"
    own = ReplicasConfig(nats="nats://elsewhere:4222")
    assert worker_replicas(own, role) is own


def test_nats_server_lines_become_records_at_their_level(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, "direct_frontend.nats"):
        log_line(b"[42] 2026/12/04 23:41:48.822 [ERR] 127.0.0.1:5 - cid:10 - auth error\r")
        log_line(b"[42] 2026/12/04 23:41:48.822 [WRN] slow consumer")
        log_line(b"not in its format")
        log_line(b"")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("direct_frontend.nats", logging.ERROR, "nats-server: 127.0.0.1:5 - cid:10 - auth error"),
        ("direct_frontend.nats", logging.WARNING, "nats-server: slow consumer"),
        ("direct_frontend.nats", logging.INFO, "nats-server: not in its format"),
    ]


def test_workers_in_the_fleet_file() -> None:
    assert parse_fleet(FRONTEND, Path("f")).frontend.workers == 1
    assert parse_fleet(FRONTEND + "workers = 3\n", Path("f")).frontend.workers == 3
    assert parse_fleet(FRONTEND + 'workers = "auto"\n', Path("f")).frontend.workers == 0
    for bad in ("workers = 0", 'workers = "many"'):
        with pytest.raises(FleetError, match=r"frontend\.workers"):
            parse_fleet(FRONTEND + bad + "\n", Path("f"))


def test_a_reserved_port_can_be_bound_again_by_each_worker() -> None:
    with reserve_port("127.0.0.1", 0) as reserved:
        port = reserved.getsockname()[1]
        workers = []
        for _ in range(2):  # what hypercorn does with config.workers > 1
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            workers.append(sock)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        for sock in workers:
            sock.close()
