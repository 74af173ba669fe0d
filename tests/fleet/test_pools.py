"""``[[pool]]`` tables and pods as engines (sans-IO): every error with its line, the pod rules."""

from __future__ import annotations

import dataclasses
import random
import textwrap
from pathlib import Path

import pytest

from direct_frontend.engines.neutral import EngineRole
from direct_frontend.fleet import FleetError, describe_fleet, parse_fleet
from direct_frontend.fleet.describe import to_jsonable
from direct_frontend.fleet.diff import as_in_file, diff_engines, diff_fleet_data, diff_fleets
from direct_frontend.fleet.keys import KeySources, process_sources
from direct_frontend.fleet.pools import (
    Backoff,
    PoolMembership,
    backoff_s,
    merge_pool_engines,
    parse_event,
    pod_engine,
    selector_problem,
    watch_params,
    watch_seconds,
)
from direct_frontend.fleet.schema import FleetConfig, KubernetesConfig, PoolConfig
from tests.support.kube import matches, pod, set_ready

SOURCE = Path("/srv/fleet/fleet.toml")

FRONTEND = textwrap.dedent("""\
    [frontend]
    served_model_name = "demo"
    tokenizer = "tok"
    """)

POOLS = FRONTEND + textwrap.dedent("""\

    [frontend.kubernetes]
    context = "prod"
    wait_for_pods = true

    [[engine]]
    url = "grpc://10.0.0.1:50051"
    kind = "sglang"

    [[pool]]
    name = "decode"
    namespace = "inference"
    selector = "app=vllm,role in (decode, both)"
    kind = "vllm"
    port = 50051
    kv_events_port = 5557
    kv_replay_port = 5558
    block_size = 16

    [[pool]]
    name = "prefill"
    selector = "app=sglang-prefill"
    kind = "sglang"
    role = "prefill"
    bootstrap_port = 8998
    """)


def parse(text: str) -> FleetConfig:
    return parse_fleet(text, SOURCE)


def problems(text: str) -> list[str]:
    with pytest.raises(FleetError) as caught:
        parse(text)
    return [str(p) for p in caught.value.problems]


def test_pools_and_static_engines_mix() -> None:
    fleet = parse(POOLS)
    assert [e.name for e in fleet.engines] == ["10.0.0.1:50051"]
    decode, prefill = fleet.pools
    assert decode == PoolConfig(name="decode", namespace="inference",
                                selector="app=vllm,role in (decode, both)", kind="vllm",
                                port=50051, kv_events_port=5557, kv_replay_port=5558,
                                block_size=16)
    assert prefill.role is EngineRole.PREFILL and prefill.namespace == "default"
    assert fleet.frontend.kubernetes.wait_for_pods and fleet.frontend.kubernetes.context == "prod"


def test_a_fleet_of_pools_only_is_not_empty() -> None:
    text = FRONTEND + '\n[[pool]]\nname = "p"\nselector = "app=x"\nkind = "sglang"\n'
    assert parse(text).engines == ()


def test_every_pool_problem_has_its_line_and_field() -> None:
    text = FRONTEND + textwrap.dedent("""\

        [[pool]]
        name = "Bad Name"
        namespace = "Not_A_Namespace"
        selector = "app=,=x"
        kind = "trtllm"
        role = "prefill"
        port = 70000
        kv_replay_port = 5558
        model = "nope"
        colour = "blue"

        [[pool]]
        name = "p"
        kind = "sglang"
        selector = "app=a"

        [[pool]]
        name = "p"
        selector = "app=b"
        """)
    assert problems(text) == [
        "/srv/fleet/fleet.toml:6: pool[1].name: 'Bad Name' is not a DNS label (a-z, 0-9, '-')",
        "/srv/fleet/fleet.toml:7: pool[1].namespace: 'Not_A_Namespace' is not a namespace name",
        "/srv/fleet/fleet.toml:8: pool[1].selector: '=x' is not a label requirement"
        " (key=value, key!=value, key in (a,b), key)",
        "/srv/fleet/fleet.toml:10: pool[1].role: trtllm engines have no P/D roles;"
        ' use role = "both"',
        "/srv/fleet/fleet.toml:11: pool[1].port: must be between 1 and 65535, got 70000",
        "/srv/fleet/fleet.toml:12: pool[1].kv_replay_port: needs kv_events_port"
        " (replay serves events)",
        "/srv/fleet/fleet.toml:13: pool[1].model: 'nope' names no [[model]] (models: demo)",
        "/srv/fleet/fleet.toml:14: pool[1].colour: unknown key (expected one of: name, namespace,"
        " selector, kind, role, model, port, port_annotation, kv_events_port,"
        " kv_events_annotation, kv_replay_port, kv_replay_annotation, dp_ranks,"
        " context_length, block_size, bootstrap_port)",
        "/srv/fleet/fleet.toml:21: pool[3].kind: required key is missing",
        "/srv/fleet/fleet.toml:22: pool[3].name: 'p' is already used by pool[2]",
    ]


@pytest.mark.parametrize("selector", [
    "app=vllm", "app==vllm,tier!=cpu", "role in (decode, both)", "gpu", "!legacy",
    "app.kubernetes.io/name=engine", "a in (x),b notin (y,z)",
])
def test_label_selectors_the_api_server_takes(selector: str) -> None:
    assert selector_problem(selector) is None


@pytest.mark.parametrize("selector", ["app=a=b", "=x", "a b", "in (x)", "app=vllm,"])
def test_label_selectors_it_refuses(selector: str) -> None:
    assert selector_problem(selector) is not None


def test_the_double_matches_selectors_as_the_api_server_does() -> None:
    labels = {"app": "vllm", "role": "decode"}
    assert matches("app=vllm,role in (decode, both)", labels)
    assert not matches("app=vllm,role notin (decode)", labels)
    assert matches("app!=sglang,!legacy,role", labels)
    assert not matches("gpu", labels)


POOL = PoolConfig(name="web", selector="app=engine", kind="sglang", port=50051, model="demo",
                  kv_events_port=5557, context_length=4096)


def test_a_ready_pod_with_an_ip_is_an_engine_with_the_pools_settings() -> None:
    item = pod("web-0", "10.1.2.3", None, uid="u-1")
    engine = pod_engine(POOL, item)
    assert not isinstance(engine, str)
    assert (engine.name, engine.url, engine.kind) == ("web/web-0", "grpc://10.1.2.3:50051",
                                                      "sglang")
    assert engine.kv_events == ("tcp://10.1.2.3:5557",) and engine.kv_replay == ()
    assert (engine.model, engine.context_length) == ("demo", 4096)
    assert (engine.pool, engine.pod_uid) == ("web", "u-1")


def test_annotations_win_over_the_pools_ports() -> None:
    item = pod("web-0", "fd00::5", 9000, annotations={
        "direct-frontend.io/kv-events-port": "6000", "direct-frontend.io/kv-replay-port": "6001",
    })
    engine = pod_engine(POOL, item)
    assert not isinstance(engine, str)
    assert engine.url == "grpc://[fd00::5]:9000"
    assert engine.kv_events == ("tcp://[fd00::5]:6000",)
    assert engine.kv_replay == ("tcp://[fd00::5]:6001",)


def test_a_data_parallel_pods_ranks_publish_on_the_ports_plus_their_rank() -> None:
    ranked = dataclasses.replace(POOL, dp_ranks=2, kv_replay_port=5567)
    engine = pod_engine(ranked, pod("web-0", "10.1.2.3", None))
    assert not isinstance(engine, str)
    assert engine.kv_events == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    assert engine.kv_replay == ("tcp://10.1.2.3:5567", "tcp://10.1.2.3:5568")
    high = pod("web-0", "10.1.2.3", None,
               annotations={"direct-frontend.io/kv-events-port": "65535"})
    assert pod_engine(ranked, high) == "its last data-parallel rank's KV port 65536 is not a port"


def test_why_a_pod_is_no_engine() -> None:
    no_port = PoolConfig(name="web", selector="app=engine", kind="sglang")
    terminating = pod("p", "10.0.0.1", 1)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_engine(POOL, pod("p", "10.0.0.1", 1, ready=False)) == "not Ready"
    assert pod_engine(POOL, pod("p", None, 1)) == "has no IP yet"
    assert pod_engine(POOL, terminating) == "being deleted"
    assert pod_engine(POOL, pod("p", "10.0.0.1", None,
                                annotations={"direct-frontend.io/grpc-port": "http"})) == (
        "annotation direct-frontend.io/grpc-port='http' is not a port")
    assert "no gRPC port" in str(pod_engine(no_port, pod("p", "10.0.0.1", None)))


def test_membership_follows_list_and_watch_events() -> None:
    members = PoolMembership(POOL)
    a, b = pod("a", "10.0.0.1", None), pod("b", "10.0.0.2", None, ready=False)
    members.relist([a, b], "10")
    assert [e.name for e in members.engines] == ["web/a"] and members.waiting == {"b": "not Ready"}
    members.event("MODIFIED", {**set_ready(b, True),
                               "metadata": {**b["metadata"], "resourceVersion": "11"}})
    assert [e.name for e in members.engines] == ["web/a", "web/b"]
    members.event("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "15"}})
    assert members.resource_version == "15" and len(members.engines) == 2
    members.event("DELETED", a)
    assert [e.name for e in members.engines] == ["web/b"]
    again = pod("b", "10.0.0.2", None)  # recreated: same name and address, a new UID
    members.event("DELETED", b)
    members.event("ADDED", again)
    (engine,) = members.engines
    assert engine.pod_uid == again["metadata"]["uid"] != b["metadata"]["uid"]
    members.relist([], "20")  # missing at a relist: gone
    assert members.engines == () and members.resource_version == "20"


def test_watch_events_and_410() -> None:
    assert parse_event(b'{"type":"ADDED","object":{"kind":"Pod"}}') is not None
    assert parse_event(b"") is None and parse_event(b'{"type":"ADDED"}') is None
    gone = parse_event(b'{"type":"ERROR","object":{"kind":"Status","code":410}}')
    assert gone is not None and gone.gone
    params = watch_params(POOL, "42", 240)
    assert params["allowWatchBookmarks"] == "true" and params["resourceVersion"] == "42"
    assert [backoff_s(n, 2.0) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0]


class Highest(random.Random):
    """Backoff jitter at its ceiling (the lowest is ``Lowest``): the bounds, exactly."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Lowest(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return a


def test_failures_in_a_row_back_off_with_jitter_up_to_the_ceiling() -> None:
    high, low = Backoff(2.0, Highest()), Backoff(2.0, Lowest())
    now = 0.0
    highs, lows = [], []
    for _ in range(7):  # each failure right after the retry the last one waited for
        highs.append(high.delay(now))
        lows.append(low.delay(now))
        now += highs[-1]
    assert highs == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert lows == [d / 2 for d in highs]  # the jitter spreads each delay over its upper half
    seeded = Backoff(2.0, random.Random(7))
    delays = [seeded.delay(0.0) for _ in range(7)]
    assert all(h / 2 <= d <= h for d, h in zip(delays, highs, strict=True))
    assert len(set(delays)) == len(delays)


def test_the_backoff_starts_over_only_after_a_quiet_spell() -> None:
    backoff = Backoff(10.0, Highest(), reset_after_s=60.0)
    assert [backoff.delay(t) for t in (0.0, 0.1, 0.3)] == [0.1, 0.2, 0.4]
    # 60 s after the last retry (at 0.7) is still in a row; a failure past that starts over
    assert backoff.delay(60.7) == 0.8
    assert backoff.delay(60.7 + 0.8 + 60.1) == 0.1


def test_a_watch_asks_to_end_before_it_could_fall_silent() -> None:
    """The server's last bookmark comes 2 s before the end a watch asked for."""
    assert watch_seconds(KubernetesConfig()) == 25  # 30 s of silence is a dead connection
    assert watch_seconds(KubernetesConfig(watch_timeout_s=10)) == 10
    assert watch_seconds(KubernetesConfig(watch_silence_s=300)) == 240
    assert watch_seconds(KubernetesConfig(watch_silence_s=1, watch_timeout_s=1)) == 1


def test_the_file_wins_a_clash_and_a_removed_pool_takes_its_engines() -> None:
    fleet = parse(POOLS)
    clash = pod("x", "10.0.0.1", 50051)  # the static engine's address
    decode_pool = fleet.pools[0]
    own = pod_engine(decode_pool, pod("d-0", "10.0.0.9", None))
    taken = pod_engine(decode_pool, clash)
    assert not isinstance(own, str) and not isinstance(taken, str)
    merged, _ = merge_pool_engines(fleet, {"decode": (own, taken), "gone": (own,)})
    assert [e.name for e in merged.engines] == ["10.0.0.1:50051", "decode/d-0"]
    assert merge_pool_engines(fleet, {"decode": (own, taken)})[1] == {
        "decode/x": "pool decode: grpc://10.0.0.1:50051 left out, engine 10.0.0.1:50051 has "
                    "the same URL"}
    assert merge_pool_engines(fleet, {"decode": (own,)})[1] == {}
    assert merged.file_engines == fleet.engines
    diff = diff_fleets(fleet, merged)
    assert diff.added == ("decode/d-0",) and not diff.pools_differ
    # check --against a daemon: its pods' engines are not in any file
    assert diff_fleet_data(as_in_file(to_jsonable(merged)), to_jsonable(fleet)).empty


def test_a_changed_selector_is_a_pool_change() -> None:
    before = parse(POOLS)
    after = parse(POOLS.replace('selector = "app=sglang-prefill"', 'selector = "app=p2"'))
    diff = diff_fleets(before, after)
    assert [(c.name, c.fields) for c in diff.pools_changed] == [("prefill", ("selector",))]
    assert "~ pool prefill (relisted: selector)" in diff.lines()


def test_check_shows_the_pools() -> None:
    text = describe_fleet(parse(POOLS))
    assert "pool[1] decode" in text
    assert "namespace inference, selector 'app=vllm,role in (decode, both)'" in text
    assert "annotation direct-frontend.io/grpc-port, else 50051" in text
    assert "pool[2] prefill" in text and "bootstrap_port  8998" in text


def test_the_kubernetes_example_loads() -> None:
    root = Path(__file__).resolve().parents[2]
    keys = KeySources({"DIRECT_FRONTEND_API_KEYS": "sk-from-the-secret"},
                      process_sources().read_text)  # as the pod's Secret gives them
    fleet = parse_fleet((root / "config/examples/kubernetes.toml").read_text(),
                        root / "config/examples/kubernetes.toml", sources=keys)
    assert [p.name for p in fleet.pools] == ["vllm", "prefill", "decode"]
    assert [e.name for e in fleet.engines] == ["edge"]
    assert {p.role for p in fleet.pools} == set(EngineRole)


def test_the_membership_diff_names_what_changed_of_each_engine() -> None:
    fleet = parse(FRONTEND + '\n[[pool]]\nname = "web"\nselector = "app=x"\nkind = "sglang"\n'
                  "port = 1\n")
    pool = fleet.pools[0]
    a, b = pod("a", "10.0.0.1", None), pod("b", "10.0.0.2", None)
    moved = {**b, "status": {**b["status"], "podIP": "10.0.0.3"}}
    engines = [pod_engine(pool, item) for item in (a, b, moved)]
    assert all(not isinstance(e, str) for e in engines)
    before, _ = merge_pool_engines(fleet, {"web": (engines[0], engines[1])})  # type: ignore[dict-item]
    after, _ = merge_pool_engines(fleet, {"web": (engines[2],)})  # type: ignore[dict-item]
    diff = diff_engines(before, after)
    assert (diff.added, diff.removed, diff.unchanged) == ((), ("web/a",), ())
    assert [(c.name, c.fields) for c in diff.changed] == [("web/b", ("url",))]
