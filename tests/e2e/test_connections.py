"""Connections: closed on our side as soon as the client closes them, idle ones capped.

A client that opens a connection per request and closes it after the
response (http.client does) used to leave the daemon's side in CLOSE_WAIT for
the whole keep-alive timeout, until ``accept`` failed with EMFILE. The
daemon runs in this process, so its descriptors are this process's.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from direct_frontend.http import keepalive
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine, wait_for
from tests.support.metrics import sample

# 2 ms a token: generations are quick, and a long one stays in flight for seconds.
ENGINE = {"decode_us_per_token": 2000, "prefill_us_per_token": 0, "eos_probability": 0.0}
#: more than systemd's default soft limit of descriptors (1024), which leaked ones exhausted
CONNECTIONS = 1100
COMPLETION = json.dumps({"model": "demo", "prompt": "Once upon", "max_tokens": 3}).encode()
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd"
)


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("a", **ENGINE)])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Start as systemd starts a unit without LimitNOFILE=: the daemon raises it to the hard limit.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        with running_daemon(tmp_path_factory.mktemp("connections"), text) as d:
            d.wait_serving(1)
            yield d
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _address(daemon: Daemon) -> tuple[str, int]:
    host, port = daemon.url.removeprefix("http://").split(":")
    return host, int(port)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # not the listing's own handle


def _back_to(baseline: int, within_s: float = 1.0) -> float:
    """Poll until no more descriptors are open than at ``baseline``; how long that took."""
    start = time.monotonic()
    while (now := _open_fds()) > baseline:
        if time.monotonic() - start > within_s:
            raise AssertionError(f"{now - baseline} descriptors still open after {within_s} s")
        time.sleep(0.005)
    return time.monotonic() - start


def _baseline(warm_up: Callable[[], object]) -> int:
    """Descriptors open once one connection has come and gone (any lazy set-up done)."""
    before = _open_fds()
    warm_up()
    with contextlib.suppress(AssertionError):
        _back_to(before)
    return _open_fds()


def test_http_client_connections_are_closed_at_once(daemon: Daemon) -> None:
    host, port = _address(daemon)

    def one(i: int) -> int:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            if i % 50 == 0:  # a generation now and then, not only /health
                conn.request("POST", "/v1/completions", COMPLETION,
                             {"Content-Type": "application/json"})
            else:
                conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    baseline = _baseline(lambda: one(0))
    statuses = Counter(one(i) for i in range(CONNECTIONS))
    assert statuses == {200: CONNECTIONS}
    _back_to(baseline)


def _full_exchange(sock: socket.socket) -> None:
    sock.sendall(GET_HEALTH)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")


def _connect_only(sock: socket.socket) -> None:
    pass


def _request_then_vanish(sock: socket.socket) -> None:
    sock.sendall(GET_HEALTH)


def _half_close(sock: socket.socket) -> None:
    sock.sendall(GET_HEALTH)
    sock.shutdown(socket.SHUT_WR)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")


def test_raw_socket_connections_are_closed_at_once(daemon: Daemon) -> None:
    address = _address(daemon)
    patterns = [_full_exchange, _connect_only, _request_then_vanish, _half_close]

    def one(pattern: Callable[[socket.socket], None]) -> None:
        with socket.create_connection(address, timeout=10) as sock:
            pattern(sock)

    baseline = _baseline(lambda: one(_full_exchange))
    for i in range(CONNECTIONS):
        one(patterns[i % len(patterns)])
    _back_to(baseline)


def _closed_by_peer(sock: socket.socket) -> bool:
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:  # open, nothing to read
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(timeout)


def test_idle_connections_over_the_cap_are_closed_busy_ones_never(daemon: Daemon) -> None:
    # Which idle ones go (the longest idle) is tests/http/test_keepalive.py's; here, how many.
    address = _address(daemon)
    cap = daemon.run_sync(lambda: keepalive.IDLE.cap)
    daemon.run_sync(setattr, keepalive.IDLE, "cap", 8)
    busy = socket.create_connection(address, timeout=10)
    idle: list[socket.socket] = []
    try:
        # A streaming request in flight (4 s): its connection is busy, never closed for the cap.
        body = json.dumps({"model": "demo", "prompt": "x", "max_tokens": 2000, "stream": True})
        busy.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
        )
        received = busy.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
        for _ in range(20):
            idle.append(socket.create_connection(address, timeout=10))
        wait_for(lambda: sum(map(_closed_by_peer, idle)) == 12, 5, "12 idle connections closed")
        assert daemon.run_sync(len, keepalive.IDLE) == 8
        still_open = [sock for sock in idle if not _closed_by_peer(sock)]
        assert len(still_open) == 8
        for sock in still_open:
            _full_exchange(sock)
        assert b"data: " in busy.recv(65536)  # the stream goes on
    finally:
        daemon.run_sync(setattr, keepalive.IDLE, "cap", cap)
        busy.close()
        for sock in idle:
            sock.close()


def test_the_descriptor_limit_was_raised_and_both_are_metrics(daemon: Daemon) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard
    host, port = _address(daemon)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    during = _open_fds()  # the scrape's two ends are still open, as during the scrape
    conn.close()
    assert abs(sample(text, "direct_frontend_open_fds") - during) <= 2
    assert sample(text, "direct_frontend_max_fds") == hard


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
    )


def _read_to_eof(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_after_its_request_gets_the_answer(
    daemon: Daemon, stream: bool
) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40, "stream": stream}
    with socket.create_connection(_address(daemon), timeout=10) as sock:
        sock.sendall(_post("/v1/chat/completions", body))
        sock.shutdown(socket.SHUT_WR)
        received = _read_to_eof(sock)  # the daemon closes the connection after the answer
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    if not stream:  # the FIN always comes before the whole body is ready
        assert received.startswith(interim)
    # A stream may have started before the FIN was read: an SSE comment probes then.
    head, _, payload = received.removeprefix(interim).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    if stream:
        assert b"data: [DONE]" in payload
        assert b'"finish_reason":"length"' in payload
    else:
        assert b'"completion_tokens":40' in payload


def test_a_client_that_hangs_up_before_the_answer_still_aborts_the_engine(
    daemon: Daemon,
) -> None:
    engine = daemon.supervisor.simulators["a"]
    aborted = engine.stats.aborts_received
    body = {"model": "demo", "prompt": "x", "max_tokens": 2000}  # 4 s, not streamed
    with socket.create_connection(_address(daemon), timeout=10) as sock:
        sock.sendall(_post("/v1/completions", body))
        wait_for(lambda: engine.stats.running == 1, what="the engine to run the request")
    wait_for(lambda: engine.stats.aborts_received == aborted + 1, what="the engine's Abort")
    wait_for(lambda: engine.stats.running == 0, what="the engine slot to be freed")


def test_a_client_that_half_closes_while_its_stream_runs_reads_it_to_the_end(
    daemon: Daemon,
) -> None:
    body = {"model": "demo", "prompt": "x", "max_tokens": 500, "stream": True}  # 1 s
    with socket.create_connection(_address(daemon), timeout=10) as sock:
        sock.sendall(_post("/v1/completions", body))
        received = b""
        while b"data: " not in received:
            received += sock.recv(65536)
        sock.shutdown(socket.SHUT_WR)
        received += _read_to_eof(sock)
    assert received.startswith(b"HTTP/1.1 200")
    assert b"\r\n:\n\n\r\n" in received  # the probe: an SSE comment in a chunk of its own
    assert b'"finish_reason":"length"' in received and b"data: [DONE]" in received
