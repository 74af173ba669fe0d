"""Response rendering (checked with the official openai types), metrics and logging."""

from __future__ import annotations

import re

import pytest

from direct_frontend.errors import ErrorKind
from direct_frontend.observability import shims
from direct_frontend.observability.metrics import ENGINE_STATES, Metrics
from direct_frontend.observability.shims import ShimStatus
from tests.support.metrics import sample

MODEL = 'org/model "v2"'  # quotes prove the model name is JSON-escaped


def test_metrics_render_all_names() -> None:
    m = Metrics()
    m.request_started()
    m.request_finished("chat", 200, 0.5)
    m.observe_ttft(0.05)
    m.observe_inter_token(0.02, 1)
    m.add_tokens(10, 20)
    m.request_cancelled()
    m.set_engine_state("e1", "serving")
    m.set_engine_in_flight("e1", 3)
    m.engine_request("e1", "ok")
    m.malformed_engine_message("e1")
    m.engine_error("e1", ErrorKind.TIMEOUT)
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in (
        "requests_total",
        "request_duration_seconds",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "in_flight_requests",
        "engine_state",
        "engine_in_flight",
        "engine_requests_total",
        "prompt_tokens_total",
        "completion_tokens_total",
        "cancelled_requests_total",
        "malformed_engine_messages_total",
        "engine_errors_total",
        "shim_active",
    ):
        base = "direct_frontend_" + name.removesuffix("_total")
        assert re.search(rf"^# TYPE {base}(_total)? ", text, re.MULTILINE), name
    assert "_created" not in text  # noise series are off
    assert sample(text, "direct_frontend_requests_total", code="200", endpoint="chat") == 1
    assert sample(text, "direct_frontend_request_duration_seconds_count", endpoint="chat") == 1
    assert sample(text, "direct_frontend_in_flight_requests") == 0
    assert sample(text, "direct_frontend_prompt_tokens_total") == 10
    assert sample(text, "direct_frontend_completion_tokens_total") == 20
    assert sample(text, "direct_frontend_cancelled_requests_total") == 1
    assert sample(text, "direct_frontend_engine_in_flight", engine="e1") == 3
    assert sample(text, "direct_frontend_engine_requests_total", engine="e1", outcome="ok") == 1
    assert sample(text, "direct_frontend_malformed_engine_messages_total", engine="e1") == 1
    assert sample(text, "direct_frontend_engine_errors_total", engine="e1", kind="timeout") == 1
    assert sample(text, "direct_frontend_time_to_first_token_seconds_count") == 1


def test_shim_active_is_read_from_the_shims_at_each_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shims, "_REPORTS", {})
    reader = [ShimStatus("grpclib_reader", True, "grpclib 0.4.9")]
    shims.register("grpclib_reader", lambda: reader[0])
    shims.register("hypercorn_coalesce", lambda: ShimStatus("hypercorn_coalesce", False, "x"))
    m = Metrics()
    text = m.render()[0].decode()
    assert "# TYPE direct_frontend_shim_active gauge" in text
    assert sample(text, "direct_frontend_shim_active", shim="grpclib_reader") == 1
    assert sample(text, "direct_frontend_shim_active", shim="hypercorn_coalesce") == 0
    reader[0] = ShimStatus("grpclib_reader", False, "a stream differed")  # switched off since
    text = m.render()[0].decode()
    assert sample(text, "direct_frontend_shim_active", shim="grpclib_reader") == 0


def test_fresh_instances_do_not_share_state() -> None:
    a, b = Metrics(), Metrics()
    a.request_cancelled()
    assert sample(a.render()[0].decode(), "direct_frontend_cancelled_requests_total") == 1
    assert sample(b.render()[0].decode(), "direct_frontend_cancelled_requests_total") == 0


def test_inter_token_latency_splits_the_gap_per_token() -> None:
    m = Metrics()
    m.observe_inter_token(0.04, 4)  # four tokens at 10 ms each
    m.observe_inter_token(0.5, 1)
    m.observe_inter_token(0.1, 0)  # nothing to attribute
    text = m.render()[0].decode()
    name = "direct_frontend_inter_token_latency_seconds"
    assert sample(text, name + "_count") == 5
    assert sample(text, name + "_sum") == pytest.approx(0.54)
    assert sample(text, name + "_bucket", le="0.005") == 0
    assert sample(text, name + "_bucket", le="0.01") == 4  # le is inclusive
    assert sample(text, name + "_bucket", le="0.3") == 4
    assert sample(text, name + "_bucket", le="0.5") == 5
    assert sample(text, name + "_bucket", le="+Inf") == 5


def test_engine_state_is_one_hot_and_forget_engine_drops_series() -> None:
    m = Metrics()
    m.set_engine_state("e1", "joining")
    m.set_engine_state("e1", "draining")
    m.set_engine_state("e2", "serving")
    m.engine_error("e1", "protocol")
    m.kv_event_lag("e1").observe(0.003)
    m.kv_event_lag("e1").observe(0.3)
    text = m.render()[0].decode()
    lag = "direct_frontend_kv_event_lag_seconds"
    assert sample(text, lag + "_bucket", engine="e1", le="0.005") == 1
    assert sample(text, lag + "_bucket", engine="e1", le="+Inf") == 2
    assert sample(text, lag + "_sum", engine="e1") == 0.303
    for state in ENGINE_STATES:
        want = 1 if state == "draining" else 0
        assert sample(text, "direct_frontend_engine_state", engine="e1", state=state) == want
    assert sample(text, "direct_frontend_engine_state", engine="e2", state="serving") == 1
    with pytest.raises(ValueError, match="unknown engine state"):
        m.set_engine_state("e1", "sleeping")  # type: ignore[arg-type]

    m.forget_engine("e1")
    m.forget_engine("never-seen")
    text = m.render()[0].decode()
    assert 'engine="e1"' not in text
    assert sample(text, "direct_frontend_engine_state", engine="e2", state="serving") == 1


# ---------------------------------------------------------------- logging




def test_the_standard_collectors_the_build_and_the_admission_queue_are_exported() -> None:
    metrics = Metrics()
    series = metrics.model_series("demo")
    series.admitted("team-a", "default", 0.0)
    series.admitted("other", "flex", 0.3)
    series.queue_depth(5)
    text = metrics.render()[0].decode()
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total",
                 "python_info", "python_gc_objects_collected_total"):
        assert f"\n{name}" in text, name
    from direct_frontend import __version__
    assert sample(text, "direct_frontend_build_info", version=__version__) == 1
    assert sample(text, "direct_frontend_admission_queue_depth", model="demo") == 5
    assert sample(text, "direct_frontend_admission_wait_seconds_count", model="demo") == 2
    assert sample(text, "direct_frontend_admission_wait_seconds_bucket", le="0.0",
                  model="demo") == 1
    metrics.forget_model("demo")
    assert "admission_queue_depth{" not in metrics.render()[0].decode()


def test_admission_series_by_tenant_and_tier() -> None:
    """Each (tenant, tier) has its wait histogram, admitted and refused counters and queue
    depth; a depth once set reads 0 when nothing waits; forgetting the model drops them all."""
    metrics = Metrics()
    series = metrics.model_series("demo")
    series.admitted("team-a", "priority", 0.0)
    series.admitted("team-a", "priority", 0.02)
    series.admitted("other", "flex", 1.5)
    series.refused("other", "flex", "pushed_out")
    series.tenant_queue_depths({("team-a", "default"): 3})
    text = metrics.render()[0].decode()
    tenant = {"model": "demo", "tenant": "team-a", "tier": "priority"}
    assert sample(text, "direct_frontend_tenant_admitted_total", **tenant) == 2
    assert sample(text, "direct_frontend_tenant_wait_seconds_count", **tenant) == 2
    assert sample(text, "direct_frontend_tenant_wait_seconds_bucket", le="0.0", **tenant) == 1
    assert sample(text, "direct_frontend_tenant_refused_total", model="demo",
                  reason="pushed_out", tenant="other", tier="flex") == 1
    assert sample(text, "direct_frontend_tenant_queue_depth", model="demo", tenant="team-a",
                  tier="default") == 3
    assert sample(text, "direct_frontend_admission_wait_seconds_count", model="demo") == 3
    series.tenant_queue_depths({})
    text = metrics.render()[0].decode()
    assert sample(text, "direct_frontend_tenant_queue_depth", model="demo", tenant="team-a",
                  tier="default") == 0
    metrics.forget_model("demo")
    assert 'tenant="' not in metrics.render()[0].decode()
