"""Slow clients: a trickled request head or body is cut off and the connection closed."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    extra = "header_timeout_s = 0.5\nbody_timeout_s = 0.5"
    text = fleet_text(model_dir, [sim_engine("a")], frontend_extra=extra)
    with running_daemon(tmp_path_factory.mktemp("slow"), text) as d:
        d.wait_serving(1)
        yield d


def _closed_while_trickling(sock: socket.socket, data: bytes) -> tuple[bool, bytes, float]:
    """Send ``data`` a byte every 50 ms until the daemon closes; (closed, received, seconds)."""
    started = time.monotonic()
    received = b""
    sock.setblocking(False)
    for byte in data:
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return True, received, time.monotonic() - started
        time.sleep(0.05)
        try:
            while chunk := sock.recv(65536):
                received += chunk
            return True, received, time.monotonic() - started  # the daemon closed its side
        except BlockingIOError:
            pass
    return False, received, time.monotonic() - started


def _address(daemon: Daemon) -> tuple[str, int]:
    host, port = daemon.url.removeprefix("http://").split(":")
    return host, int(port)


def test_a_trickled_request_head_is_closed_after_header_timeout(daemon: Daemon) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: %s\r\n" % (b"y" * 300) + b"\r\n"
    with socket.create_connection(_address(daemon), timeout=10) as sock:
        closed, received, elapsed = _closed_while_trickling(sock, head)  # 16 s if never cut
    assert closed and received == b"", received
    assert elapsed < 5, elapsed


def test_a_trickled_body_gets_a_408_and_the_connection_closes(daemon: Daemon) -> None:
    body = json.dumps({"model": "demo", "prompt": "hello " * 40, "max_tokens": 2}).encode()
    with socket.create_connection(_address(daemon), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        closed, received, elapsed = _closed_while_trickling(sock, body)  # 15 s if never cut
    assert closed, received
    assert elapsed < 5, elapsed
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    assert b"x-request-id:" in head.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout" and "0.5 s" in error["message"]
