"""The per-request counters and histograms (observability/tallies.py) read exactly as
prometheus_client's own do, and refuse what those refuse."""

from __future__ import annotations

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from direct_frontend.observability.tallies import CounterFamily, HistogramFamily

BUCKETS = (0.0, 0.001, 0.5, 1.0, 120.0, 1e7)


def _theirs_and_ours() -> tuple[bytes, bytes]:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    count = Counter("x_requests_total", "Requests.", ("endpoint", "code"), registry=theirs)
    plain = Counter("x_tokens_total", "Tokens.", registry=theirs)
    spread = Histogram("x_wait_seconds", "Waits.", ("model",), buckets=BUCKETS, registry=theirs)
    lone = Histogram("x_ttft_seconds", "TTFT.", buckets=BUCKETS, registry=theirs)
    our_count = CounterFamily("x_requests_total", "Requests.", ("endpoint", "code"))
    our_plain = CounterFamily("x_tokens_total", "Tokens.")
    our_spread = HistogramFamily("x_wait_seconds", "Waits.", ("model",), buckets=BUCKETS)
    our_lone = HistogramFamily("x_ttft_seconds", "TTFT.", buckets=BUCKETS)
    for collector in (our_count, our_plain, our_spread, our_lone):
        ours.register(collector)
    for counter in (count, our_count):
        counter.labels("chat", 200).inc()
        counter.labels("chat", 200).inc(2)
        counter.labels("completion", "429").inc()
    for counter in (plain, our_plain):
        counter.inc(16)
    for histogram in (spread, our_spread):
        for value in (0.0, 0.001, 0.0011, 0.5, 3.0, 2e7):  # on a bound counts in its bucket
            histogram.labels("demo").observe(value)
        histogram.labels("other").observe(0.2)
        histogram.labels("gone").observe(1.0)
        histogram.remove("gone")
    for histogram in (lone, our_lone):
        histogram.observe(0.25)
    return generate_latest(theirs), generate_latest(ours)


def test_the_families_read_as_prometheus_clients_own() -> None:
    disable_created_metrics()  # type: ignore[no-untyped-call]  # as the daemon's Metrics does
    theirs, ours = _theirs_and_ours()
    assert ours == theirs
    assert b'x_wait_seconds_bucket{le="0.001",model="demo"} 2.0' in ours


def test_the_families_refuse_what_prometheus_client_refuses() -> None:
    counter = CounterFamily("x_total", "X.", ("a",))
    with pytest.raises(ValueError, match="labels"):
        counter.labels("one", "two")
    with pytest.raises(ValueError, match="has labels"):
        counter.inc()
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("one").inc(-1)
    with pytest.raises(KeyError):
        counter.remove("never")
    with pytest.raises(ValueError, match="sorted"):
        HistogramFamily("y", "Y.", buckets=(1.0, 0.5))
    with pytest.raises(ValueError, match="has labels"):
        HistogramFamily("z", "Z.", ("m",), buckets=BUCKETS).observe(1.0)
