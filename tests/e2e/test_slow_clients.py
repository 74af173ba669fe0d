"""Slow clients: a trickled request body is cut off with a 408 and the connection closed."""

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
    text = fleet_text(model_dir, [sim_engine("a")], frontend_extra="body_timeout_s = 0.5")
    with running_daemon(tmp_path_factory.mktemp("slow"), text) as d:
        d.wait_serving(1)
        yield d


def test_a_trickled_body_gets_a_408_and_the_connection_closes(daemon: Daemon) -> None:
    host, port = daemon.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "demo", "prompt": "hello", "max_tokens": 2}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        started = time.monotonic()
        received = b""
        sock.setblocking(False)
        closed = False
        for byte in body:  # one byte every 50 ms: the whole body would take > 2 s
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.05)
            try:
                while chunk := sock.recv(65536):
                    received += chunk
                closed = True  # the daemon closed its side
                break
            except BlockingIOError:
                pass
        elapsed = time.monotonic() - started
    assert closed, received
    assert elapsed < 0.5 + 1.5, elapsed
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    assert b"x-request-id:" in head.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout" and "0.5 s" in error["message"]
