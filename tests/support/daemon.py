"""Run the real daemon in-process (its own thread and Trio loop) for end-to-end tests.

Tests talk to it over real loopback sockets (HTTP and gRPC); the thread only
lets them look inside (engine states, the simulators' counters).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio
import trio_asyncio  # noqa: F401  (before grpclib)

from direct_frontend.daemon import serve_fleet
from direct_frontend.fleet.load import load_fleet
from direct_frontend.http.app import App

_handed_out: set[int] = set()


def _reserve(port: int = 0) -> int | None:
    """``port`` (0: one the kernel picks) left in TIME_WAIT, or None if something holds it.

    A port in TIME_WAIT is one the kernel hands to no ``bind`` to port 0 and no
    outgoing connection of any process for a minute, while a server that binds
    it by number with ``SO_REUSEADDR`` (asyncio, Trio, hypercorn, grpclib,
    ZeroMQ, nats-server and PostgreSQL all set it) gets it: so parallel test
    processes (pytest-xdist's workers, another checkout's run) never get one
    another's ports, with nothing shared between them. The connection this
    makes and closes from the listening side is what leaves it in TIME_WAIT.
    """
    if port:  # asked by number: free of everything, TIME_WAIT included (no SO_REUSEADDR)
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError:
            return None
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
        except OSError:
            return None
        listener.listen(1)
        port = int(listener.getsockname()[1])
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # closed first, so the TIME_WAIT is on this port's side
    return port


def free_port() -> int:
    """A loopback port nothing listens on, never one this process was given before and none
    another process gets from the kernel for a minute (:func:`_reserve`).

    The kernel may hand the same ephemeral port to two binds in a row once the
    first is closed, so two engines of one fleet could otherwise share a port.
    """
    while True:
        port = _reserve()
        if port is not None and port not in _handed_out:
            _handed_out.add(port)
            return port


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (a data-parallel engine's ranks)."""
    while True:
        base = free_port()
        ports = range(base + 1, base + count)
        if any(port in _handed_out for port in ports):
            continue
        if all(_reserve(port) == port for port in ports):
            _handed_out.update(ports)
            return base


#: how long a daemon process (``direct-frontend run``) may take to serve, or to end once told:
#: a bound that only ends a broken run, wide because on a loaded 2-core machine the
#: process's imports alone have taken over 20 s
PROCESS_S = 60.0


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll until ``predicate`` holds; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def fleet_text(
    model_dir: Path,
    engines: list[dict[str, Any]],
    *,
    frontend_extra: str = "",
    probe: str = "interval_s = 0.2\ntimeout_s = 1.0",
) -> str:
    """A fleet file listening on a free port, with the given [[engine]] tables."""
    parts = [
        textwrap.dedent(f"""\
        [frontend]
        listen = "127.0.0.1:0"
        served_model_name = "demo"
        tokenizer = "{model_dir}"
        {frontend_extra}

        [frontend.probe]
        {probe}
        """)
    ]
    for engine in engines:
        simulator = engine.pop("simulator", None)
        lines = ["[[engine]]"]
        for key, value in engine.items():
            lines.append(f"{key} = {_toml(value)}")
        if simulator:
            lines.append("[engine.simulator]")
            lines.extend(f"{k} = {_toml(v)}" for k, v in simulator.items())
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def kv_fleet_text(model_dir: Path, engines: list[dict[str, Any]], **options: Any) -> str:
    """:func:`fleet_text` routing ``kv_aware`` on 16-token blocks.

    An engine's ``kv_events`` / ``kv_replay`` may be given as one endpoint string.
    """
    text = fleet_text(model_dir, engines, **options)
    text = text.replace("[frontend.probe]",
                        '[frontend.routing]\npolicy = "kv_aware"\n\n'
                        "[frontend.routing.knobs]\nblock_size = 16\n\n[frontend.probe]")
    # kv_events / kv_replay are arrays in the fleet file
    return re.sub(r'^(kv_events|kv_replay) = "([^"]+)"$', r'\1 = ["\2"]', text, flags=re.M)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def sim_engine(name: str, kind: str = "sglang", **simulator: Any) -> dict[str, Any]:
    """An [[engine]] table for a simulated engine on a free port."""
    table: dict[str, Any] = {
        "name": name,
        "url": f"grpc://127.0.0.1:{free_port()}",
        "kind": kind,
        "simulate": True,
    }
    if simulator:
        table["simulator"] = simulator
    return table


class Daemon:
    """The daemon on a background thread; ``url`` is its HTTP base URL."""

    def __init__(self, fleet_path: Path, **options: Any) -> None:
        self.fleet = load_fleet(fleet_path)
        self.options = options  # more serve_fleet keyword arguments
        self.app: App | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.shutdown: trio.Event | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="daemon", daemon=True)

    def _main(self) -> None:
        async def main() -> None:
            self.token = trio.lowlevel.current_trio_token()
            self.shutdown = trio.Event()
            async with trio.open_nursery() as nursery:
                self.app = await nursery.start(
                    lambda task_status: serve_fleet(
                        self.fleet, shutdown=self.shutdown, handle_signals=False,
                        task_status=task_status, **self.options,
                    )
                )
                self._ready.set()

        try:
            trio.run(main)
        except BaseException as exc:  # reported to the test by stop()
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> Daemon:
        self._thread.start()
        ready = self._ready.wait(60)
        if self.error is not None:
            raise self.error
        assert ready, "the daemon did not start within 60 s"
        return self

    @property
    def url(self) -> str:
        assert self.app is not None
        return self.app.bound_urls[0]

    @property
    def control(self) -> Any:
        """The control plane (``ControlPlane``): settings, reloads, the supervisor."""
        assert self.app is not None
        return self.app.control

    @property
    def supervisor(self) -> Any:
        return self.control.supervisor

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn`` on the daemon's Trio thread."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def wait_serving(self, count: int, timeout: float = 10.0) -> None:
        wait_for(lambda: self.supervisor.serving_count == count, timeout,
                 f"{count} serving engines")

    @contextlib.contextmanager
    def frozen(self) -> Iterator[Callable[[], None]]:
        """The daemon's Trio loop (and the asyncio loop on it) held still until the block
        ends, or the callable it gives is called: to its peers, a process that stopped
        answering for a while."""
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            release.wait(60)

        holder = threading.Thread(target=self.run_sync, args=(hold,), name="freeze")
        holder.start()
        try:
            assert holding.wait(30), "the daemon's loop was not reached"
            yield release.set
        finally:
            release.set()
            holder.join(30)

    def stop(self) -> None:
        if self.token is not None and self.shutdown is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                self.run_sync(self.shutdown.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "daemon did not stop"
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def running_daemon(tmp_path: Path, text: str, **options: Any) -> Iterator[Daemon]:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    daemon = Daemon(path, **options).start()
    try:
        yield daemon
    finally:
        daemon.stop()


def _post(sock: socket.socket, path: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
    )


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


@contextlib.contextmanager
def raw_stream(url: str, body: dict[str, Any], events: int) -> Iterator[None]:
    """POST a streaming chat request on a bare socket, read ``events`` SSE events, then hang up.

    A bare socket, so leaving the block is exactly a client vanishing mid-stream.
    """
    with _connect(url) as sock:
        _post(sock, "/v1/chat/completions", body)
        received = b""
        while received.count(b"data:") < events:
            received += sock.recv(65536)
        yield


@contextlib.contextmanager
def raw_post(url: str, path: str, body: dict[str, Any]) -> Iterator[None]:
    """POST ``body`` to ``path`` on a bare socket and read nothing: leaving the block is
    the client vanishing, at a moment the test chose (not a client timeout's)."""
    with _connect(url) as sock:
        _post(sock, path, body)
        yield


def in_flight(daemon: Daemon) -> float:
    """The requests the daemon is serving now (its ``/metrics`` gauge)."""
    metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=10).read().decode()
    line = next(line for line in metrics.splitlines()
                if line.startswith("direct_frontend_in_flight_requests "))
    return float(line.split()[1])
