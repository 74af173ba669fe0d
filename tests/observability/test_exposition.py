"""Merging workers' Prometheus text into one scrape (sans-IO), checked by the official parser."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from direct_frontend.observability.exposition import labelled, merge


def worker_text(requests: int, seconds: float) -> str:
    disable_created_metrics()  # type: ignore[no-untyped-call]  # as the daemon does
    registry = CollectorRegistry()
    Counter("df_requests", "Requests.", ("status",), registry=registry).labels("200").inc(
        requests)
    Gauge("df_up", "Up.", registry=registry).set(1)
    Histogram("df_latency_seconds", "Latency.", buckets=(0.1, 1.0),
              registry=registry).observe(seconds)
    return generate_latest(registry).decode()


def test_labelled_puts_the_worker_first() -> None:
    assert labelled('a_total{x="1"} 3.0', 'worker="0"') == 'a_total{worker="0",x="1"} 3.0'
    assert labelled("a 3.0", 'worker="0"') == 'a{worker="0"} 3.0'
    assert labelled("a{} 3.0", 'worker="0"') == 'a{worker="0"} 3.0'


def test_merged_text_parses_and_sums_to_the_service_totals() -> None:
    text = merge({"0": worker_text(3, 0.05), "1": worker_text(4, 0.5)})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"df_requests", "df_up", "df_latency_seconds"}
    requests = [s for s in families["df_requests"].samples if s.name == "df_requests_total"]
    assert {s.labels["worker"]: s.value for s in requests} == {"0": 3.0, "1": 4.0}
    assert sum(s.value for s in requests) == 7.0
    counts = [s.value for s in families["df_latency_seconds"].samples
              if s.name == "df_latency_seconds_count"]
    assert counts == [1.0, 1.0]
    assert text.count("# TYPE df_requests_total counter") == 1  # one header per family


def test_a_family_only_one_worker_has_is_kept() -> None:
    extra = "# HELP df_only Only here.\n# TYPE df_only gauge\ndf_only 2.0\n"
    text = merge({"0": worker_text(1, 0.1), "1": worker_text(1, 0.1) + extra})
    only = next(f for f in text_string_to_metric_families(text) if f.name == "df_only")
    assert [(s.labels, s.value) for s in only.samples] == [({"worker": "1"}, 2.0)]
