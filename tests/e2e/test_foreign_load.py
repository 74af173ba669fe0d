"""Routing weighs what other clients send an engine, from the engine's own report.

Two routers that know nothing of each other share an engine: router X keeps
streams open on engine A, and router Y, which serves A and B, sees them in A's
GetLoads report (less its own requests) and sends its work to B. The engines run
beside both daemons (:class:`EngineThread`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.simulator import EngineKind, SimEngine
from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.simulator.model import TimingModel
from tests.support.daemon import Daemon, fleet_text, raw_stream, running_daemon, wait_for
from tests.support.http import http
from tests.support.sim import EngineThread

STREAMS = 3


@contextlib.contextmanager
def beside(model_dir: Path, kind: EngineKind) -> Iterator[EngineThread]:
    engine = SimEngine.from_model_dir(
        kind, model_dir, served_model_name="demo", timing=TimingModel(), eos_probability=0.0,
        faults=FaultPlan(token_delay_s=0.05),  # a stream of 400 tokens lasts 20 s
    )
    with EngineThread(engine) as running:
        yield running


def table(name: str, sim: EngineThread) -> dict[str, Any]:
    return {"name": name, "url": f"grpc://127.0.0.1:{sim.engine.port}", "kind": sim.engine.kind}


def fleet_row(daemon: Daemon, name: str) -> dict[str, Any]:
    engines = http.get(daemon.url + "/fleet").json()["engines"]
    row: dict[str, Any] = next(e for e in engines if e["name"] == name)
    return row


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_an_engine_busy_with_another_routers_streams_gets_none_of_ours(
    model_dir: Path, tmp_path: Path, kind: EngineKind,
) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    long = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400, "stream": True}
    with beside(model_dir, kind) as a, beside(model_dir, kind) as b, \
            running_daemon(tmp_path / "x", fleet_text(model_dir, [table("a", a)])) as x, \
            running_daemon(tmp_path / "y", fleet_text(
                model_dir, [table("a", a), table("b", b)],
                frontend_extra='[frontend.routing]\npolicy = "least_loaded"\n')) as y, \
            contextlib.ExitStack() as streams:
        x.wait_serving(1)
        y.wait_serving(2)
        for _ in range(STREAMS):
            streams.enter_context(raw_stream(x.url, long, events=2))
        wait_for(lambda: fleet_row(y, "a")["foreign_load"] == STREAMS, what="a's report")
        assert fleet_row(y, "b")["foreign_load"] == 0
        for _ in range(4):
            r = http.post(y.url + "/v1/completions",
                           json={"model": "demo", "prompt": [5, 6, 7], "max_tokens": 2})
            assert r.status_code == 200, r.text
        # without the report, least_loaded would have alternated: two of four on a
        assert (fleet_row(y, "a")["requests"], fleet_row(y, "b")["requests"]) == (0, 4)
