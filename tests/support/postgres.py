"""A real PostgreSQL server for the durable store's tests (Debian's ``postgresql`` package).

``.ci/run`` installs the package. The server runs from a fresh data directory (a copy of one
that initdb made for the process) in a temporary folder: in memory, ``/dev/shm``, where
there is one with room, since the suite never crashes the machine and a disk would add only
time (a tenth of a second to each database copied, seconds to the folder's removal on a busy
machine). It listens on a free loopback port, runs as the ``postgres`` user when the tests
run as root (PostgreSQL refuses to run as root), and is polled until it accepts a
connection. Each test gets a database of its own (:meth:`PostgresServer.new_database`).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from tests.support.daemon import free_port

#: the user the server runs as when the tests run as root (Debian's package creates it)
SERVER_USER = "postgres"
#: where the data directory goes when this folder is there with room to spare (a container's
#: /dev/shm may be 64 MiB; a run's databases take hundreds), else the temporary folder
IN_MEMORY = Path("/dev/shm")
IN_MEMORY_FREE = 2 << 30
#: a data directory initdb made, which this process copies for each server it starts (initdb
#: takes a second, a copy a tenth); removed when the process exits
_made_by_initdb: list[Path] = []


def binaries() -> Path | None:
    """The folder of ``initdb`` and ``postgres``: Debian's versioned one, else ``$PATH``'s."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return None if initdb is None else Path(initdb).parent


def _roomy(folder: Path) -> bool:
    """``folder`` is there, writable, with :data:`IN_MEMORY_FREE` bytes free."""
    try:
        return os.access(folder, os.W_OK) and shutil.disk_usage(folder).free >= IN_MEMORY_FREE
    except OSError:
        return False


class PostgresServer:
    def __init__(self) -> None:
        folder = binaries()
        assert folder is not None, ("PostgreSQL not found: apt-get install postgresql "
                                    "(.ci/run does)")
        self.bin = folder
        self.port = free_port()
        self._as: list[str] = ["runuser", "-u", SERVER_USER, "--"] if os.geteuid() == 0 else []
        self.dir = self._folder("df-pg-")
        self.data = self.dir / "data"
        self.process: subprocess.Popen[bytes] | None = None

    def _folder(self, prefix: str) -> Path:
        """A new folder the server's user owns."""
        where = IN_MEMORY if _roomy(IN_MEMORY) else None
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=where))
        if self._as:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(folder, user.pw_uid, user.pw_gid)
        return folder

    def _initialized(self) -> Path:
        """This process's data directory fresh from initdb (made at the first call)."""
        if not _made_by_initdb:
            folder = self._folder("df-pg-initdb-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            subprocess.run([*self._as, str(self.bin / "initdb"), "-D", str(folder / "data"),
                            "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _made_by_initdb.append(folder / "data")
        return _made_by_initdb[0]

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def start(self, timeout: float = 30.0) -> PostgresServer:
        if not self.data.exists():
            subprocess.run([*self._as, "cp", "-a", str(self._initialized()), str(self.data)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.process = subprocess.Popen(
            [*self._as, str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
             "-k", str(self.dir), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=on"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                assert self.process.poll() is None, "postgres exited at start"
                assert time.monotonic() < deadline, "postgres did not start"
                time.sleep(0.05)

    def new_database(self, template: str | None = None) -> str:
        """A fresh database, empty or a copy of the database named ``template`` (which no
        one may be connected to); its DSN."""
        return self.dsn(self.create(template))

    def new_url(self) -> str:
        """A fresh, empty database; its postgresql:// URL (as a fleet file's dsn)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.create()}"

    def create(self, template: str | None = None) -> str:
        """A fresh database, empty or a copy of ``template``; its name."""
        name = "t_" + secrets.token_hex(6)
        copied = "" if template is None else f" TEMPLATE {template}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}{copied}")
        return name

    def stop(self, mode: str = "fast") -> None:
        """A shutdown, waited for: the data directory is free for :meth:`start` again when
        this returns. ``fast`` disconnects the clients and writes a checkpoint (seconds, after
        a run's hundreds of databases); ``immediate`` writes none, as a crash (a restart
        replays the log)."""
        if self.process is not None and self.process.poll() is None:
            subprocess.run([*self._as, str(self.bin / "pg_ctl"), "stop", "-D", str(self.data),
                            "-m", mode, "-w", "-t", "30"],
                           check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop("immediate")  # its data is deleted next: a checkpoint would be wasted
        shutil.rmtree(server.dir, ignore_errors=True)
