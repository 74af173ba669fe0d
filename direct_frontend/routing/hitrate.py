"""Is KV routing working? Predicted cache overlap against what the engines report (sans-IO).

For every request the router predicted how many prompt tokens the chosen
engine holds; the engine reports ``cached_tokens``. When they drift apart
(the router hashes different tokens than the engine caches: another chat
template or tokenizer, a wrong block size, lost events) KV routing silently
degrades into random routing. One monitor per engine incarnation keeps a
rolling window and says so, loudly and with the likely cause, and the engine
is then routed by the approximate memory instead of its events (until the KV
plane rebuilds its entries).

The threshold: the window's summed prediction and report may differ by 15 %
of the larger. A systematic drift of 20 % (a prediction 1.2× or 1/1.2× the
report) is 17 % of the larger and crosses it; per-request noise (a block
evicted between the decision and the engine's lookup, a race with a
concurrent prefill) averages out over the window of 100 requests (judged from 60 on:
over fewer, a cold start's first misses alone reached 16 % in scripts/routing_sim.py).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable

from direct_frontend.observability.metrics import Metrics
from direct_frontend.routing.catalog import EngineHandle

log = logging.getLogger("direct_frontend.http")  # the name these warnings always had

#: a drifting prediction is logged at most this often (it is also a gauge)
WARN_EVERY_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    predicted: int
    actual: int
    requests: int
    message: str


class HitRateMonitor:
    """Rolling comparison of predicted vs reported cached tokens.

    The window's sums over its relevant requests (those with a prediction or a
    report) are kept as requests come and leave, so a request costs a step,
    not a pass over the window.
    """

    def __init__(self, window: int = 100, min_requests: int = 60, tolerance: float = 0.15) -> None:
        self.window: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
        self.min_requests = min_requests
        self.tolerance = tolerance
        self.predicted_total = 0
        self.actual_total = 0
        self._relevant = 0  # the window's requests with a prediction or a report
        self._predicted = 0  # their predictions' sum
        self._actual = 0  # their reports' sum

    def record(self, predicted_tokens: int, actual_tokens: int) -> Divergence | None:
        """Add one finished request; returns a :class:`Divergence` while the window drifts."""
        self.predicted_total += predicted_tokens
        self.actual_total += actual_tokens
        window = self.window
        if window and len(window) == window.maxlen:
            self._count(*window[0], -1)  # (the oldest leaves as this one comes)
        window.append((predicted_tokens, actual_tokens))
        self._count(predicted_tokens, actual_tokens, 1)
        return self.check()

    def _count(self, predicted: int, actual: int, sign: int) -> None:
        if predicted or actual:
            self._relevant += sign
            self._predicted += sign * predicted
            self._actual += sign * actual

    def clear(self) -> None:
        """Empty the window (what it judges starts afresh)."""
        self.window.clear()
        self._relevant = self._predicted = self._actual = 0

    def check(self) -> Divergence | None:
        relevant = self._relevant
        if relevant < self.min_requests:
            return None
        predicted, actual = self._predicted, self._actual
        scale = max(predicted, actual, 1)
        if abs(predicted - actual) / scale <= self.tolerance:
            return None
        if actual < predicted:
            cause = (
                "engines cache less than the router predicts: lost KV events, a block size "
                "that differs from the engines', or a chat template/tokenizer that differs "
                "from the engines'"
            )
        else:
            cause = (
                "engines report more cache hits than predicted: KV events are missing or "
                "not configured for some engines, or the block size is too large"
            )
        return Divergence(
            predicted, actual, relevant,
            f"KV routing prediction diverges from the engines: predicted {predicted} cached "
            f"tokens, engines reported {actual} over the last {relevant} requests; {cause}",
        )


class HitRateWatch:
    """The hit-rate check of every request the router predicted, per engine, in metrics and log.

    ``diverged`` is the set of engine incarnations whose prediction drifted:
    the KV-aware policy routes them by its approximate memory (it holds the
    same set object). The KV plane discards an incarnation from it when it
    rebuilds that engine's entries.
    """

    def __init__(
        self,
        metrics: Metrics,
        diverged: set[int] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        monitor: Callable[[], HitRateMonitor] = HitRateMonitor,
    ) -> None:
        self.metrics = metrics
        self.diverged: set[int] = set() if diverged is None else diverged
        self.clock = clock
        self._new_monitor = monitor
        self.monitors: dict[int, HitRateMonitor] = {}
        self._warned_at: dict[int, float] = {}
        self._drifting: set[int] = set()  # whose window diverges now

    def record(self, predicted: int, reported: int, engine: EngineHandle | None = None) -> None:
        """One request: predicted vs engine-reported cached tokens; loud when they drift."""
        metrics = self.metrics
        metrics.kv_predicted_cached_tokens_total.inc(predicted)
        metrics.kv_reported_cached_tokens_total.inc(reported)
        key = -1 if engine is None else engine.incarnation
        monitor = self.monitors.get(key)
        if monitor is None:
            monitor = self.monitors[key] = self._new_monitor()
        divergence = monitor.record(predicted, reported)
        if divergence is not None and engine is not None and key not in self.diverged:
            self.diverged.add(key)
            monitor.clear()  # judge what it is routed by now afresh
            log.warning("engine %s: %s; routing it by the approximate prefix memory from now on",
                        engine.name, divergence.message, extra={
                            "engine": engine.name, "predicted_tokens": divergence.predicted,
                            "reported_tokens": divergence.actual,
                        })
            self._warned_at[key] = self.clock()
        elif divergence is not None:
            now = self.clock()
            if now - self._warned_at.get(key, -math.inf) > WARN_EVERY_S:
                self._warned_at[key] = now
                log.warning("%s", divergence.message, extra={
                    "predicted_tokens": divergence.predicted, "reported_tokens": divergence.actual,
                })
        if divergence is None:
            self._drifting.discard(key)
        else:
            self._drifting.add(key)
        metrics.kv_prediction_diverged.set(len(self.diverged | self._drifting))

    def forget(self, incarnation: int) -> None:
        """An engine incarnation is gone: drop its window."""
        self.monitors.pop(incarnation, None)
        self._warned_at.pop(incarnation, None)
        self._drifting.discard(incarnation)
        self.diverged.discard(incarnation)
