"""KV-aware routing end to end: simulated engines publish KV events, the daemon indexes them."""

from __future__ import annotations

import re
from pathlib import Path

from grpclib import Status

from direct_frontend.simulator import SimEngine
from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.simulator.model import TimingModel
from tests.support.daemon import (
    Daemon,
    free_port,
    kv_fleet_text,
    raw_stream,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import http
from tests.support.sim import EngineThread

TIMING = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}


def kv_engine(name: str, kind: str = "vllm") -> dict[str, object]:
    table = sim_engine(name, kind, **TIMING)
    table["kv_events"] = f"tcp://127.0.0.1:{free_port()}"
    table["kv_replay"] = f"tcp://127.0.0.1:{free_port()}"
    table["block_size"] = 16
    return table


def complete(daemon: Daemon, prompt: list[int] | list[list[int]]) -> dict[str, object]:
    r = http.post(daemon.url + "/v1/completions",
                   json={"model": "demo", "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.json()


def metric(daemon: Daemon, name: str) -> float:
    body = http.get(daemon.url + "/metrics").text
    match = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(match.group(1)) if match else 0.0


def test_requests_sharing_a_prefix_follow_the_cache(model_dir: Path, tmp_path: Path) -> None:
    """Lone requests, then a batch of prompts: each finds the shared prefix where it lives."""
    engines = [kv_engine("a"), kv_engine("b"), kv_engine("c")]
    with running_daemon(tmp_path, kv_fleet_text(model_dir, engines)) as daemon:
        daemon.wait_serving(3)
        kv = daemon.supervisor.kv
        wait_for(lambda: len(kv.live) == 3, what="three KV subscriptions")
        wait_for(lambda: all(s.tracker.state != "replaying" for s in kv.subscriptions.values()),
                 what="the start-up replays done")  # (what they bring is no lag)
        sims = daemon.supervisor.simulators
        system = list(range(300, 300 + 160))  # ten full blocks shared by every request
        first = complete(daemon, [*system, 1, 2, 3])
        holder = next(n for n, s in sims.items() if s.stats.requests == 1)
        wait_for(lambda: len(kv.index) >= 10, what="the index to learn the prefix")
        before = {n: s.stats.requests for n, s in sims.items()}
        for i in range(6):
            usage = complete(daemon, [*system, 50 + i, 7, 8, 9])["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 160  # type: ignore[index]
        after = {n: s.stats.requests for n, s in sims.items()}
        assert after[holder] - before[holder] == 6, (before, after)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # type: ignore[index]
        predicted = metric(daemon, "direct_frontend_kv_predicted_cached_tokens_total")
        reported = metric(daemon, "direct_frontend_kv_reported_cached_tokens_total")
        assert predicted == reported == 6 * 160
        assert metric(daemon, "direct_frontend_kv_index_blocks") >= 10
        assert metric(daemon, "direct_frontend_kv_prediction_diverged") == 0
        lagged = re.findall(rf'^direct_frontend_kv_event_lag_seconds_count{{engine="{holder}"}} '
                            r"(\S+)$", http.get(daemon.url + "/metrics").text, re.M)
        assert float(lagged[0]) >= 1  # the live batches that taught the index the prefix
        # an evaluation harness's batch sharing a few-shot prefix: every prompt finds it cached
        batch = [[*system, 60 + i, 7, 8] for i in range(4)]
        usage = complete(daemon, batch)["usage"]
        assert usage["prompt_tokens"] == 4 * 163  # type: ignore[index]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * 160  # type: ignore[index]
        assert sims[holder].stats.requests == after[holder] + 4
        assert metric(daemon, "direct_frontend_kv_predicted_cached_tokens_total") == 10 * 160


def test_an_unhealthy_engine_is_fenced_out_of_the_index(model_dir: Path, tmp_path: Path) -> None:
    engines = [kv_engine("a"), kv_engine("b")]
    with running_daemon(tmp_path, kv_fleet_text(model_dir, engines)) as daemon:
        daemon.wait_serving(2)
        kv = daemon.supervisor.kv
        wait_for(lambda: len(kv.live) == 2, what="two KV subscriptions")
        complete(daemon, list(range(400, 400 + 64)))
        wait_for(lambda: len(kv.index) >= 4, what="the index to learn the prompt")
        holder = next(n for n, s in daemon.supervisor.simulators.items() if s.stats.requests)
        sim = daemon.supervisor.simulators[holder]
        sim.healthy = False  # probes fail: unhealthy after the failure threshold
        child = daemon.supervisor.children[holder]
        wait_for(lambda: child.state.value == "unhealthy", what="the engine to go unhealthy")
        key = f"g{child.incarnation}r0"
        assert kv.index.blocks_of(key) == 0  # cleared the moment it went unhealthy
        sim.healthy = True
        wait_for(lambda: child.state.value == "serving", what="the engine to come back")
        # back: rebuilt from the engine's replay history (its cache survived)
        wait_for(lambda: kv.index.blocks_of(key) >= 4, what="the entries to be rebuilt")


def sglang_beside(model_dir: Path, page_size: int) -> EngineThread:
    engine = SimEngine.from_model_dir(
        "sglang", model_dir, served_model_name="demo", timing=TimingModel(),
        eos_probability=0.0, page_size=page_size, kv_events_port=0, kv_replay_port=0,
    )
    return EngineThread(engine)


def test_an_engine_with_one_token_pages_is_indexed_in_our_blocks(
    model_dir: Path, tmp_path: Path
) -> None:
    """SGLang's default page of 1 token (discovery says so; the file says nothing) is regrouped."""
    with sglang_beside(model_dir, 1) as sim:
        engine = sim.engine
        table = {"name": "e", "url": f"grpc://127.0.0.1:{engine.port}", "kind": "sglang",
                 "kv_events": engine.kv_events_endpoint, "kv_replay": engine.kv_replay_endpoint}
        with running_daemon(tmp_path, kv_fleet_text(model_dir, [table])) as daemon:
            daemon.wait_serving(1)
            child = daemon.supervisor.children["e"]
            assert child.info is not None and child.info.block_size == 1
            kv = daemon.supervisor.kv
            wait_for(lambda: child.incarnation in kv.live, what="the KV subscription")
            system = list(range(300, 300 + 160))
            complete(daemon, [*system, 1, 2, 3])
            key = f"g{child.incarnation}r0"
            wait_for(lambda: kv.index.blocks_of(key) >= 10, what="the index to learn the prefix")
            usage = complete(daemon, [*system, 9, 8, 7])["usage"]
            reported = usage["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
            assert reported >= 160
            assert child.incarnation in kv.live  # never dropped for its page size
            fleet = http.get(daemon.url + "/fleet").json()
            assert fleet["engines"][0]["kv_routing"] == "events"
            assert metric(daemon, "direct_frontend_kv_predicted_cached_tokens_total") == 160


def test_a_streams_prefill_leaves_the_routing_queue_at_its_first_token(
    model_dir: Path, tmp_path: Path,
) -> None:
    """Without KV events nothing else says when a prefill ended: the relay tells the policy."""
    slow = sim_engine("a", "vllm", decode_us_per_token=50_000, prefill_us_per_token=0,
                      eos_probability=0.0)  # a 200-token stream lasts 10 s
    with running_daemon(tmp_path, kv_fleet_text(model_dir, [slow])) as daemon:
        daemon.wait_serving(1)
        policy = daemon.control.models.get("demo").settings.policy
        long = {"model": "demo", "max_tokens": 200, "stream": True,
                "messages": [{"role": "user", "content": "tell me a long story " * 8}]}
        with raw_stream(daemon.url, long, events=2):
            child = daemon.supervisor.children["a"]
            assert child.in_flight == 1  # still streaming …
            # … and its prefill no longer counts in the engine's queue
            assert policy.queue.depth("a", policy.clock(), None) == 0


def test_an_attempt_that_fails_before_any_output_leaves_the_routing_queue(
    model_dir: Path, tmp_path: Path,
) -> None:
    """A refused attempt is retried elsewhere; the engine that refused it has nothing queued."""
    engines = [sim_engine(name, "vllm", **TIMING) for name in ("a", "b")]
    with running_daemon(tmp_path, kv_fleet_text(model_dir, engines)) as daemon:
        daemon.wait_serving(2)
        policy = daemon.control.models.get("demo").settings.policy
        for sim in daemon.supervisor.simulators.values():
            sim.faults = FaultPlan(status=Status.UNAVAILABLE, only_request=1)
        complete(daemon, list(range(300, 364)))  # refused by the first, served by the other
        refused = [n for n, s in daemon.supervisor.simulators.items() if s.stats.requests == 0]
        assert len(refused) == 1
        assert policy.queue.depth(refused[0], policy.clock(), None) == 0
