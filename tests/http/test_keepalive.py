"""The keep-alive shim (http/keepalive.py): the idle registry, the cap, and how it is gated.

On the wire, against the real daemon: tests/e2e/test_connections.py.
"""

from __future__ import annotations

import importlib.metadata
import socket
import time

import hypercorn.trio.run
import pytest
from hypercorn.trio.tcp_server import TCPServer

from direct_frontend.http import keepalive
from direct_frontend.observability.shims import ShimStatus, shims_active


class Timer:
    """A stand-in keep-alive timer: records that it was cancelled."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_over_the_cap_the_longest_idle_connections_are_closed() -> None:
    idle = keepalive.IdleConnections(cap=2)
    a, b, c, d = (Timer(n) for n in "abcd")
    idle.add(a)
    idle.add(b)
    assert len(idle) == 2 and not (a.cancelled or b.cancelled)
    idle.add(c)
    assert (a.cancelled, b.cancelled, c.cancelled) == (True, False, False)
    idle.discard(b)  # b's connection took a request
    idle.add(d)
    assert len(idle) == 2 and not (c.cancelled or d.cancelled)
    idle.add(b)  # b idle again: now the newest, so c is the oldest
    assert (b.cancelled, c.cancelled, d.cancelled) == (False, True, False)


def test_discarding_a_timer_twice_or_an_unknown_one_is_harmless() -> None:
    idle = keepalive.IdleConnections(cap=1)
    timer = Timer("a")
    idle.discard(timer)
    idle.add(timer)
    idle.discard(timer)
    idle.discard(timer)
    assert len(idle) == 0 and not timer.cancelled


def test_a_lowered_cap_applies_at_the_next_idle_connection() -> None:
    idle = keepalive.IdleConnections(cap=3)
    timers = [Timer(str(i)) for i in range(3)]
    for timer in timers:
        idle.add(timer)
    idle.cap = 1
    newest = Timer("new")
    idle.add(newest)
    assert [t.cancelled for t in timers] == [True, True, True]
    assert len(idle) == 1 and not newest.cancelled


@pytest.mark.parametrize(
    ("limit", "cap"), [(1024, 256), (20_000, 4096), (1_048_576, 4096), (2, 1)]
)
def test_the_idle_cap_is_a_share_of_the_descriptor_limit(limit: int, cap: int) -> None:
    assert keepalive.idle_cap(limit) == cap


checked = pytest.mark.skipif(
    importlib.metadata.version("hypercorn") not in keepalive.CHECKED,
    reason="the shim is off on this hypercorn release",
)


def _reported() -> ShimStatus:
    [status] = [s for s in shims_active() if s.shim == "hypercorn_keepalive"]
    return status


@pytest.fixture
def stock_hypercorn(monkeypatch: pytest.MonkeyPatch) -> None:
    """hypercorn as it comes, the shim not installed; put back as it was afterwards."""
    monkeypatch.setattr(hypercorn.trio.run, "TCPServer", TCPServer)
    monkeypatch.setattr(keepalive, "_judged", None)
    monkeypatch.setattr(keepalive.IDLE, "cap", keepalive.IDLE.cap)


@checked
@pytest.mark.usefixtures("stock_hypercorn")
def test_install_switches_hypercorn_and_is_idempotent() -> None:
    assert _reported() == ShimStatus("hypercorn_keepalive", False, "not installed")
    assert keepalive.install() and keepalive.install()
    assert hypercorn.trio.run.TCPServer is keepalive.PromptClosingTCPServer
    version = importlib.metadata.version("hypercorn")
    assert _reported() == ShimStatus("hypercorn_keepalive", True, f"hypercorn {version}")
    assert 1 <= keepalive.IDLE.cap <= keepalive.MAX_IDLE


@pytest.mark.usefixtures("stock_hypercorn")
def test_install_leaves_another_hypercorn_release_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keepalive, "CHECKED", ("0.0.0",))
    assert not keepalive.install()
    assert hypercorn.trio.run.TCPServer is TCPServer
    status = _reported()
    assert not status.active
    assert "not a release it was checked against (0.0.0)" in status.reason


@checked
@pytest.mark.usefixtures("stock_hypercorn")
def test_install_leaves_a_server_of_another_shape_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(TCPServer, "_idle_timeout")
    assert not keepalive.install()
    assert hypercorn.trio.run.TCPServer is TCPServer
    assert _reported().reason.endswith("TCPServer._idle_timeout is not a coroutine function")


@checked
@pytest.mark.usefixtures("stock_hypercorn")
def test_a_hypercorn_that_serves_with_another_class_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hypercorn.trio.run, "TCPServer", type("OtherServer", (), {}))
    assert not keepalive.install()
    assert _reported().reason.endswith("no longer serves with hypercorn.trio.tcp_server.TCPServer")


@checked
@pytest.mark.usefixtures("stock_hypercorn")
def test_the_report_says_when_the_shim_was_replaced_since() -> None:
    assert keepalive.install()
    hypercorn.trio.run.TCPServer = TCPServer  # type: ignore[attr-defined]
    status = _reported()
    assert not status.active and status.reason.endswith("replaced since it was installed")


def _connected_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    return client, ours


def _probe(ours: socket.socket) -> keepalive.Peer:
    ours.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    deadline = time.monotonic() + 5
    while (peer := keepalive.peer_after_probe(ours)) is keepalive.Peer.UNKNOWN:
        assert time.monotonic() < deadline, "the kernel never settled the probe"
        time.sleep(0.001)
    return peer


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="Linux TCP_INFO")
def test_a_probe_tells_a_half_closed_peer_from_a_gone_one() -> None:
    client, ours = _connected_pair()
    with client, ours:
        client.shutdown(socket.SHUT_WR)
        assert ours.recv(1) == b""  # the FIN
        assert _probe(ours) is keepalive.Peer.LISTENING
        assert client.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
    client, ours = _connected_pair()
    with ours:
        client.close()
        assert ours.recv(1) == b""
        assert _probe(ours) is keepalive.Peer.GONE
