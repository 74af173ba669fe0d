"""What the real-daemon benchmarks share: a free port, the daemon's command, a daemon run
from a fleet file until its ``/ready`` answers, and a percentile.

The benchmarks that drive ``direct-frontend run`` over real sockets (bench_fairness.py,
bench_batch.py) start it the same way: the fleet file written into the run's directory,
the daemon's output kept in ``daemon.log`` there, SIGTERM at the end (then SIGKILL after
20 s), and a start that fails within 60 s ends the benchmark with the log's tail.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def command() -> str:
    """The ``direct-frontend`` beside this Python, else the one on PATH."""
    binary = pathlib.Path(sys.executable).with_name("direct-frontend")
    return str(binary if binary.exists() else shutil.which("direct-frontend"))


@contextlib.contextmanager
def daemon(text: str, directory: pathlib.Path, env: Mapping[str, str]) -> Iterator[str]:
    """``direct-frontend run`` on the fleet file ``text`` (its ``listen`` names the port),
    with ``env`` added to this process's environment; yields its base URL once ready."""
    path = directory / "fleet.toml"
    path.write_text(text)
    port = int(text.split('listen = "127.0.0.1:')[1].split('"')[0])
    log = (directory / "daemon.log").open("wb")
    child = subprocess.Popen([command(), "run", str(path), "--no-watch"], stdout=log,
                             stderr=log, env={**os.environ, **env}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the daemon did not start:\n"
                                 + (directory / "daemon.log").read_text()[-3000:])
            time.sleep(0.1)
        yield base
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()
        log.close()


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank); NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
