"""The ``nats-server`` that ``run --workers N`` starts for its workers, kept running.

It listens on a loopback port of its own and lets in only holders of a
token made for this parent (``secrets.token_urlsafe``). The token reaches the
server through its configuration file and the workers through a token
file, both mode 0600 in the parent's private directory: never a command
line, which any local user can read with ``ps``.

When it dies it is started again on the same port, after a backoff that
doubles while it keeps dying; the workers' links reconnect by themselves
(control/replicas.py). It dies with the parent, even one killed with
SIGKILL: ``PR_SET_PDEATHSIG`` is set in the child before it runs, and as the
kernel sends that signal when the *thread* that forked the child ends, the
child is forked from the thread that runs Trio (the main one), not from a
worker thread of Trio's (``trio.lowlevel.open_process`` forks from one of
those, which Trio retires when idle). Its exit is awaited through a pidfd.

Its output (it logs to stderr) is read line by line into our logger
``direct_frontend.nats``, one record per line at the line's own level, so
the parent's stderr carries only our records (pure JSON with ``--log-json``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import trio

log = logging.getLogger("direct_frontend.workers")
server_log = logging.getLogger("direct_frontend.nats")

PR_SET_PDEATHSIG = 1
#: the token's file in the private directory (the workers read it: WorkerRole.token_file)
TOKEN_FILE = "nats-token"
#: a server that dies is started again after this long, doubling while it keeps dying
RESTART_BACKOFF_S = (0.2, 5.0)
STABLE_AFTER_S = 30.0
START_TIMEOUT_S = 10.0
POLL_S = 0.05
#: ``[12345] 2026/01/02 03:04:05.678901 [INF] the message``
_LINE = re.compile(rb"^\[\d+\] \S+ \S+ \[([A-Z]{3})\] (.*)$")
_LEVELS = {b"TRC": logging.DEBUG, b"DBG": logging.DEBUG, b"INF": logging.INFO,
           b"WRN": logging.WARNING, b"ERR": logging.ERROR, b"FTL": logging.CRITICAL}


def log_line(line: bytes) -> None:
    """One line of the server's output as one record of ours, at its own level."""
    match = _LINE.match(line.rstrip(b"\r"))
    level, text = (_LEVELS.get(match[1], logging.INFO), match[2]) if match else (
        logging.INFO, line.rstrip(b"\r"))
    if text:
        server_log.log(level, "nats-server: %s", text.decode(errors="replace"))


def _write_private(path: Path, text: str) -> None:
    """``text`` in a new file only its owner may read (created so, never widened later)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork


def _dies_with_parent(parent: int) -> None:
    """In the forked child, before it runs nats-server: SIGKILL it when its parent ends."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the line above: nobody would kill it
        os._exit(1)


class PrivateNats:
    """The workers' own ``nats-server``: :meth:`run` starts it and keeps it running."""

    def __init__(self, binary: str, state_dir: Path) -> None:
        self.binary = binary
        self.token = secrets.token_urlsafe(32)
        self.token_file = state_dir / TOKEN_FILE
        self.config_file = state_dir / "nats.conf"
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.port = 0

    @property
    def url(self) -> str:
        """Where the workers connect (the token is in :attr:`token_file`, not here)."""
        return f"nats://127.0.0.1:{self.port}"

    def _configure(self) -> None:
        self.port = _free_port()
        _write_private(self.token_file, self.token + "\n")
        _write_private(self.config_file, (
            f"listen: 127.0.0.1:{self.port}\n"
            f'authorization {{ token: "{self.token}" }}\n'))

    def _spawn(self) -> subprocess.Popen[bytes]:
        """Forked from this (Trio's) thread: PR_SET_PDEATHSIG follows the thread that forks."""
        parent = os.getpid()
        return subprocess.Popen(
            [self.binary, "-c", str(self.config_file)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=lambda: _dies_with_parent(parent))

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the server (``task_status`` gets its URL once it greets), then keep it running."""
        self._configure()
        backoff = RESTART_BACKOFF_S[0]
        started = False
        while True:
            since = time.monotonic()
            code = await self._run_once(task_status if not started else None)
            started = True
            self.restarts += 1
            if time.monotonic() - since > STABLE_AFTER_S:
                backoff = RESTART_BACKOFF_S[0]
            log.warning("workers: nats-server exited with %s; starting it again in %.1fs "
                        "(restart %d; the workers reconnect by themselves)", code, backoff,
                        self.restarts)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def _run_once(self, task_status: trio.TaskStatus[str] | None) -> int:
        """One life of the server: its output logged, its exit code when it ends."""
        process = self._spawn()
        self.process = process
        assert process.stdout is not None
        output = trio.lowlevel.FdStream(os.dup(process.stdout.fileno()))
        process.stdout.close()
        pidfd = os.pidfd_open(process.pid)
        log.info("workers: nats-server started (pid %d) on %s", process.pid, self.url)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_relay, output)
                if task_status is not None:
                    with trio.fail_after(START_TIMEOUT_S):
                        while not await greets("127.0.0.1", self.port):
                            if process.poll() is not None:
                                raise OSError(f"nats-server exited at start with "
                                              f"{process.returncode} (its log says why)")
                            await trio.sleep(POLL_S)  # a child's port has no event to wait on
                    task_status.started(self.url)
                await trio.lowlevel.wait_readable(pidfd)
                return process.wait()
        finally:
            if process.poll() is None:  # cancelled: it goes with us
                process.kill()
                process.wait()
            os.close(pidfd)


async def _relay(output: trio.lowlevel.FdStream) -> None:
    """The server's output, line by line, into our log, until it closes it."""
    async with output:
        pending = b""
        while data := await output.receive_some(65536):
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                log_line(line)
        if pending:
            log_line(pending)


def _free_port() -> int:
    """A free loopback port (bound and let go at once: the server binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def greets(host: str, port: int) -> bool:
    """Whether a nats-server answers on ``host:port`` (its INFO line)."""
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError:
        return False
    async with stream:
        with trio.move_on_after(1):
            return (await stream.receive_some(4)).startswith(b"INFO")
    return False
