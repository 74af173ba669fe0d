"""Fault tolerance end to end: engines die, hang, fail and overload mid-stream.

The simulator is deterministic from its token prefix, so a stream that
survives a failure must equal the uninterrupted text exactly (nothing lost,
nothing repeated) with usage counting each output token once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from grpclib import Status

from direct_frontend.control.lifecycle import MAX_RETRY_S
from direct_frontend.simulator.faults import FaultPlan
from tests.support.daemon import (
    Daemon,
    fleet_text,
    free_port,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import http, sdk_http
from tests.support.sim import start_cli, stop_cli

KINDS = ["sglang", "vllm", "trtllm"]
PACED = {"decode_us_per_token": 300, "prefill_us_per_token": 0, "eos_probability": 0.0}
CHAT = [{"role": "user", "content": "Tell me a long story about the sea."}]
TOKENS = 60


@contextlib.contextmanager
def engines(model_dir: Path, tmp: Path, kind: str, names: str = "abc") -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine(n, kind, **PACED) for n in names],
                      probe="interval_s = 0.1\ntimeout_s = 1.0")
    with running_daemon(tmp, text) as daemon:
        daemon.wait_serving(len(names))
        yield daemon


@pytest.fixture(params=KINDS)
def daemon(request: pytest.FixtureRequest, model_dir: Path, tmp_path: Path) -> Iterator[Daemon]:
    # Every engine fails its next request in the tests below: the stream must survive
    # two failures in a row (the third engine serves it).
    with engines(model_dir, tmp_path, request.param) as running:
        yield running


def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="-", max_retries=0,
                         http_client=sdk_http())


def streamed(daemon: Daemon, **kwargs: object) -> tuple[str, int]:
    chunks = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=TOKENS, stream=True,
        stream_options={"include_usage": True}, **kwargs,
    )
    text, usage = [], 0
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        text.extend(c.delta.content or "" for c in chunk.choices)
    return "".join(text), usage


def metric(daemon: Daemon, pattern: str) -> float:
    body = http.get(daemon.url + "/metrics").text
    return sum(float(v) for v in re.findall(pattern + r"\S* (\S+)", body))


def reference(daemon: Daemon) -> str:
    text, usage = streamed(daemon)
    assert usage == TOKENS
    return text


def faulty(daemon: Daemon, plan: FaultPlan, healthy: str = "c") -> None:
    """Every engine but ``healthy`` fails its next request as ``plan`` says."""
    for name, sim in daemon.supervisor.simulators.items():
        if name != healthy:
            sim.faults = dataclasses.replace(plan)


def test_engine_dying_mid_stream_migrates_token_exactly(daemon: Daemon) -> None:
    expected = reference(daemon)
    sims = daemon.supervisor.simulators
    faulty(daemon, FaultPlan(die_after_tokens=17, only_request=1))
    for _ in range(3):  # round robin reaches a failing engine within three requests
        text, usage = streamed(daemon)
        assert text == expected
        assert usage == TOKENS
    died = [name for name, sim in sims.items() if sim.fault_stats.died]
    assert len(died) >= 1
    assert metric(daemon, r'direct_frontend_engine_requests_total\{[^}]*outcome="migrated"') >= 1
    # the dead engine was taken out at once and the probes bring it back
    wait_for(lambda: daemon.supervisor.serving_count == 3, what="the engines to come back")


def test_non_streaming_request_survives_a_dying_engine(daemon: Daemon) -> None:
    api = client(daemon)
    expected = api.chat.completions.create(model="demo", messages=CHAT, max_tokens=TOKENS)
    faulty(daemon, FaultPlan(die_after_tokens=0, only_request=1))
    for _ in range(3):
        again = api.chat.completions.create(model="demo", messages=CHAT, max_tokens=TOKENS)
        assert again.choices[0].message.content == expected.choices[0].message.content
        assert again.usage is not None and again.usage.completion_tokens == TOKENS
    assert any(s.fault_stats.died for s in daemon.supervisor.simulators.values())


def test_a_hung_engine_is_detected_by_the_stall_timeout(daemon: Daemon) -> None:
    expected = reference(daemon)
    settings = daemon.control.settings
    failover = dataclasses.replace(settings.failover, stall_timeout_s=0.3)
    daemon.run_sync(setattr, daemon.control, "settings",
                    dataclasses.replace(settings, failover=failover))
    faulty(daemon, FaultPlan(hang_after_tokens=9, only_request=1))
    for _ in range(3):
        text, usage = streamed(daemon)
        assert text == expected and usage == TOKENS
    hung = [s for s in daemon.supervisor.simulators.values() if s.fault_stats.hung]
    assert hung
    # the hung request was aborted on its engine, so its slot is free again
    wait_for(lambda: all(s.stats.running == 0 for s in hung), what="the hung slot to be freed")


def test_overloaded_engine_is_skipped_but_not_marked_down(
    model_dir: Path, tmp_path: Path
) -> None:
    with engines(model_dir, tmp_path, "sglang", "ab") as daemon:
        sims = daemon.supervisor.simulators
        sims["a"].faults = FaultPlan(status=Status.RESOURCE_EXHAUSTED)
        for _ in range(4):
            text, usage = streamed(daemon)
            assert usage == TOKENS and text
        assert sims["a"].fault_stats.failed
        assert daemon.supervisor.children["a"].state.value == "serving"
        # every engine saturated: a 429 with Retry-After, before any byte of the stream
        sims["b"].faults = FaultPlan(status=Status.RESOURCE_EXHAUSTED)
        r = http.post(daemon.url + "/v1/chat/completions",
                       json={"model": "demo", "messages": CHAT, "stream": True})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"


def test_unavailable_before_the_first_token_is_retried_and_marks_the_engine_down(
    model_dir: Path, tmp_path: Path
) -> None:
    with engines(model_dir, tmp_path, "vllm") as daemon:
        expected = reference(daemon)
        sims = daemon.supervisor.simulators
        states: list[str] = []
        def note(child: Any, previous: Any) -> None:
            states.append(f"{child.name}:{child.state.value}")

        daemon.run_sync(daemon.supervisor.listeners.append, note)
        faulty(daemon, FaultPlan(status=Status.UNAVAILABLE, only_request=1))
        for _ in range(3):
            text, usage = streamed(daemon)
            assert text == expected and usage == TOKENS
        assert any(s.fault_stats.failed for s in sims.values())
        assert any(s.endswith(":unhealthy") for s in states)
        assert metric(daemon, r'direct_frontend_engine_requests_total\{[^}]*outcome="retried"') >= 1


def test_engine_restart_mid_stream_and_recovery(model_dir: Path, tmp_path: Path) -> None:
    with engines(model_dir, tmp_path, "sglang") as daemon:
        expected = reference(daemon)
        sims = daemon.supervisor.simulators
        faulty(daemon, FaultPlan(die_after_tokens=5, only_request=1))
        for _ in range(3):
            text, _ = streamed(daemon)
            assert text == expected
        dead = next(name for name, sim in sims.items() if sim.fault_stats.died)
        child = daemon.supervisor.children[dead]
        wait_for(lambda: child.state.value == "serving", what="the engine to rejoin")


def test_a_killed_engine_restarted_on_its_port_serves_again_within_a_second(
    model_dir: Path, tmp_path: Path,
) -> None:
    """With the default probe settings (every 5 s) a restarted engine is back at once.

    Once out, an engine is probed fast, and one that was out because its
    connection failed serves again on its first answer (discovery + one probe).
    """
    port = free_port()
    flags = ("--port", str(port), "--model-dir", str(model_dir), "--served-model-name", "demo",
             "--eos-probability", "0")
    process, _ = start_cli("sglang", *flags)
    try:
        engines = [{"name": "victim", "url": f"grpc://127.0.0.1:{port}", "kind": "sglang"},
                   sim_engine("other", "sglang", **PACED)]
        with running_daemon(tmp_path, fleet_text(model_dir, engines, probe="")) as daemon:
            daemon.wait_serving(2)
            victim = daemon.supervisor.children["victim"]
            assert victim.probe.interval_s == 5.0  # the defaults
            process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()

            def request_served_and_victim_out() -> bool:
                r = http.post(daemon.url + "/v1/completions",
                               json={"model": "demo", "prompt": "hi", "max_tokens": 4})
                assert r.status_code == 200, r.text  # retried on the other engine
                return victim.state.value == "unhealthy"

            wait_for(request_served_and_victim_out, what="a request to find the victim gone")
            # Down long enough for the retry backoff to reach its cap: the slowest case.
            wait_for(lambda: victim.tracker.next_delay(5.0) == MAX_RETRY_S,
                     what="the probes to back off")
            assert victim.state.value == "unhealthy"
            process, _ = start_cli("sglang", *flags)  # returns once it listens
            restarted = time.monotonic()
            wait_for(lambda: victim.state.value == "serving", what="the victim to serve again")
            # sooner than a probe at the interval (5 s) would find it: at its first answer
            assert time.monotonic() - restarted < victim.probe.interval_s
            r = http.post(daemon.url + "/v1/completions",
                           json={"model": "demo", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200
    finally:
        if process.poll() is None:
            stop_cli(process)


def test_streams_on_a_removed_engine_migrate_after_the_drain_grace(
    model_dir: Path, tmp_path: Path
) -> None:
    slow = {"decode_us_per_token": 8000, "prefill_us_per_token": 0, "eos_probability": 0.0}
    fast = {**slow, "decode_us_per_token": 0}
    keep, leave = sim_engine("keep", **fast), sim_engine("leave", **slow)
    extra = "drain_timeout_s = 30\n[frontend.faults]\ndrain_migrate_after_s = 0.2"
    # 3.2 s of stream where it starts: it outlasts the reload and the 0.2 s grace however busy
    # the machine is; where it moves, it ends at once
    tokens = 400

    def fleet(*engines: dict[str, Any]) -> str:
        return fleet_text(model_dir, [dict(e) for e in engines], frontend_extra=extra)

    # the stream starts on the only engine, which one edit replaces with another
    with running_daemon(tmp_path, fleet(leave)) as daemon:
        daemon.wait_serving(1)
        api = client(daemon)
        leaving = daemon.supervisor.simulators["leave"]
        done: list[str] = []

        def long_stream() -> None:
            parts = api.completions.create(model="demo", prompt="Once", max_tokens=tokens,
                                           stream=True)
            done.append("".join(p.choices[0].text for p in parts if p.choices))

        worker = threading.Thread(target=long_stream)
        worker.start()
        wait_for(lambda: leaving.stats.running > 0, what="the stream to start")
        (tmp_path / "fleet.toml").write_text(fleet(keep))
        assert http.post(daemon.url + "/fleet/reload").json()["ok"]
        worker.join()
        expected = api.completions.create(model="demo", prompt="Once", max_tokens=tokens)
        assert done[-1] == expected.choices[0].text  # the whole of it, once
        # continued on the other engine from the tokens produced (a "~1" continuation)
        kept = daemon.supervisor.simulators["keep"]  # started by the edit
        assert any(rid.endswith("~1") for rid in kept.stats.request_ids)
        # the engine left long before its stream would have ended there
        assert leaving.stats.aborts_received >= 1
        wait_for(lambda: "leave" not in daemon.supervisor.children, what="the engine to go")


def test_admission_control_refuses_past_the_queue_with_a_429(
    model_dir: Path, tmp_path: Path
) -> None:
    slow = {"decode_us_per_token": 20000, "prefill_us_per_token": 0, "eos_probability": 0.0}
    extra = "[frontend.limits]\nmax_in_flight = 1\nmax_queue = 0"
    with running_daemon(tmp_path, fleet_text(model_dir, [sim_engine("a", **slow)],
                                             frontend_extra=extra)) as daemon:
        daemon.wait_serving(1)
        sim = daemon.supervisor.simulators["a"]
        body = {"model": "demo", "messages": CHAT, "max_tokens": 30, "stream": True}
        with http.stream("POST", daemon.url + "/v1/chat/completions", json=body) as first:
            assert first.status_code == 200
            wait_for(lambda: sim.stats.running == 1, what="the first request to run")
            second = http.post(daemon.url + "/v1/chat/completions", json=body)
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
            assert "saturated" in second.json()["error"]["message"]
            first.read()


def test_request_timeout_ends_the_request_and_frees_the_engine(
    model_dir: Path, tmp_path: Path
) -> None:
    slow = {"decode_us_per_token": 20000, "prefill_us_per_token": 0, "eos_probability": 0.0}
    text = fleet_text(model_dir, [sim_engine("a", **slow)],
                      frontend_extra="request_timeout_s = 0.3")
    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(1)
        sim = daemon.supervisor.simulators["a"]
        r = http.post(daemon.url + "/v1/chat/completions",
                       json={"model": "demo", "messages": CHAT, "max_tokens": 200})
        assert r.status_code == 504, r.text
        assert "0.3" in r.json()["error"]["message"]
        wait_for(lambda: sim.stats.running == 0, what="the engine slot to be freed")
        assert sim.stats.aborts_received == 1
        assert daemon.supervisor.children["a"].state.value == "serving"  # not the engine's fault
