"""Graceful shutdown: in-flight streams finish, new connections are refused, exit code 0."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from direct_frontend.simulator import SimEngine
from tests.support.daemon import (
    Daemon,
    fleet_text,
    free_port,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import http

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
def daemon_process(model_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                       str]]:
    port = free_port()
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(fleet_text(model_dir, [sim_engine("slow", **SLOW)]).replace(
        'listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"'))
    proc = subprocess.Popen([DAEMON, "run", str(fleet)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return http.get(url + "/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, 20, "the daemon to serve")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_sigterm_lets_the_stream_finish_then_exits_0(model_dir: Path, tmp_path: Path) -> None:
    with daemon_process(model_dir, tmp_path) as (proc, url), httpx.Client(timeout=30) as client:
        port = int(url.rsplit(":", 1)[1])
        with client.stream("POST", url + "/v1/chat/completions",
                           json={**BODY, "max_tokens": 60}) as stream:
            lines = stream.iter_lines()
            head = [next(lines) for _ in range(3)]  # the stream is under way
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: refused(port), what="new connections to be refused")
            assert proc.poll() is None  # still finishing the stream
            text = "\n".join([*head, *lines])
        assert text.rstrip().endswith("data: [DONE]")
        assert '"finish_reason":"length"' in text and '"error"' not in text
        assert proc.wait(10) == 0
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode()
    assert "received SIGTERM: shutting down" in stderr
    assert "Traceback" not in stderr, stderr


def test_a_second_signal_stops_at_once(model_dir: Path, tmp_path: Path) -> None:
    with daemon_process(model_dir, tmp_path) as (proc, url), httpx.Client(timeout=30) as client:
        port = int(url.rsplit(":", 1)[1])
        with client.stream("POST", url + "/v1/chat/completions",
                           json={**BODY, "max_tokens": 2000}) as stream:  # 40 s of tokens
            lines = stream.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGINT)
            # the first is handled (two pending signals of a kind would be one)
            wait_for(lambda: refused(port), what="new connections to be refused")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(20) == 0  # long before the stream's 40 s
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
            started = time.monotonic()
            daemon.stop()  # raises if the daemon's trio.run failed; joins its thread
            assert time.monotonic() - started < 10  # the stream alone would take 40 s
            with pytest.raises(httpx.RemoteProtocolError):  # cut at the end of the grace
                "\n".join(lines)
        assert sim.stats.running == 0  # the engine was told (or closed): nothing left behind


def test_background_responses_get_the_grace_period_then_are_cancelled(
    model_dir: Path, tmp_path: Path,
) -> None:
    with graced(model_dir, tmp_path) as (daemon, sim):
        made = http.post(daemon.url + "/v1/responses", json={
            "model": "demo", "input": "go on", "background": True,
            "max_output_tokens": 2000}).json()
        wait_for(lambda: http.get(f"{daemon.url}/v1/responses/{made['id']}").json()["status"]
                 == "in_progress", what="the background response to run")
        started = time.monotonic()
        daemon.stop()  # raises if the daemon's trio.run failed (a task left behind, say)
        assert time.monotonic() - started < 10  # the response alone would take 40 s
        assert sim.stats.running == 0  # its engine call ended with it
