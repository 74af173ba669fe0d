"""Is KV routing working? Predicted cache overlap against what the engines report (sans-IO).

For every request the router predicted how many prompt tokens the chosen
engine holds; the engine reports ``cached_tokens``. When they drift apart
(the router hashes different tokens than the engine caches: another chat
template or tokenizer, a wrong block size, lost events) KV routing silently
degrades into random routing. This monitor keeps a rolling window and says
so, loudly and with the likely cause.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable

from direct_frontend.observability.metrics import Metrics

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
    """Rolling comparison of predicted vs reported cached tokens."""

    def __init__(self, window: int = 200, min_requests: int = 20, tolerance: float = 0.5) -> None:
        self.window: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
        self.min_requests = min_requests
        self.tolerance = tolerance
        self.predicted_total = 0
        self.actual_total = 0

    def record(self, predicted_tokens: int, actual_tokens: int) -> Divergence | None:
        """Add one finished request; returns a :class:`Divergence` while the window drifts."""
        self.predicted_total += predicted_tokens
        self.actual_total += actual_tokens
        self.window.append((predicted_tokens, actual_tokens))
        return self.check()

    def check(self) -> Divergence | None:
        relevant = [(p, a) for p, a in self.window if p or a]
        if len(relevant) < self.min_requests:
            return None
        predicted = sum(p for p, _ in relevant)
        actual = sum(a for _, a in relevant)
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
            predicted, actual, len(relevant),
            f"KV routing prediction diverges from the engines: predicted {predicted} cached "
            f"tokens, engines reported {actual} over the last {len(relevant)} requests; {cause}",
        )


class HitRateWatch:
    """The hit-rate check of every request the router predicted, in the metrics and the log."""

    def __init__(
        self,
        metrics: Metrics,
        monitor: HitRateMonitor | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.monitor = monitor if monitor is not None else HitRateMonitor()
        self.clock = clock
        self._warned_at = -math.inf

    def record(self, predicted: int, reported: int) -> None:
        """One request: predicted vs engine-reported cached tokens; loud when they drift."""
        metrics = self.metrics
        metrics.kv_predicted_cached_tokens_total.inc(predicted)
        metrics.kv_reported_cached_tokens_total.inc(reported)
        divergence = self.monitor.record(predicted, reported)
        metrics.kv_prediction_diverged.set(1 if divergence else 0)
        now = self.clock()
        if divergence is not None and now - self._warned_at > WARN_EVERY_S:
            self._warned_at = now
            log.warning("%s", divergence.message, extra={
                "predicted_tokens": divergence.predicted, "reported_tokens": divergence.actual,
            })
