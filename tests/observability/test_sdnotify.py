"""systemd notify protocol: our Notifier, and the real daemon talking to a NOTIFY_SOCKET we bind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from direct_frontend.observability.sdnotify import Notifier, monotonic_usec
from tests.support.daemon import PROCESS_S, fleet_text, free_port, sim_engine, wait_for
from tests.support.http import http

DAEMON = str(Path(sys.executable).with_name("direct-frontend"))


@contextlib.contextmanager
def notify_socket(address: str) -> Iterator[socket.socket]:
    """A unix datagram socket bound at ``address`` (``\\0...`` is the abstract namespace)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with sock:
        sock.bind(address)
        sock.settimeout(PROCESS_S)  # the first message comes once the daemon serves
        yield sock


def receive(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


def test_notifier_sends_to_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with notify_socket(path) as sock:
        notifier = Notifier({"NOTIFY_SOCKET": path})
        assert notifier.ready("2/2 engines serving")
        assert receive(sock) == {"READY": "1", "STATUS": "2/2 engines serving"}
        before = monotonic_usec()
        assert notifier.reloading()
        message = receive(sock)
        assert message["RELOADING"] == "1"
        assert before <= int(message["MONOTONIC_USEC"]) <= monotonic_usec()
        notifier.close()


def test_notifier_supports_the_abstract_namespace() -> None:
    name = f"direct-frontend-test-{os.getpid()}-{time.monotonic_ns()}"
    with notify_socket("\0" + name) as sock:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.watchdog()
        assert receive(sock) == {"WATCHDOG": "1"}
        notifier.close()


def test_notifier_is_quiet_without_systemd_and_never_raises(tmp_path: Path) -> None:
    assert not Notifier({}).enabled
    assert Notifier({}).ready("x") is False
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert gone.enabled and gone.stopping() is False and gone.stopping() is False
    gone.close()


def test_watchdog_interval_comes_from_the_environment() -> None:
    assert Notifier({"WATCHDOG_USEC": "3000000"}).watchdog_s == 3.0
    mine = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_s == 3.0
    assert Notifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_s is None


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_the_daemon_notifies_ready_watchdog_reloading_and_stopping(
    model_dir: Path, tmp_path: Path, abstract: bool,
) -> None:
    port = free_port()
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(fleet_text(model_dir, [sim_engine("a")]).replace(
        'listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"'))
    name = f"df-notify-{os.getpid()}-{time.monotonic_ns()}"
    address, env_value = ("\0" + name, "@" + name) if abstract else (
        str(tmp_path / "notify"), str(tmp_path / "notify"))
    env = {**os.environ, "NOTIFY_SOCKET": env_value, "WATCHDOG_USEC": "300000"}
    with notify_socket(address) as sock:
        proc = subprocess.Popen([DAEMON, "run", str(fleet), "--no-watch"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            first = receive(sock)
            assert first["READY"] == "1" and "engines serving" in first["STATUS"]
            # READY means the listener is up: a request right now is answered.
            assert http.get(f"http://127.0.0.1:{port}/health").status_code == 200
            seen = [first]

            def pinged_and_serving() -> bool:
                seen.append(receive(sock))
                return sum("WATCHDOG" in m for m in seen) >= 2 and any(
                    m.get("STATUS", "").startswith("1/1 engines serving") for m in seen)

            wait_for(pinged_and_serving, PROCESS_S,
                     "watchdog pings and the engine serving in STATUS")
            proc.send_signal(signal.SIGHUP)
            messages = _until(sock, "READY")
            reloading = next(m for m in messages if "RELOADING" in m)
            assert abs(int(reloading["MONOTONIC_USEC"]) - monotonic_usec()) < 10_000_000
            assert messages[-1]["READY"] == "1"
            proc.send_signal(signal.SIGTERM)
            messages = _until(sock, "STOPPING")
            assert messages[-1] == {"STOPPING": "1", "STATUS": "stopping"}
            assert proc.wait(PROCESS_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            stderr = proc.stderr.read().decode()
            proc.stderr.close()
    assert "Traceback" not in stderr, stderr


def _until(sock: socket.socket, key: str) -> list[dict[str, str]]:
    """Messages up to and including the first carrying ``key`` (watchdog pings skipped)."""
    out: list[dict[str, str]] = []
    while True:
        message = receive(sock)
        if message == {"WATCHDOG": "1"}:
            continue
        out.append(message)
        if key in message:
            return out
