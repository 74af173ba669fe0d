"""Graceful shutdown: in-flight streams finish, new connections are refused, exit code 0.

Waits are on events (a port refusing, a process ending, a stream's bytes); their bounds
only end a broken run (``PROCESS_S``).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from direct_frontend.simulator import SimEngine
from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.simulator.model import TimingModel
from tests.support.daemon import (
    PROCESS_S,
    Daemon,
    fleet_text,
    free_port,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import http
from tests.support.sim import EngineThread

DAEMON = str(Path(sys.executable).with_name("direct-frontend"))
SLOW = {"decode_us_per_token": 20000, "prefill_us_per_token": 0, "eos_probability": 0.0}
BODY = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return True
    return False


@contextlib.contextmanager
def daemon_process(
    model_dir: Path, tmp_path: Path, engine: dict[str, Any], **fleet: str,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``direct-frontend run`` of one engine (``fleet``: more of :func:`fleet_text`'s options),
    serving; killed on the way out if still alive."""
    port = free_port()
    path = tmp_path / "fleet.toml"
    path.write_text(fleet_text(model_dir, [engine], **fleet).replace(
        'listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"'))
    proc = subprocess.Popen([DAEMON, "run", str(path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return http.get(url + "/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(lambda: ready() or proc.poll() is not None, PROCESS_S, "the daemon to serve")
        assert proc.poll() is None, f"the daemon exited with {proc.returncode} before serving"
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


@contextlib.contextmanager
def held_engine(model_dir: Path) -> Iterator[EngineThread]:
    """An engine beside the daemon whose streams crawl (a token every 0.05 s) until
    ``engine.faults = FaultPlan()`` lets the rest out at once."""
    engine = SimEngine.from_model_dir(
        "sglang", model_dir, served_model_name="demo", timing=TimingModel(),
        eos_probability=0.0, faults=FaultPlan(token_delay_s=0.05),
    )
    with EngineThread(engine) as running:
        yield running


def test_sigterm_lets_the_stream_finish_then_exits_0(model_dir: Path, tmp_path: Path) -> None:
    with held_engine(model_dir) as held:
        table = {"name": "held", "url": f"grpc://127.0.0.1:{held.engine.port}", "kind": "sglang"}
        # its health checks crawl too (a 1-token generation): a wide probe timeout
        with daemon_process(model_dir, tmp_path, table, probe="interval_s = 0.2\ntimeout_s = 5.0"
                            ) as (proc, url), httpx.Client(timeout=30) as client:
            port = int(url.rsplit(":", 1)[1])
            with client.stream("POST", url + "/v1/chat/completions",
                               json={**BODY, "max_tokens": 1200}) as stream:  # held: 60 s
                lines = stream.iter_lines()
                head = [next(lines) for _ in range(3)]  # the stream is under way
                proc.send_signal(signal.SIGTERM)
                wait_for(lambda: refused(port), PROCESS_S, "new connections to be refused")
                assert proc.poll() is None  # the stream is held: the daemon waits for it
                held.engine.faults = FaultPlan()  # the rest of the stream at once
                text = "\n".join([*head, *lines])
            assert text.rstrip().endswith("data: [DONE]")
            assert '"finish_reason":"length"' in text and '"error"' not in text
            assert proc.wait(PROCESS_S) == 0
            assert proc.stderr is not None
            stderr = proc.stderr.read().decode()
    assert "received SIGTERM: shutting down" in stderr
    assert "Traceback" not in stderr, stderr


def test_a_second_signal_stops_at_once(model_dir: Path, tmp_path: Path) -> None:
    with daemon_process(model_dir, tmp_path, sim_engine("slow", **SLOW)) as (proc, url), \
            httpx.Client(timeout=30) as client:
        port = int(url.rsplit(":", 1)[1])
        with client.stream("POST", url + "/v1/chat/completions",
                           json={**BODY, "max_tokens": 2000}) as stream:  # 40 s of tokens
            lines = stream.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGINT)
            # the first is handled (two pending signals of a kind would be one)
            wait_for(lambda: refused(port), PROCESS_S, "new connections to be refused")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(PROCESS_S) == 0
            with pytest.raises(httpx.RemoteProtocolError):  # cut short: the daemon stopped
                "\n".join(lines)
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode()
    assert "received SIGINT again: stopping now" in stderr
    assert "Traceback" not in stderr, stderr


@contextlib.contextmanager
def graced(model_dir: Path, tmp_path: Path) -> Iterator[tuple[Daemon, SimEngine]]:
    """A daemon of one slow engine, serving, that stops within a grace period of 0.3 s."""
    text = fleet_text(model_dir, [sim_engine("slow", **SLOW)])
    with running_daemon(tmp_path, text, shutdown_grace_s=0.3) as daemon:
        daemon.wait_serving(1)
        yield daemon, daemon.supervisor.simulators["slow"]


def test_streams_longer_than_the_grace_period_are_cut_and_everything_ends(
    model_dir: Path, tmp_path: Path,
) -> None:
    with graced(model_dir, tmp_path) as (daemon, sim):
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", daemon.url + "/v1/chat/completions", json={**BODY, "max_tokens": 2000},
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            daemon.stop()  # raises if the daemon's trio.run failed; joins its thread
            with pytest.raises(httpx.RemoteProtocolError):  # cut at the end of the grace
                "\n".join(lines)
        # the engine was told (or closed): nothing left behind, and its 40 s never ran out
        assert (sim.stats.running, sim.stats.completed) == (0, 0)


def test_background_responses_get_the_grace_period_then_are_cancelled(
    model_dir: Path, tmp_path: Path,
) -> None:
    with graced(model_dir, tmp_path) as (daemon, sim):
        made = http.post(daemon.url + "/v1/responses", json={
            "model": "demo", "input": "go on", "background": True,
            "max_output_tokens": 2000}).json()
        wait_for(lambda: http.get(f"{daemon.url}/v1/responses/{made['id']}").json()["status"]
                 == "in_progress", what="the background response to run")
        daemon.stop()  # raises if the daemon's trio.run failed (a task left behind, say)
        # its engine call ended with it, cut short of its 40 s
        assert (sim.stats.running, sim.stats.completed) == (0, 0)
