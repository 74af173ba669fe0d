"""deploy/grafana/direct-frontend.json asks only for series the daemon exports.

Every PromQL expression of the dashboard (panel targets and template variables) is read
for the metric names it selects and the labels it matches or groups by; each name must be
a sample name the daemon's registry exposes on ``/metrics``, and each label one of that
metric's labels (or a label Prometheus adds to every scraped series). The reader is a
small PromQL tokenizer, tested on expressions first; it is enough for the selectors,
ranges, groupings and functions a dashboard uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.observability.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "direct-frontend.json"
#: labels Prometheus attaches to every series it scrapes (the target's)
TARGET_LABELS = frozenset({"instance", "job"})
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                      "and", "or", "unless", "offset", "inf", "nan"})
STRING = r'"(?:[^"\\]|\\.)*"'  # a PromQL string, with its backslash escapes
MATCHERS = re.compile(rf"(?P<name>[A-Za-z_:][\w:]*)?\s*\{{(?P<body>(?:[^}}\"]|{STRING})*)\}}")
MATCHER_LABEL = re.compile(rf"(?P<label>[A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*{STRING}")
GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\((?P<labels>[^)]*)\)")
IDENTIFIER = re.compile(r"(?<![\w:.\"$])(?P<name>[A-Za-z_:][\w:]*)(?!\s*\()(?![\w:])")
LABEL_VALUES = re.compile(
    r"^label_values\(\s*(?P<metric>[A-Za-z_:][\w:]*)\s*,\s*(?P<label>\w+)\s*\)$")


def read(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression selects, and every label it matches or groups by."""
    found = LABEL_VALUES.match(expr.strip())
    if found:
        return {found["metric"]}, {found["label"]}
    names: set[str] = set()
    labels: set[str] = set()

    def selector(match: re.Match[str]) -> str:
        labels.update(m["label"] for m in MATCHER_LABEL.finditer(match["body"]))
        if match["name"]:
            names.add(match["name"])
        return " "

    rest = MATCHERS.sub(selector, expr)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range selectors and subqueries
    for group in GROUPING.finditer(rest):
        labels.update(label.strip() for label in group["labels"].split(",") if label.strip())
    rest = GROUPING.sub(" ", rest)
    rest = re.sub(STRING, " ", rest)  # string arguments
    names.update(m["name"] for m in IDENTIFIER.finditer(rest) if m["name"] not in KEYWORDS)
    return names, labels


def exported() -> dict[str, frozenset[str]]:
    """Each sample name of the daemon's /metrics, with its metric's label names."""
    registry = Metrics().registry
    out: dict[str, set[str]] = {}
    # The label names of a labelled metric with no child yet are on the metric object only:
    # the registry's collector-to-names map is where prometheus_client keeps both.
    for collector, names in registry._collector_to_names.items():
        for name in names:
            out.setdefault(name, set()).update(getattr(collector, "_labelnames", ()))
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(set(sample.labels) - {"le", "quantile"})
    return {name: frozenset(labels) for name, labels in out.items()}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets (rows' panels too) and query variables."""
    out: list[str] = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        out.extend(target["expr"] for target in panel.get("targets", []))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def problems(exprs: list[str], have: dict[str, frozenset[str]]) -> list[str]:
    """What in ``exprs`` the exported series ``have`` do not provide."""
    found: list[str] = []
    for expr in exprs:
        names, labels = read(expr)
        allowed = set(TARGET_LABELS)
        for name in names:
            if name in have:
                allowed |= have[name]
                allowed |= {"le"} if name.endswith("_bucket") else set()
            else:
                found.append(f"{name} is not exported ({expr})")
        found.extend(f"label {label} is on none of {sorted(names)} ({expr})"
                     for label in sorted(labels - allowed))
    return found


# The reader, on expressions first.

@pytest.mark.parametrize(("expr", "names", "labels"), [
    ("sum by (endpoint, code) (rate(a_total{instance=~\"$instance\"}[$__rate_interval]))",
     {"a_total"}, {"endpoint", "code", "instance"}),
    ("histogram_quantile(0.99, sum by (le) (rate(b_bucket[5m])))", {"b_bucket"}, {"le"}),
    ("sum(rate(a_total{code=~\"5..\", x!=\"}\\\"}\"}[1m])) / sum(rate(a_total[1m]))",
     {"a_total"}, {"code", "x"}),
    ("max by (instance) (up) or vector(0)", {"up"}, {"instance"}),
    ("c offset 5m > bool 1", {"c"}, set()),
    ("label_values(d, instance)", {"d"}, {"instance"}),
])
def test_the_reader_finds_names_and_labels(expr: str, names: set[str], labels: set[str]) -> None:
    assert read(expr) == (names, labels)


def test_a_misspelt_name_or_label_is_a_problem() -> None:
    have = {"a_total": frozenset({"endpoint", "code"}), "b_bucket": frozenset()}
    assert problems(["sum by (endpoint) (rate(a_total[1m]))"], have) == []
    assert problems(["histogram_quantile(0.5, sum by (le) (rate(b_bucket[1m])))"], have) == []
    assert len(problems(["rate(a_totl[1m])"], have)) == 1
    assert len(problems(["sum by (model) (rate(a_total[1m]))"], have)) == 1
    assert len(problems(["sum by (le) (rate(a_total[1m]))"], have)) == 1


# The dashboard.

def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_every_query_of_the_dashboard_names_what_the_daemon_exports() -> None:
    have = exported()
    assert "direct_frontend_requests_total" in have  # the registry is the daemon's
    assert problems(expressions(dashboard()), have) == []


def test_the_dashboard_has_the_usual_panels() -> None:
    """Traffic, latency quantiles, load, engines, tokens, KV prediction, replicas, process."""
    used: set[str] = set()
    for expr in expressions(dashboard()):
        used |= read(expr)[0]
    assert {
        "direct_frontend_requests_total",
        "direct_frontend_request_duration_seconds_bucket",
        "direct_frontend_time_to_first_token_seconds_bucket",
        "direct_frontend_inter_token_latency_seconds_bucket",
        "direct_frontend_in_flight_requests",
        "direct_frontend_engine_state",
        "direct_frontend_model_prompt_tokens_total",
        "direct_frontend_model_completion_tokens_total",
        "direct_frontend_kv_predicted_cached_tokens_total",
        "direct_frontend_kv_reported_cached_tokens_total",
        "direct_frontend_replica_degraded",
        "direct_frontend_build_info",
        "direct_frontend_admission_queue_depth",
        "direct_frontend_admission_wait_seconds_bucket",
        "process_resident_memory_bytes",
    } <= used


def test_the_dashboard_is_importable() -> None:
    """Unique panel ids, a grid position each, and queries on the dashboard's data source."""
    board = dashboard()
    panels = board["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    variables = {variable["name"] for variable in board["templating"]["list"]}
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            uid = target["datasource"]["uid"]
            assert uid.startswith("${") and uid[2:-1] in variables
