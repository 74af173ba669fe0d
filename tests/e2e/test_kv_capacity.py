"""KV-aware routing learns each engine's cache size from discovery.

vLLM reports it in GetLoads (``max_total_num_tokens``), which an older servicer
may not serve: that engine joins all the same, with its size unknown. The
engines run beside the daemon (:class:`EngineThread`) so that each can have a
cache of its own size.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.simulator import SimEngine
from direct_frontend.simulator.model import TimingModel
from tests.support.daemon import kv_fleet_text, running_daemon
from tests.support.http import http
from tests.support.sim import EngineThread

BLOCK = 16


@contextlib.contextmanager
def vllm_beside(model_dir: Path, **options: Any) -> Iterator[EngineThread]:
    engine = SimEngine.from_model_dir(
        "vllm", model_dir, served_model_name="demo", timing=TimingModel(),
        eos_probability=0.0, block_size=BLOCK, **options,
    )
    with EngineThread(engine) as running:
        yield running


def test_capacity_comes_from_get_loads_and_an_engine_without_it_still_joins(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "direct_frontend")
    with vllm_beside(model_dir, kv_capacity_blocks=8) as small, \
            vllm_beside(model_dir, serve_get_loads=False) as older:
        tables = [{"name": name, "url": f"grpc://127.0.0.1:{sim.engine.port}", "kind": "vllm"}
                  for name, sim in (("small", small), ("older", older))]
        with running_daemon(tmp_path, kv_fleet_text(model_dir, tables)) as daemon:
            daemon.wait_serving(2)
            engines = {e["name"]: e for e in http.get(daemon.url + "/fleet").json()["engines"]}
            assert engines["small"]["kv_capacity_tokens"] == 8 * BLOCK
            assert engines["older"]["kv_capacity_tokens"] is None
            assert engines["older"]["state"] == "serving"
            assert "engine older does not answer GetLoads" in caplog.text
            # The approximate memory now models the small engine's LRU: it never
            # believes the engine holds more than its 8 blocks. (The first prompt goes
            # there: an engine whose occupancy is unknown counts as full.)
            policy = daemon.control.models.get("demo").settings.policy
            for first in (100, 400, 700):
                prompt = list(range(first, first + 12 * BLOCK))
                r = http.post(daemon.url + "/v1/completions",
                               json={"model": "demo", "prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
            assert policy.approx.capacities == {"small": 8}
            assert policy.approx.held("small") == 8
            assert policy.approx.held("older") is None
