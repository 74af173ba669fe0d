"""Waiting for an engine: with every engine down, requests wait (bounded) for one to come back.

Standalone simulator processes, so an engine can be SIGKILLed and restarted
on its port; the simulator is deterministic from its token prefix, so a
stream that waited and migrated must equal the uninterrupted text exactly.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

from tests.support.daemon import Daemon, fleet_text, free_port, running_daemon, wait_for
from tests.support.http import http, sdk_http
from tests.support.sim import start_cli, stop_cli

TOKENS = 60
PROMPT = "Once upon a time"


class Engine:
    """One standalone simulated engine on a fixed port: killed and restarted there."""

    def __init__(self, model_dir: Path) -> None:
        self.port = free_port()
        self.flags = ("--port", str(self.port), "--model-dir", str(model_dir),
                      "--served-model-name", "demo", "--eos-probability", "0",
                      "--decode-us-per-token", "20000", "--prefill-us-per-token", "0")
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.process, _ = start_cli("sglang", *self.flags)  # returns once it listens

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()
        self.process = None

    def table(self, name: str) -> dict[str, str]:
        return {"name": name, "url": f"grpc://127.0.0.1:{self.port}", "kind": "sglang"}


@contextlib.contextmanager
def fleet(model_dir: Path, tmp: Path, count: int, wait_s: float, probe: str = "") -> Iterator[
    tuple[Daemon, list[Engine]]
]:
    """``count`` engines, ``wait_for_engine_s``; by default the fleet file's probe settings
    (readmission alone must be fast enough)."""
    engines = [Engine(model_dir) for _ in range(count)]
    try:
        for engine in engines:
            engine.start()
        tables = [engine.table(f"e{i}") for i, engine in enumerate(engines)]
        extra = f"[frontend.faults]\nwait_for_engine_s = {wait_s}"
        with running_daemon(tmp, fleet_text(model_dir, tables, probe=probe,
                                            frontend_extra=extra)) as daemon:
            daemon.wait_serving(count)
            yield daemon, engines
    finally:
        for engine in engines:
            if engine.process is not None:
                stop_cli(engine.process)


class Stream(threading.Thread):
    """A streaming completion in the background: its text, usage and error (if any)."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.api = openai.OpenAI(base_url=daemon.url + "/v1", api_key="-", max_retries=0,
                                 timeout=60, http_client=sdk_http())
        self.pieces: list[str] = []
        self.usage: int | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.api.completions.create(
                model="demo", prompt=PROMPT, max_tokens=TOKENS, stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.usage is not None:
                    self.usage = chunk.usage.completion_tokens
                self.pieces.extend(c.text for c in chunk.choices)
        except BaseException as exc:
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def waits(daemon: Daemon, outcome: str) -> float:
    body = http.get(daemon.url + "/metrics").text
    found = re.findall(rf'direct_frontend_engine_waits_total{{outcome="{outcome}"}} (\S+)', body)
    return sum(float(v) for v in found)


def in_flight(daemon: Daemon) -> int:
    count: int = daemon.control.settings.admission.in_flight
    return count


def every_engine_killed(daemon: Daemon, engines: list[Engine]) -> None:
    for engine in engines:
        engine.kill()
    wait_for(lambda: daemon.supervisor.serving_count == 0, what="no engine serving")


def test_a_stream_and_a_new_request_wait_for_a_restarted_engine(
    model_dir: Path, tmp_path: Path
) -> None:
    with fleet(model_dir, tmp_path, 2, wait_s=20) as (daemon, engines):
        expected = Stream(daemon)
        expected.join(30)
        assert expected.error is None and expected.usage == TOKENS
        stream = Stream(daemon)
        wait_for(lambda: len(stream.pieces) >= 3, what="the stream to be under way")
        children = daemon.supervisor.children
        on = next(i for i in range(2) if children[f"e{i}"].in_flight)
        every_engine_killed(daemon, engines)
        new = Stream(daemon)
        wait_for(lambda: in_flight(daemon) == 2, what="the new request to be waiting")
        assert stream.is_alive() and new.is_alive() and not new.pieces
        # on its own port, within the wait: the engine the stream failed on, back in a new
        # serving stint, is a new chance
        engines[on].start()
        stream.join(30)
        new.join(30)
        assert stream.error is None and new.error is None  # the client saw no error
        assert stream.text == expected.text and stream.usage == TOKENS  # migrated, exact
        assert new.text == expected.text and new.usage == TOKENS
        assert waits(daemon, "served") == 2 and waits(daemon, "expired") == 0


def test_past_wait_for_engine_s_the_client_gets_the_usual_errors(
    model_dir: Path, tmp_path: Path
) -> None:
    with fleet(model_dir, tmp_path, 1, wait_s=0.5) as (daemon, engines):
        stream = Stream(daemon)
        wait_for(lambda: len(stream.pieces) >= 3, what="the stream to be under way")
        every_engine_killed(daemon, engines)
        started = time.monotonic()
        r = http.post(daemon.url + "/v1/completions", timeout=30,
                       json={"model": "demo", "prompt": PROMPT, "max_tokens": 4})
        assert time.monotonic() - started >= 0.5  # it waited first
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_available"
        assert "x-request-id" in r.headers
        stream.join(30)
        assert isinstance(stream.error, openai.APIError)  # the error event, as before
        assert "engine failed" in str(stream.error)
        wait_for(lambda: waits(daemon, "expired") == 2, what="both waits counted")
        assert waits(daemon, "served") == 0


def test_a_client_that_leaves_ends_its_wait_at_once(model_dir: Path, tmp_path: Path) -> None:
    # probed fast: with no request in flight, only a probe sees the engine go
    fast = "interval_s = 0.2\ntimeout_s = 1.0"
    with fleet(model_dir, tmp_path, 1, wait_s=60, probe=fast) as (daemon, engines):
        every_engine_killed(daemon, engines)
        url = httpx.URL(daemon.url)
        body = json.dumps({"model": "demo", "prompt": PROMPT, "max_tokens": 4}).encode()
        with socket.create_connection((url.host, url.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            wait_for(lambda: in_flight(daemon) == 1, what="the request to be waiting")
        # the client hung up mid-wait: the wait ends then, not after wait_for_engine_s
        wait_for(lambda: waits(daemon, "cancelled") == 1, timeout=5,
                 what="the wait to end with the client")
        wait_for(lambda: in_flight(daemon) == 0, timeout=5, what="the request to end")
        assert waits(daemon, "served") == 0
        metrics = http.get(daemon.url + "/metrics").text
        assert "direct_frontend_cancelled_requests_total 1.0" in metrics
