"""``run --workers N``: N processes on one port, one service (real processes, real sockets).

The engines are simulated in-process by a first daemon (the test's); the
worker service reaches them over gRPC like any other replica would.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_replicas import FAST, MEMORY_STORE, SLOW, fleet_for
from tests.support.daemon import Daemon, fleet_text, free_port, sim_engine, wait_for
from tests.support.http import http
from tests.support.nats import nats_binary

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="needs nats-server")

def children(pid: int) -> set[int]:
    """The parent's child processes (its workers and its nats-server), from every thread."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found |= {int(p) for p in (task / "children").read_text().split()}
    return found


def cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def workers_of(parent: int) -> set[int]:
    return {child for child in children(parent) if b"direct_frontend.cli" in cmdline(child)}


def nats_of(parent: int) -> set[int]:
    """The parent's own nats-server (a set: none while it restarts)."""
    return {child for child in children(parent)
            if cmdline(child) and cmdline(child)[0].endswith(b"nats-server")}


def gone(pid: int) -> bool:
    """``pid`` has exited (a zombie counts: it runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def fresh_get(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """A request on a connection of its own (the kernel picks a worker per connection)."""
    return http.get(url, headers=headers)


def serving(base: str) -> int:
    """How many workers answer ``/fleet`` (0 while a connection is refused or reset)."""
    try:
        return len(seen_workers(base, 12))
    except httpx.HTTPError:
        return 0


def seen_workers(base: str, tries: int = 60) -> dict[str, dict[str, Any]]:
    """``/fleet`` as each worker answers it, by the worker's replica id."""
    out: dict[str, dict[str, Any]] = {}
    for _ in range(tries):
        view = fresh_get(base + "/fleet").json()
        out[view["replicas"]["replica"].split("-")[0]] = view
    return out


@contextlib.contextmanager
def worker_service(
    tmp_path: Path, model_dir: Path, count: int, timing: dict[str, Any] = FAST,
    *options: str,
    frontend_extra: str = "",
) -> Iterator[tuple[str, Any, Path]]:
    engines = [sim_engine(f"e{i}", "sglang", **timing) for i in range(2)]
    embedded = tmp_path / "engines.toml"
    embedded.write_text(fleet_for(model_dir, engines, None, embeds=True))
    daemon = Daemon(embedded).start()
    port = free_port()
    path = tmp_path / "fleet.toml"
    text = fleet_for(model_dir, engines, None, embeds=False, frontend_extra=frontend_extra)
    path.write_text(text.replace('listen = "127.0.0.1:0"',
                                 f'listen = "127.0.0.1:{port}"\nworkers = {count}'))
    log = (tmp_path / "workers.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parent = subprocess.Popen([sys.executable, "-m", "direct_frontend.cli", "run", str(path),
                               "--log-level", "INFO", *options], stdout=log, stderr=log,
                              env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        daemon.wait_serving(2)

        wait_for(lambda: serving(base) == count, timeout=60, what=f"{count} workers serving")
        yield base, parent, path
    finally:
        parent.send_signal(signal.SIGTERM)
        try:
            parent.wait(30)
        finally:
            parent.kill()
            log.close()
            daemon.stop()


Service = tuple[str, Any, Path]  # its base URL, the parent process, its fleet file


@pytest.fixture(scope="module")
def service(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """Two workers (JSON logs, each its own store) for the tests that leave them as they
    found them: two workers serving, linked over their nats-server."""
    with worker_service(tmp_path_factory.mktemp("workers"), model_dir, 2, FAST, "--log-json",
                        frontend_extra=MEMORY_STORE) as started:
        yield started


def metric(text: str, name: str, worker: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'worker="{worker}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_workers_serve_one_port_and_one_scrape_counts_both(service: Service) -> None:
    base, _parent, _path = service
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    for _ in range(30):
        r = http.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text

    scraped: list[str] = []

    def all_counted() -> bool:
        # a sibling's figures are as of its last write (each second): wait for that one
        scraped.append(fresh_get(base + "/metrics").text)
        counts = [metric(scraped[-1], "direct_frontend_requests_total", w) for w in "01"]
        return all(counts) and sum(counts) >= 30  # every request, and the scrapes

    wait_for(all_counted, timeout=10, what="both workers' requests in one scrape")
    assert scraped[-1].count("# TYPE direct_frontend_requests_total counter") == 1

    # a stored response is found whichever worker a follow-up's connection reaches
    ask = {"model": "demo", "max_output_tokens": 2}
    made = http.post(base + "/v1/responses", json={**ask, "input": "hi"}).json()
    for _ in range(12):
        r = http.post(base + "/v1/responses", json={
            **ask, "input": "more", "previous_response_id": made["id"], "store": False})
        assert r.status_code == 200, r.text
    views = seen_workers(base, 16).values()
    assert sum(v["replicas"]["counts"]["responses_served"] for v in views) > 0


def test_a_killed_worker_is_started_again(service: Service) -> None:
    base, parent, _path = service
    before = workers_of(parent.pid)
    assert len(before) == 2
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(workers_of(parent.pid) - before) == 1, timeout=30,
             what="a new worker process")
    assert parent.poll() is None
    wait_for(lambda: serving(base) == 2, timeout=60, what="both serving again")


def test_a_fleet_file_edit_reaches_every_worker(model_dir: Path, tmp_path: Path) -> None:
    with worker_service(tmp_path, model_dir, 2) as (base, _parent, path):
        path.write_text(path.read_text().replace("workers = 2",
                                                 "workers = 2\nmax_tokens_default = 77", 1))

        def everywhere() -> bool:
            views = seen_workers(base, 16)
            return len(views) == 2 and all(
                v["fleet"]["frontend"]["max_tokens_default"] == 77 for v in views.values())

        wait_for(everywhere, timeout=30, what="the edit on both workers")


def test_workers_of_a_parent_killed_hard_stop_by_themselves(
    model_dir: Path, tmp_path: Path
) -> None:
    with worker_service(tmp_path, model_dir, 2) as (_base, parent, _path):
        workers = workers_of(parent.pid)
        (nats,) = nats_of(parent.pid)
        argv = cmdline(nats)
        private = Path(argv[argv.index(b"-c") + 1].decode()).parent  # a hard kill leaves it
        parent.kill()
        parent.wait(10)
        try:
            # the kernel kills the nats-server with its parent (no one else would)
            wait_for(lambda: gone(nats), timeout=5, what="the parent's nats-server to die")
            wait_for(lambda: all(gone(pid) for pid in workers), timeout=30,
                     what="the orphaned workers to stop")
        finally:
            for pid in (nats, *workers):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(private, ignore_errors=True)


def _sharing(base: str) -> bool:
    """Every worker is linked to its sibling."""
    views = seen_workers(base, 12)
    return len(views) == 2 and all(
        v["replicas"]["connected"] and len(v["replicas"]["peers"]) == 1 for v in views.values())


def _anonymous_answer(port: int) -> bytes:
    """What the server says to a client without the token (raw protocol)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b'CONNECT {"verbose":false}\r\nSUB > 1\r\nPING\r\n')
        said = b""
        while data := sock.recv(4096):  # until the server hangs up
            said += data
    return said


def test_the_workers_nats_server_is_private_restarted_when_killed_and_logged_as_ours(
    service: Service,
) -> None:
    base, parent, path = service
    wait_for(lambda: _sharing(base), timeout=30, what="the workers linked")
    (nats,) = nats_of(parent.pid)
    argv = cmdline(nats)
    config = Path(argv[argv.index(b"-c") + 1].decode())
    token_file = config.with_name("nats-token")
    token = token_file.read_text().strip()
    for private in (config, token_file):
        assert private.stat().st_mode & 0o077 == 0, private  # its owner's only
    assert token.encode() not in b" ".join(argv)  # ps shows no secret
    view = fresh_get(base + "/fleet").json()["replicas"]
    port = int(view["nats"].rsplit(":", 1)[1])
    assert view["cluster"].startswith("direct-frontend.workers-")
    assert b"-ERR 'Authorization Violation'" in _anonymous_answer(port)

    os.kill(nats, signal.SIGKILL)
    wait_for(lambda: len(nats_of(parent.pid) - {nats}) == 1, timeout=15,
             what="a new nats-server")
    wait_for(lambda: _sharing(base), timeout=30, what="the workers linked again")
    assert parent.poll() is None

    lines = (path.parent / "workers.log").read_text().splitlines()  # so far: written at once
    assert token not in "\n".join(lines)
    # nats-server's own lines ("[pid] date time [INF] ...") reach the log only as our records
    assert not [line for line in lines if re.match(r"\[\d+\] ", line)]
    said = [record for line in lines if line.startswith("{")
            if (record := json.loads(line)).get("logger") == "direct_frontend.nats"]
    assert any("Server is ready" in r["msg"] for r in said), said[:5]


def test_a_dying_workers_stream_ends_in_a_closed_connection_and_the_others_serve_on(
    model_dir: Path, tmp_path: Path
) -> None:
    with worker_service(tmp_path, model_dir, 2, SLOW) as (base, _parent, _path):
        body = {"model": "demo", "prompt": "hi", "max_tokens": 400, "stream": True}
        with httpx.Client(timeout=10) as client:
            # one keep-alive connection: the worker that answers /fleet runs the stream too
            replica = client.get(base + "/fleet").json()["replicas"]["replica"]
            pid = int(replica.split("-")[1])
            with client.stream("POST", base + "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                os.kill(pid, signal.SIGKILL)
                with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                    for _ in lines:
                        pass
        # its listening socket is gone with it (a connection queued there before is reset), and
        # its successor serves (a connection made while it starts can be reset too)
        wait_for(lambda: gone(pid), what="the killed worker to be gone")
        wait_for(lambda: serving(base) == 2, timeout=60, what="both serving")
        r = http.post(base + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_workers_of_a_fleet_with_simulated_engines_all_serve_and_log_pure_json(
    model_dir: Path, tmp_path: Path
) -> None:
    """The first worker embeds the simulated engines, the others reach them (each starting
    its own on the same port crash-looped all but one); --log-json stays one object a line."""
    port = free_port()
    path = tmp_path / "fleet.toml"
    text = fleet_text(model_dir, [sim_engine("a", **FAST), sim_engine("b", **FAST)])
    path.write_text(text.replace('listen = "127.0.0.1:0"',
                                 f'listen = "127.0.0.1:{port}"\nworkers = 2'))
    log_path = tmp_path / "workers.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with log_path.open("wb") as log:
        parent = subprocess.Popen([sys.executable, "-m", "direct_frontend.cli", "run",
                                   str(path), "--log-json"], stdout=log, stderr=log, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            def both_serving() -> bool:
                try:
                    views = seen_workers(base, 12)
                except httpx.HTTPError:
                    return False
                return len(views) == 2 and all(
                    sum(e["state"] == "serving" for e in v["engines"]) == 2
                    for v in views.values())

            wait_for(both_serving, timeout=60, what="both workers serving both engines")
            for _ in range(8):
                answer = http.post(base + "/v1/completions",
                                   json={"model": "demo", "prompt": "hi", "max_tokens": 2})
                assert answer.status_code == 200, answer.text
            assert len(workers_of(parent.pid)) == 2
        finally:
            parent.send_signal(signal.SIGTERM)
            parent.wait(30)
    lines = log_path.read_text().splitlines()
    assert lines and "Address already in use" not in log_path.read_text()
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert {entry.get("worker") for entry in entries} >= {0, 1}  # each says which worker
