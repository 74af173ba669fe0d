"""Engines join and leave from a pod watch, under streaming load (issue 13).

The API server is :class:`tests.support.kube.ApiServer` (the real list/watch
protocol on 127.0.0.1), reached through a kubeconfig file as a daemon outside
the cluster reaches it; each pod's engine is a simulator of its own on a
loopback port (its pod's IP and annotation). Every scenario runs under
streaming load with an engine that keeps serving, so no request may fail.
"""

from __future__ import annotations

import contextlib
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from direct_frontend.simulator import EngineKind
from direct_frontend.simulator.engine import SimEngine
from direct_frontend.simulator.model import TimingModel
from tests.support.daemon import Daemon, fleet_text, free_port, running_daemon, wait_for
from tests.support.http import http
from tests.support.kube import ApiServer, pod, set_ready
from tests.support.load import Load
from tests.support.sim import EngineThread

FAST = "interval_s = 0.05\ntimeout_s = 1.0\njoin_timeout_s = 3.0"
#: for fleets of many pods: 50 engines probed every 50 ms keep a daemon on a loaded machine
#: so busy that joins time out
CALM = "interval_s = 0.5\ntimeout_s = 2.0\njoin_timeout_s = 5.0"


@pytest.fixture()
def api() -> Iterator[ApiServer]:
    server = ApiServer().start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def engine(model_dir: Path, host: str = "127.0.0.1", name: str = "demo",
           kind: EngineKind = "sglang") -> Iterator[EngineThread]:
    """A pod's engine: a simulator streaming a token every 2 ms, listening on ``host``."""
    sim = SimEngine.from_model_dir(
        kind, model_dir, served_model_name=name,
        timing=TimingModel(decode_us_per_token=2000), eos_probability=0.0,
    )
    with EngineThread(sim, host) as running:
        yield running


def pod_fleet(model_dir: Path, kubeconfig: Path, selector: str = "app=engine",
              relist_s: float = 300.0, probe: str = FAST) -> str:
    return fleet_text(model_dir, [], probe=probe) + textwrap.dedent(f"""
        [frontend.kubernetes]
        kubeconfig = "{kubeconfig}"
        watch_timeout_s = 2
        relist_interval_s = {relist_s}
        max_backoff_s = 0.2

        [[pool]]
        name = "web"
        selector = "{selector}"
        kind = "sglang"
        """)


def fleet_view(daemon: Daemon) -> dict[str, Any]:
    return dict(http.get(daemon.url + "/fleet").json())


def serving(daemon: Daemon) -> set[str]:
    return {e.name for e in daemon.supervisor.catalog.engines}


def wait_serving(daemon: Daemon, names: set[str], timeout: float = 15.0) -> None:
    wait_for(lambda: serving(daemon) == names, timeout, f"serving exactly {sorted(names)}")


@contextlib.contextmanager
def two_pods(tmp_path: Path, model_dir: Path,
             api: ApiServer) -> Iterator[tuple[Daemon, EngineThread]]:
    """A daemon serving pods a and b of pool web (b's engine is yielded with the daemon)."""
    with engine(model_dir) as a, engine(model_dir) as b:
        api.put(pod("a", "127.0.0.1", a.engine.port))
        api.put(pod("b", "127.0.0.1", b.engine.port))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig"))
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/a", "web/b"})
            yield daemon, b


@contextlib.contextmanager
def under_load(daemon: Daemon) -> Iterator[Load]:
    with Load(daemon.url, clients=3) as load:
        load.wait_more(3)
        yield load
        load.wait_more(3)
    assert load.failures == []


def test_pods_join_on_ready_and_leave_on_not_ready_deletion_and_delete(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    with engine(model_dir) as a, engine(model_dir) as b:
        api.put(pod("a", "127.0.0.1", a.engine.port))
        api.put(pod("b", "127.0.0.1", b.engine.port, ready=False))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig"))
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/a"})
            assert "web/b" not in daemon.supervisor.children  # not Ready: no engine at all
            status = fleet_view(daemon)
            assert status["pools"][0]["pods_not_serving"] == {"b": "not Ready"}
            with under_load(daemon):
                api.put(set_ready(api.get("b"), True))
                wait_serving(daemon, {"web/a", "web/b"})
                api.put(set_ready(api.get("b"), False))
                wait_serving(daemon, {"web/a"})
                api.put(set_ready(api.get("b"), True))
                wait_serving(daemon, {"web/a", "web/b"})
                api.terminating("b")
                wait_serving(daemon, {"web/a"})
                wait_for(lambda: "web/b" not in daemon.supervisor.children, 10, "b withdrawn")
                api.delete("b")
                api.put(pod("b2", "127.0.0.1", b.engine.port))
                wait_serving(daemon, {"web/a", "web/b2"})
                api.delete("b2")
                wait_serving(daemon, {"web/a"})
            wait_for(lambda: set(daemon.supervisor.children) == {"web/a"}, 10, "only a left")
            assert "watch" in api.requests  # it watched, not only listed


def test_two_pods_at_one_address_are_one_engine_and_the_other_is_named_in_fleet(
    tmp_path: Path, model_dir: Path, api: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Pods sharing an IP and port (host networking, a stale pod) never collapse silently."""
    with engine(model_dir) as a:
        api.put(pod("a", "127.0.0.1", a.engine.port))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig"))
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/a"})
            api.put(pod("b", "127.0.0.1", a.engine.port))
            wait_for(lambda: "web/b" in fleet_view(daemon)["pool_clashes"], 10, "b named")
            reason = fleet_view(daemon)["pool_clashes"]["web/b"]
            assert reason == (f"pool web: grpc://127.0.0.1:{a.engine.port} left out, "
                              "engine web/a has the same URL")
            assert sum(reason in r.getMessage() for r in caplog.records) == 1  # warned once
            assert serving(daemon) == {"web/a"}
            api.delete("a")  # the address is free again: the other pod takes it
            wait_serving(daemon, {"web/b"})
            assert fleet_view(daemon)["pool_clashes"] == {}


def test_a_pod_missing_at_a_relist_is_withdrawn(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    """A delete the watch never saw (missed) is found by the periodic relist, or a 410's."""
    with engine(model_dir) as a, engine(model_dir) as b, engine(model_dir) as c:
        api.put(pod("a", "127.0.0.1", a.engine.port))
        api.put(pod("b", "127.0.0.1", b.engine.port))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig"), relist_s=1.0)
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/a", "web/b"})
            with under_load(daemon):
                api.delete("b", silent=True)  # no DELETED event: only a relist finds it
                wait_serving(daemon, {"web/a"})
                # a compaction: the next watch gets 410 Gone and relists
                api.put(pod("c", "127.0.0.1", c.engine.port), silent=True)
                api.compact()
                wait_serving(daemon, {"web/a", "web/c"})
            pool = fleet_view(daemon)["pools"][0]
            assert pool["relists"] >= 3 and pool["stale"] is False
            metrics = http.get(daemon.url + "/metrics").text
            assert re.search(r'pool_relists_total\{pool="web",reason="gone"\} [1-9]', metrics)
            assert re.search(r'pool_relists_total\{pool="web",reason="periodic"\} [1-9]', metrics)


def test_an_ip_change_is_a_new_engine(tmp_path: Path, model_dir: Path, api: ApiServer) -> None:
    with engine(model_dir) as a, engine(model_dir, host="0.0.0.0") as b:
        api.put(pod("a", "127.0.0.1", a.engine.port))
        first = api.put(pod("b", "127.0.0.1", b.engine.port))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig"))
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/a", "web/b"})
            before = daemon.supervisor.children["web/b"].incarnation
            with under_load(daemon):
                moved = api.get("b")
                moved["status"]["podIP"] = "127.0.0.2"
                moved["status"]["podIPs"] = [{"ip": "127.0.0.2"}]
                api.put(moved)
                wait_for(lambda: daemon.supervisor.children["web/b"].cfg.url
                         == f"grpc://127.0.0.2:{b.engine.port}", 10, "b's new address")
                wait_serving(daemon, {"web/a", "web/b"})
            child = daemon.supervisor.children["web/b"]
            assert child.incarnation > before
            assert child.cfg.pod_uid == first["metadata"]["uid"]
            wait_for(lambda: len(daemon.supervisor.incarnations) == 2, 10, "the old b gone")


def test_a_ready_pod_not_answering_or_serving_another_model_never_serves(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    silent_port = free_port()
    with engine(model_dir) as a, engine(model_dir, name="other") as wrong:
        api.put(pod("a", "127.0.0.1", a.engine.port))
        api.put(pod("silent", "127.0.0.1", silent_port))
        api.put(pod("wrong", "127.0.0.1", wrong.engine.port))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig"))
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/a"})  # the silent pod never held up the others
            with under_load(daemon):
                wait_for(lambda: "other" in (daemon.supervisor.children["web/wrong"].last_error
                                             or ""), 10, "the wrong model refused")
                engines = {e["name"]: e for e in fleet_view(daemon)["engines"]}
                assert engines["web/wrong"]["state"] == "refused"
                assert "serves model 'other'" in engines["web/wrong"]["last_error"]
                assert engines["web/silent"]["state"] == "joining"
                assert http.get(daemon.url + "/ready").status_code == 200
                late = SimEngine.from_model_dir("sglang", model_dir, served_model_name="demo",
                                                timing=TimingModel(), eos_probability=0.0)
                with EngineThread(late, port=silent_port):  # the port its pod advertises
                    wait_serving(daemon, {"web/a", "web/silent"})
                    api.delete("silent")
                    wait_serving(daemon, {"web/a"})
            assert serving(daemon) == {"web/a"}


def test_the_api_server_going_away_removes_nothing(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    with two_pods(tmp_path, model_dir, api) as (daemon, _):
        with under_load(daemon) as load:
            api.stop()
            wait_for(lambda: fleet_view(daemon)["pools"][0]["stale"], 10, "stale")
            metrics = http.get(daemon.url + "/metrics").text
            assert 'pool_membership_stale{pool="web"} 1.0' in metrics

            def errors() -> float:
                text = http.get(daemon.url + "/metrics").text
                found = re.search(r'pool_watch_errors_total\{pool="web"\} (\S+)', text)
                return float(found[1]) if found else 0.0

            wait_for(lambda: errors() >= 5, 15, "several failed reconnects")
            load.wait_more(5)
            assert serving(daemon) == {"web/a", "web/b"}  # down a while: nothing removed
            api.delete("b", silent=True)  # what happened while it was away ...
            api.start()  # ... the relist after it comes back finds
            wait_serving(daemon, {"web/a"})
            wait_for(lambda: not fleet_view(daemon)["pools"][0]["stale"], 10, "fresh")
        metrics = http.get(daemon.url + "/metrics").text
        assert 'pool_membership_stale{pool="web"} 0.0' in metrics


def test_the_same_address_removed_and_readded_fast_is_fenced_by_incarnation(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    with two_pods(tmp_path, model_dir, api) as (daemon, b):
        with under_load(daemon):
            for _ in range(5):  # a StatefulSet pod recreated: same name, IP and port
                old = daemon.supervisor.children["web/b"]
                api.delete("b")
                again = api.put(pod("b", "127.0.0.1", b.engine.port))
                uid = again["metadata"]["uid"]
                wait_for(lambda uid=uid: daemon.supervisor.children.get("web/b") is not None
                         and daemon.supervisor.children["web/b"].cfg.pod_uid == uid, 10,
                         "the new b")
                assert daemon.supervisor.children["web/b"].incarnation > old.incarnation
                wait_serving(daemon, {"web/a", "web/b"})
        wait_for(lambda: len(daemon.supervisor.incarnations) == 2, 10, "old ones gone")
        owners = {e.name: e.incarnation for e in daemon.supervisor.catalog.engines}
        assert owners["web/b"] == daemon.supervisor.children["web/b"].incarnation


def test_a_reload_that_changes_the_selector_reconciles_the_pool(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    with engine(model_dir) as blue, engine(model_dir) as green:
        api.put(pod("blue", "127.0.0.1", blue.engine.port,
                    labels={"app": "engine", "track": "blue"}))
        api.put(pod("green", "127.0.0.1", green.engine.port,
                    labels={"app": "engine", "track": "green"}))
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
        text = pod_fleet(model_dir, kubeconfig, selector="app=engine,track=blue")
        with running_daemon(tmp_path, text, watch_interval_s=None) as daemon:
            wait_serving(daemon, {"web/blue"})
            with under_load(daemon):
                path = tmp_path / "fleet.toml"
                blue_life = daemon.supervisor.children["web/blue"].incarnation
                path.write_text(text.replace("relist_interval_s = 300.0",
                                             "relist_interval_s = 200.0"))
                result = http.post(daemon.url + "/fleet/reload").json()
                assert result["ok"] and result["diff"]["removed"] == []  # the pods' engines stay
                assert result["diff"]["live"] == ["kubernetes.relist_interval_s"]
                assert daemon.supervisor.children["web/blue"].incarnation == blue_life
                path.write_text(pod_fleet(model_dir, kubeconfig, selector="track in (green)"))
                result = http.post(daemon.url + "/fleet/reload").json()
                assert result["ok"] and result["diff"]["pools_changed"] == [
                    {"name": "web", "fields": ["selector"]}
                ]
                wait_serving(daemon, {"web/green"})
            assert set(daemon.supervisor.children) == {"web/green"}


def test_wait_for_pods_holds_ready_until_each_pool_serves(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    with engine(model_dir) as a:
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig")).replace(
            "max_backoff_s = 0.2", "max_backoff_s = 0.2\nwait_for_pods = true"
        )
        text += textwrap.dedent(f"""
            [[engine]]
            name = "static"
            url = "grpc://127.0.0.1:{free_port()}"
            kind = "sglang"
            simulate = true
            """)
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"static"})
            ready = http.get(daemon.url + "/ready")
            assert ready.status_code == 503 and ready.json()["waiting_for_pools"] == ["web"]
            api.put(pod("a", "127.0.0.1", a.engine.port))
            wait_serving(daemon, {"static", "web/a"})
            assert http.get(daemon.url + "/ready").status_code == 200
            api.delete("a")  # start-up only: a pool emptied later does not hold /ready
            wait_serving(daemon, {"static"})
            assert http.get(daemon.url + "/ready").status_code == 200


def test_a_thousand_pods_churning_leave_nothing_behind(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    """1,000 pods through Ready and deletion in waves; every incarnation and series is freed."""
    with engine(model_dir) as a, engine(model_dir, host="0.0.0.0") as many:
        api.put(pod("a", "127.0.0.1", a.engine.port))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig"), probe=CALM)
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/a"})
            with under_load(daemon):
                for wave in range(5):
                    names = [f"p{wave}-{i}" for i in range(200)]
                    for i, name in enumerate(names):  # 200 pods at 127.0.<wave+1>.<i+1>
                        api.put(pod(name, f"127.0.{wave + 1}.{i + 1}", many.engine.port,
                                    ready=False))
                    for name in names[:50]:
                        api.put(set_ready(api.get(name), True))
                    wait_for(lambda: len(serving(daemon)) == 51, 30, "50 pods serving")
                    for name in names:
                        api.delete(name)
                    wait_for(lambda: set(daemon.supervisor.children) == {"web/a"}, 30,
                             "the wave gone")
            wait_for(lambda: len(daemon.supervisor.incarnations) == 1, 30, "incarnations freed")
            pool = fleet_view(daemon)["pools"][0]
            assert pool["engines"] == ["web/a"] and pool["pods_not_serving"] == {}
            assert pool["events"] >= 1000
            metrics = http.get(daemon.url + "/metrics").text
            assert 'engine="web/p' not in metrics  # the engines' series forgotten


def test_a_pods_kv_events_feed_the_index_until_it_leaves(
    tmp_path: Path, model_dir: Path, api: ApiServer
) -> None:
    """KV-event and replay ports from the pod's annotations; a withdrawn pod leaves the index."""
    sim = SimEngine.from_model_dir(
        "vllm", model_dir, served_model_name="demo", timing=TimingModel(),
        eos_probability=0.0, block_size=16, kv_events_port=0, kv_replay_port=0,
    )
    with engine(model_dir, kind="vllm") as other, EngineThread(sim) as cached:
        assert sim.kv_events_endpoint is not None and sim.kv_replay_endpoint is not None
        events = sim.kv_events_endpoint.rsplit(":", 1)[1]
        replay = sim.kv_replay_endpoint.rsplit(":", 1)[1]
        api.put(pod("kv", "127.0.0.1", cached.engine.port, annotations={
            "direct-frontend.io/kv-events-port": events,
            "direct-frontend.io/kv-replay-port": replay,
        }))
        text = pod_fleet(model_dir, api.kubeconfig(tmp_path / "kubeconfig")).replace(
            "[frontend.probe]", '[frontend.routing]\npolicy = "kv_aware"\n\n'
            "[frontend.routing.knobs]\nblock_size = 16\n\n[frontend.probe]")
        text = text.replace('kind = "sglang"', 'kind = "vllm"\nblock_size = 16')
        with running_daemon(tmp_path, text) as daemon:
            wait_serving(daemon, {"web/kv"})
            kv = daemon.supervisor.kv
            child = daemon.supervisor.children["web/kv"]
            assert child.cfg.kv_events == (f"tcp://127.0.0.1:{events}",)
            wait_for(lambda: len(kv.live) == 1, 10, "the pod's KV subscription")
            r = http.post(daemon.url + "/v1/completions", json={
                "model": "demo", "prompt": list(range(300, 364)), "max_tokens": 2})
            assert r.status_code == 200, r.text
            key = f"g{child.incarnation}r0"
            wait_for(lambda: kv.index.blocks_of(key) >= 4, 10, "the index to learn the prompt")
            api.put(pod("other", "127.0.0.1", other.engine.port))
            wait_serving(daemon, {"web/kv", "web/other"})
            api.put(set_ready(api.get("kv"), False))
            wait_serving(daemon, {"web/other"})
            wait_for(lambda: kv.index.blocks_of(key) == 0 and not kv.live, 10,
                     "the withdrawn pod out of the index")
