"""The hit-rate check: per engine, a 20 % drift crosses it, noise does not, and it acts."""

from __future__ import annotations

import random

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.observability.metrics import Metrics
from direct_frontend.routing.catalog import EngineHandle
from direct_frontend.routing.hitrate import HitRateMonitor, HitRateWatch
from direct_frontend.routing.kv_aware import KvAware


def engine(name: str, incarnation: int) -> EngineHandle:
    return EngineHandle(name, "vllm", f"grpc://{name}:1", incarnation, EngineRole.BOTH,
                        EngineInfo("demo"), 4096, None)


def test_a_systematic_20_percent_drift_crosses_either_way() -> None:
    for factor in (1.2, 1 / 1.2):
        monitor = HitRateMonitor()
        results = [monitor.record(round(1000 * factor), 1000) for _ in range(100)]
        assert results[-1] is not None, factor


def test_noise_does_not_cross() -> None:
    rng = random.Random(7)
    monitor = HitRateMonitor()
    for _ in range(2000):
        reported = rng.choice([512, 1024, 1536, 2048])
        # a block or two evicted or raced either way, on a third of the requests
        predicted = reported + rng.choice([0, 0, 0, 0, -16, 16, -32, 32]) * rng.randint(0, 4)
        assert monitor.record(max(0, predicted), reported) is None


def test_a_drifting_engine_is_routed_approximately_and_the_others_not() -> None:
    diverged: set[int] = set()
    watch = HitRateWatch(Metrics(), diverged)
    good, bad = engine("a", 1), engine("b", 2)
    policy = KvAware(KvAwareKnobs(), uses_events={1, 2}, diverged=diverged)
    for _ in range(60):
        watch.record(1000, 1000, good)
        watch.record(1400, 1000, bad)  # the approximate-mode 1.4×
    assert diverged == {2}
    assert policy.by_events(good) and not policy.by_events(bad)
    assert watch.metrics.kv_prediction_diverged._value.get() == 1
    watch.forget(2)
    assert policy.by_events(bad)


def test_the_window_judges_what_it_holds_as_requests_come_and_leave() -> None:
    """The sums kept request by request are those of the window's requests (zeros too,
    which count as nothing), through the window's turnover and a clear."""
    rng = random.Random(3)
    monitor = HitRateMonitor(window=20, min_requests=5)
    for n in range(400):
        if n == 250:
            monitor.clear()
        predicted, reported = rng.choice([(0, 0), (0, 64), (64, 0), (500, 400), (300, 300)])
        got = monitor.record(predicted, reported)
        relevant = [(p, a) for p, a in monitor.window if p or a]
        p_sum, a_sum = sum(p for p, _ in relevant), sum(a for _, a in relevant)
        drifts = (len(relevant) >= 5
                  and abs(p_sum - a_sum) / max(p_sum, a_sum, 1) > monitor.tolerance)
        assert (got is not None) == drifts, n
        if got is not None:
            assert (got.predicted, got.actual, got.requests) == (p_sum, a_sum, len(relevant))
