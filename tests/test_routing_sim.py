"""``scripts/routing_sim.py``'s oracle is a bound: it hits what any router could hit, and more.

The grid's claims of what no router can reach rest on it (issue 15), so what
it finds cached is checked against the workload itself, and its figures
against every policy's on a small pressured point.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import types
from pathlib import Path
from types import ModuleType

import pytest

from direct_frontend.kv.events import BlockStored

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model() -> ModuleType:
    """``scripts/routing_model.py``: the modelled engines and the event loop."""
    return _load("routing_model")


@pytest.fixture(scope="module")
def sim(model: ModuleType) -> ModuleType:
    """``scripts/routing_sim.py`` (it imports its sibling ``routing_model``)."""
    return _load("routing_sim")


def test_the_oracle_hits_what_earlier_requests_carried_and_what_fits(sim: ModuleType) -> None:
    point = sim.Point(tenants=1, users=2, turns=4)
    workload = sim.Workload(point, seed=1)
    first, second = workload.users
    # a user, another user of the same tenant, the first user's next turn
    cold, other, again = (workload.next_request(user, rid, 0.0)
                          for rid, user in enumerate((first, second, first)))
    system = point.system_tokens // point.block_size
    history = (len(cold.tokens) + len(cold.answer)) // point.block_size
    requests = [cold, other, again]
    assert sim.best_hits(point, requests, math.inf) == [0, system, history]
    # room for one system prompt: it is read again first, so it is what stays
    assert sim.best_hits(point, requests, system) == [0, system, system]
    assert sim.best_hits(point, requests, 0) == [0, 0, 0]
    # the engines' LRU, touched tail first, keeps the shared root too; unbounded, it is MIN
    assert sim.lru_hits(point, requests, system) == [0, system, system]
    assert sim.lru_hits(point, requests, math.inf) == [0, system, history]


def test_no_policy_beats_the_oracle_on_a_pressured_point(sim: ModuleType) -> None:
    point = dataclasses.replace(sim.default_grid()[0], requests=300)
    results = sim.run_point(point, [1], [*sim.MODES, *sim.ORACLES])
    pooled, unbounded, lru = (results.pop(mode) for mode in
                              (sim.ORACLE, sim.ORACLE_UNBOUNDED, sim.POOLED_LRU))
    assert unbounded["hit_rate"] >= pooled["hit_rate"] >= lru["hit_rate"]
    assert unbounded["ttft_mean_ms"] <= pooled["ttft_mean_ms"] <= lru["ttft_mean_ms"]
    for mode, result in results.items():
        assert pooled["hit_rate"] >= result["hit_rate"], mode
        assert pooled["ttft_mean_ms"] <= result["ttft_mean_ms"], mode
    verdict = sim.verdict(point, {**results, sim.ORACLE: pooled})
    assert verdict["cache_affinity_over_oracle"] >= verdict["vs_cache_affinity"]


def _step_until_first_token(sim: ModuleType, engine: object, request: object, now: float) -> float:
    """Run ``engine`` alone (nothing else arrives) until ``request`` has its first token."""
    t = engine.step_end if engine.step_end is not None else now  # type: ignore[attr-defined]
    if engine.step_end is None:  # type: ignore[attr-defined]
        t = engine.begin_step(now)  # type: ignore[attr-defined]
    while True:
        first, _ = engine.finish_step()  # type: ignore[attr-defined]
        if request in first:
            return t - now
        t = engine.begin_step(t)  # type: ignore[attr-defined]


def test_the_exact_greedy_estimate_is_the_first_token_the_engine_then_gives(
        sim: ModuleType, model: ModuleType) -> None:
    """``first_token_in`` plays the engine forward exactly: it must match the engine itself."""
    # two tenants: requests ahead store the system prompt the late one then finds; room for all
    point = sim.Point(tenants=2, users=4, max_running=3, chunk=256, cache=50.0)
    workload = sim.Workload(point, seed=3)
    engine = model.ModelEngine(point, 0, lambda key, event: None)
    requests = [workload.next_request(user, rid, 0.0) for rid, user in enumerate(workload.users)]
    for request in requests:
        request.hashes = sim.prefix_hashes(request.tokens, point.block_size)
    busy, late = requests[:5], requests[5]
    for request in busy:  # more than it runs at once: some wait, one step is under way
        engine.arrive(request)
    engine.begin_step(0.0)
    estimate = model.first_token_in(engine, late, 0.0)
    engine.arrive(late)
    actual = _step_until_first_token(sim, engine, late, 0.0)
    assert estimate == pytest.approx(actual)
    assert actual > engine.steps.step_seconds(256, 0)  # it did queue behind the others
    # an idle engine: its own prefill, one chunk per step
    idle = model.ModelEngine(point, 1, lambda key, event: None)
    alone = requests[6]
    estimate = model.first_token_in(idle, alone, 0.0)
    idle.arrive(alone)
    assert estimate == pytest.approx(_step_until_first_token(sim, idle, alone, 0.0))


def test_pinned_ranks_keep_conversations_and_predictions_where_the_engine_would_not(
    sim: ModuleType,
) -> None:
    """Two engines of two data-parallel ranks: each rank a cache and a step loop of its own."""
    point = dataclasses.replace(sim.default_grid()[1], requests=300, engines=2, dp_ranks=2)
    results = sim.run_point(point, [1], [sim.OURS, sim.UNPINNED])
    pinned, unpinned = results[sim.OURS], results[sim.UNPINNED]
    assert len(pinned["per_engine"]) == 4 and min(pinned["per_engine"]) > 0  # every rank used
    # unpinned, the engine's best rank is predicted, while its balancer picks any rank
    assert abs(pinned["prediction_ratio"] - 1) < 0.02 < unpinned["prediction_ratio"] - 1
    assert pinned["hit_rate"] > unpinned["hit_rate"]
    with pytest.raises(ValueError, match="one rank"):
        sim.run(point, 1, sim.ORACLE)


def test_engines_that_store_at_admission_announce_a_prompt_before_its_first_token(
        sim: ModuleType, model: ModuleType) -> None:
    """As the simulated engines do (the live bench's); vLLM-like ones when the prefill ends."""
    for at_admission in (False, True):
        point = sim.Point(tenants=1, users=1, chunk=256, cache=50.0,
                          store_at_admission=at_admission)
        workload = sim.Workload(point, seed=1)
        request = workload.next_request(workload.users[0], 0, 0.0)
        request.hashes = sim.prefix_hashes(request.tokens, point.block_size)
        events: list[object] = []
        engine = model.ModelEngine(point, 0, lambda key, event, seen=events: seen.append(event))
        engine.arrive(request)
        engine.begin_step(0.0)  # admits it; its prompt needs several chunks
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert bool(stored) is at_admission
        while True:
            first, _ = engine.finish_step()
            if first:
                break
            engine.begin_step(0.0)
        assert first == [request]
        assert {h for e in events if isinstance(e, BlockStored)
                for h in e.block_hashes} == set(request.hashes)


@pytest.fixture(scope="module")
def cached(model: ModuleType) -> ModuleType:
    """``scripts/routing_cached.py``: the live shapes' engines, on the simulator's own cache."""
    return _load("routing_cached")


def test_the_live_shapes_engines_hit_by_the_page_and_store_what_fits(
        sim: ModuleType, model: ModuleType, cached: ModuleType) -> None:
    """Pages of one token hit to the token, the router's index sees them in its own blocks,
    and a prompt that finds every page pinned stores no more, as the simulated engines do."""
    from direct_frontend.kv.index import KvIndex

    point = sim.Point(engines=1, block_size=16, chunk=4096)
    index = KvIndex(16)
    engine = cached.CachedEngine(point, 0, lambda key, e: index.apply_events(key, (e,)),
                                 page_size=1, capacity_tokens=48)
    prompt = list(range(100, 140))  # 40 tokens: two of the router's blocks and 8 more
    first = model.Request(0, None, prompt, [7, 8], 0.0)
    engine.arrive(first)  # looked up and stored on arrival, before any step
    hashes = sim.prefix_hashes(prompt, 16)
    assert index.lookup_hashes(hashes) == {engine.key: 2}
    follow = model.Request(1, None, [*prompt[:37], 1, 2, 3], [9], 0.0)
    engine.arrive(follow)
    assert (first.cached_tokens, follow.cached_tokens) == (0, 37)  # to the token, not the block
    # 48 pages, 40 + 3 pinned: a third prompt stores 5 of its pages and then nothing
    third = model.Request(2, None, list(range(500, 540)), [5], 0.0)
    engine.arrive(third)
    assert len(engine.cache) == 48 and engine.evictions == 0
    while engine.busy:
        engine.begin_step(0.0)
        engine.finish_step()
    again = model.Request(3, None, list(range(500, 540)), [5], 0.0)
    engine.arrive(again)
    assert again.cached_tokens == 5


@pytest.fixture(scope="module")
def live(sim: ModuleType) -> ModuleType:
    """``scripts/routing_live.py``: the live bench's report (``bench_routing`` puts the
    scripts' directory on ``sys.path``, where its siblings import each other from)."""
    _load("bench_routing")
    return _load("routing_live")


def test_the_default_against_approximate_states_the_seeds_noise(live: ModuleType) -> None:
    """Approximate's TTFT over ours comes with the band the seeds move it in, and the hit gap
    with each seed's difference's mean and standard error (the same seeds, paired)."""
    def row(sums: list[float], hits: list[float], seeds: list[int] | None = None,
            mode: str = "approximate") -> dict[str, object]:
        counts = [10] * len(sums)
        return {"mode": mode, "ttft_mean_ms": sum(sums) / sum(counts), "ttft_p90_ms": 100.0,
                "seed_sums": sums, "seed_counts": counts, "hit_rate": sum(hits) / len(hits),
                "seed_hits": hits, "seed_ids": seeds or list(range(1, len(sums) + 1))}

    ours = row([500.0, 600.0, 700.0, 800.0], [0.80, 0.82, 0.84, 0.86], mode=live.OURS)
    approx = row([750.0, 990.0, 1050.0, 1080.0], [0.81, 0.82, 0.83, 0.88])
    e = live.versus_approximate(approx, ours)
    assert e["ttft_ratio"] == pytest.approx(3870 / 2600)
    low, high = e["ttft_band"]  # approximate's over ours, not the other way round
    assert 1.3 < low <= e["ttft_ratio"] <= high < 1.7
    assert e["ttft_band"] == live.seed_band(approx, ours)
    mean, error, seeds = e["seed_hit_gap"]
    assert (mean, seeds) == (pytest.approx(-0.005), 4)
    # gaps -0.01, 0, +0.01, -0.02: sample s.d. √(0.0005 / 3) over √4
    assert error == pytest.approx(math.sqrt(0.0005 / 3) / 2)
    text = live.approximate_text(e)
    assert "(per seed -0.005 ± 0.006 s.e., 4 seeds)" in text and "seeds resampled" in text
    # each mode lost a different seed: only the seeds both played pair up
    lost = live.versus_approximate(row([990.0, 1050.0, 1080.0], [0.82, 0.83, 0.88], [2, 3, 4]),
                                   row([500.0, 600.0, 700.0], [0.80, 0.82, 0.84], [1, 2, 3],
                                       mode=live.OURS))
    mean, _, seeds = lost["seed_hit_gap"]
    assert (mean, seeds) == (pytest.approx(0.005), 2)  # seeds 2 and 3: 0.82 − 0.82, 0.84 − 0.83
    assert "ttft_band" not in lost  # two seeds in common: no band
    # a run of only the two modes still says it
    verdict = live.verdict(types.SimpleNamespace(name="two modes"),
                           {live.OURS: ours, "approximate": approx}, {})
    assert "live: approximate/ours mean ×1.49" in live.summary(verdict)
    # a mode that could not run leaves the others' figures
    rows = {live.OURS: ours, "approximate": approx,
            "cache_affinity": {"mode": "cache_affinity", "status": "unavailable"},
            "round_robin": row([900.0] * 4, [0.5] * 4, mode="round_robin")}
    verdict = live.verdict(types.SimpleNamespace(name="one lost"), rows, {})
    assert verdict["live"]["best_other"] == "round_robin"
    assert "vs_cache_affinity" not in verdict["live"]
