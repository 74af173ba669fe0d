"""An engine process that restarts counts once in ``/fleet``, whatever it reports.

The engines run beside the daemon on their own loop (:class:`EngineThread`), so a
test can kill one and bring it back on the same ports as a relaunched process
would: a new connection, an empty cache, its KV-event sequence from 0. The
vLLM engines report no uptime, as the stock servicer 0.14.1 does
(docs/real-vllm.md §6), so the daemon has only the KV-event publisher and the
lost connection to go by.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.simulator import EngineKind, SimEngine
from direct_frontend.simulator.model import TimingModel
from tests.support.daemon import Daemon, fleet_text, kv_fleet_text, running_daemon, wait_for
from tests.support.http import http
from tests.support.sim import EngineThread

FAST = "interval_s = 0.05\ntimeout_s = 1.0"


@contextlib.contextmanager
def beside(
    model_dir: Path, kind: EngineKind = "vllm", *, kv_events: bool, report_uptime: bool = False
) -> Iterator[EngineThread]:
    engine = SimEngine.from_model_dir(
        kind, model_dir, served_model_name="demo", timing=TimingModel(),
        eos_probability=0.0, block_size=16, report_uptime=report_uptime,
        kv_events_port=0 if kv_events else None, kv_replay_port=0 if kv_events else None,
    )
    with EngineThread(engine) as running:
        yield running


def fleet(model_dir: Path, sim: EngineThread) -> str:
    engine = sim.engine
    table: dict[str, Any] = {
        "name": "e", "url": f"grpc://127.0.0.1:{engine.port}", "kind": engine.kind,
    }
    if engine.kv_events_endpoint is None:
        return fleet_text(model_dir, [table], probe=FAST)
    table.update(kv_events=engine.kv_events_endpoint, kv_replay=engine.kv_replay_endpoint,
                 block_size=16)
    return kv_fleet_text(model_dir, [table], probe=FAST)


def restarts(daemon: Daemon) -> int:
    status = http.get(daemon.url + "/fleet").json()
    return int(status["engines"][0]["restarts"])


def complete(daemon: Daemon, prompt: list[int]) -> None:
    r = http.post(daemon.url + "/v1/completions",
                   json={"model": "demo", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_relaunched_vllm_engine_counts_once_by_its_kv_publisher(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "direct_frontend.engine")
    with beside(model_dir, kv_events=True) as sim, \
            running_daemon(tmp_path, fleet(model_dir, sim)) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["e"]
        kv = daemon.supervisor.kv
        key = f"g{child.incarnation}r0"
        wait_for(lambda: child.incarnation in kv.live, what="the KV subscription")
        complete(daemon, list(range(300, 364)))
        wait_for(lambda: kv.index.blocks_of(key) == 4, what="the index to hold the prompt")
        assert restarts(daemon) == 0
        # at once (the probes may never fail), then down long enough to be marked down
        for n, quick in ((1, True), (2, False)):
            connections = child.channel.connections_opened
            if quick:
                sim.restart()
            else:
                sim.stop()
                wait_for(lambda: child.state.value == "unhealthy", what="marked down")
                assert restarts(daemon) == n - 1  # gone is not restarted, yet
                sim.start()
            wait_for(lambda: restarts(daemon) == n, what=f"restart {n} counted")  # noqa: B023
            # fenced: the old process's blocks are gone (the new one holds nothing)
            assert kv.index.blocks_of(key) == 0
            # reached again over a new connection (rediscovered, after the marking down):
            # the same restart, not another one
            wait_for(lambda: child.channel.connections_opened > connections  # noqa: B023
                     and child.state.value == "serving", what="probes on a new connection")
            assert restarts(daemon) == n
            # the catalog's handle shows a new life: routing forgets the old process
            assert child.handle is not None and child.handle.life >= n
        assert child.incarnation == daemon.supervisor.children["e"].incarnation
        assert "engine e restarted (its KV-event publisher started over)" in caplog.text
        complete(daemon, list(range(300, 364)))  # the new process's events are followed
        wait_for(lambda: kv.index.blocks_of(key) == 4, what="the new process's blocks")


def test_without_kv_events_the_lost_connection_is_the_witness(
    model_dir: Path, tmp_path: Path,
) -> None:
    with beside(model_dir, kv_events=False) as sim, \
            running_daemon(tmp_path, fleet(model_dir, sim)) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["e"]
        sim.stop()  # killed: probes are refused until it is back
        wait_for(lambda: child.state.value == "unhealthy", what="the engine to be marked down")
        assert restarts(daemon) == 0
        sim.start()
        wait_for(lambda: child.state.value == "serving", what="the engine to be back")
        assert restarts(daemon) == 1
        complete(daemon, [5, 6, 7])


@pytest.mark.parametrize("kv_events", [False, True])
def test_an_engine_that_only_failed_its_probes_did_not_restart(
    model_dir: Path, tmp_path: Path, kv_events: bool,
) -> None:
    with beside(model_dir, kv_events=kv_events) as sim, \
            running_daemon(tmp_path, fleet(model_dir, sim)) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["e"]
        sim.engine.healthy = False
        wait_for(lambda: child.state.value == "unhealthy", what="the engine to be marked down")
        sim.engine.healthy = True
        wait_for(lambda: child.state.value == "serving", what="the engine to be back")
        assert restarts(daemon) == 0
        assert child.channel.connections_opened == 1
        assert child.handle is not None and child.handle.life == 0  # the same process


def test_an_engine_that_reports_its_start_is_counted_by_it(
    model_dir: Path, tmp_path: Path,
) -> None:
    with beside(model_dir, "sglang", kv_events=False) as sim, \
            running_daemon(tmp_path, fleet(model_dir, sim)) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["e"]
        started = child.info.incarnation
        sim.stop()
        wait_for(lambda: child.state.value == "unhealthy", what="the engine to be marked down")
        sim.start()
        wait_for(lambda: child.state.value == "serving", what="the engine to be back")
        assert child.info.incarnation != started and re.match(r"\d{4}-", child.info.incarnation)
        assert restarts(daemon) == 1
