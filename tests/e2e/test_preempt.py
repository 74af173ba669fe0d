"""Preemption over HTTP: a stream taken off its engine for another tenant ends token-exact.

One admission slot, two tenants named by a header. Tenant "flood" streams a long reply;
tenant "quiet" asks while it runs: the flood's stream is aborted on its engine, the quiet
request runs, and the flood's stream goes on from its tokens (a "~1" continuation) to the
same text, token for token, that it has unpreempted (the simulator is deterministic from
its token prefix).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine, wait_for
from tests.support.http import http

PACED = {"decode_us_per_token": 10000, "prefill_us_per_token": 0, "eos_probability": 0.0}
EXTRA = """[frontend.limits]
max_in_flight = 1
[frontend.tenants]
header = "x-tenant"
"""
ASK = {"model": "demo", "messages": [{"role": "user", "content": "Tell me about the sea."}],
       "max_tokens": 4}
BODY = {**ASK, "max_tokens": 80, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("a", **PACED)], frontend_extra=EXTRA)
    with running_daemon(tmp_path_factory.mktemp("preempt"), text) as daemon:
        daemon.wait_serving(1)
        yield daemon


def read(lines: Iterator[str]) -> tuple[str, int]:
    """The text and completion tokens of an SSE chat stream."""
    text, usage = [], 0
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        text.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    return "".join(text), usage


def test_a_preempted_stream_completes_token_exact(daemon: Daemon) -> None:
    sim = daemon.supervisor.simulators["a"]
    url = daemon.url + "/v1/chat/completions"
    with http.stream("POST", url, json=BODY, headers={"x-tenant": "flood"}) as alone:
        expected, tokens = read(alone.iter_lines())
    assert tokens == 80
    aborts = sim.stats.aborts_received
    with http.stream("POST", url, json=BODY, headers={"x-tenant": "flood"}) as flood:
        assert flood.status_code == 200
        lines = flood.iter_lines()
        first = [next(lines) for _ in range(4)]  # its stream is under way on the engine
        quiet = http.post(url, json=ASK,
                          headers={"x-tenant": "quiet"})
        # the quiet request was served while the flood's stream was off its engine
        assert quiet.status_code == 200, quiet.text
        text, tokens = read(iter(first + list(lines)))
    assert text == expected  # nothing lost, nothing repeated
    assert tokens == 80  # each output token counted once
    assert sim.stats.aborts_received > aborts  # the abort reached the engine
    assert any(rid.endswith("~1") for rid in sim.stats.request_ids)  # it went on from its tokens
    metrics = http.get(daemon.url + "/metrics").text
    assert re.search(r'engine_requests_total\{[^}]*outcome="preempted"[^}]*\} 1\.0', metrics)


def test_the_same_tenant_never_preempts_itself(daemon: Daemon) -> None:
    """A second request of the stream's own tenant waits for the slot instead."""
    sim = daemon.supervisor.simulators["a"]
    url = daemon.url + "/v1/chat/completions"
    ids = len(sim.stats.request_ids)
    with http.stream("POST", url, json=BODY, headers={"x-tenant": "solo"}) as first:
        lines = first.iter_lines()
        head = [next(lines) for _ in range(4)]
        second = http.post(url, json=ASK,
                           headers={"x-tenant": "solo"})
        assert second.status_code == 200
        _, tokens = read(iter(head + list(lines)))
    assert tokens == 80
    wait_for(lambda: len(sim.stats.request_ids) == ids + 2, what="both requests")
    assert not any(rid.endswith("~1") for rid in sim.stats.request_ids[ids:])
