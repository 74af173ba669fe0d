"""Live reload end to end: the real daemon, real engines (simulated) on loopback, real edits.

The engines of the load test run outside the daemon (their own asyncio loop
and thread), so a removed engine keeps listening and its own request counter
proves nothing reaches it after its drain.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from direct_frontend.control.reload import keep_restart_fields
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.diff import RESTART_FIELDS, diff_fleets
from direct_frontend.fleet.schema import (
    FleetConfig,
    FrontendConfig,
    ReplicasConfig,
    ResponsesConfig,
    TracingConfig,
)
from direct_frontend.simulator.engine import SimEngine
from direct_frontend.simulator.model import TimingModel
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine, wait_for
from tests.support.http import http
from tests.support.load import Load

FAST_PROBE = "interval_s = 0.1\ntimeout_s = 1.0"
WATCH = {"watch_interval_s": 0.02}


class SimFarm:
    """Simulated engines on their own asyncio loop, outside the daemon."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        # A plain selector loop: trio_asyncio's policy would hand out a loop bound to one thread.
        self.loop = asyncio.SelectorEventLoop()
        self.engines: dict[str, SimEngine] = {}
        self._thread = threading.Thread(target=self._main, name="sims", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _run(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(10)

    def start(self, name: str, decode_us: float = 3000) -> dict[str, Any]:
        """Start engine ``name``; return its [[engine]] table."""
        engine = SimEngine.from_model_dir(
            "sglang", self.model_dir, served_model_name="demo", eos_probability=0.0,
            timing=TimingModel(prefill_us_per_token=0, decode_us_per_token=decode_us),
        )
        self._run(engine.start("127.0.0.1", 0))
        self.engines[name] = engine
        return {"name": name, "url": f"grpc://127.0.0.1:{engine.port}", "kind": "sglang"}

    def close(self) -> None:
        async def stop() -> None:
            for engine in self.engines.values():
                engine.close()
                await engine.wait_closed()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@pytest.fixture()
def farm(model_dir: Path) -> Iterator[SimFarm]:
    farm = SimFarm(model_dir)
    try:
        yield farm
    finally:
        farm.close()


class ReadyWatch:
    """Polls ``/ready`` back to back on its own thread; every status that is not 200 is kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.polls = 0
        self.not_ready: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                r = client.get(self.url + "/ready")
                self.polls += 1
                if r.status_code != 200:
                    self.not_ready.append(f"{r.status_code} {r.text}")


def fleet_status(daemon: Daemon) -> dict[str, Any]:
    response = http.get(daemon.url + "/fleet")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def engines_by_name(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in status["engines"] if e["state"] != "draining"}


def wait_status(daemon: Daemon, predicate: Callable[[dict[str, Any]], bool], what: str,
                timeout: float = 15) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def check() -> bool:
        found.clear()
        found.update(fleet_status(daemon))
        return predicate(found)

    wait_for(check, timeout, what)
    return found


def write(path: Path, text: str) -> None:
    """Save like an editor that writes a new file and renames it over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def test_reload_under_load_adds_removes_replaces_and_survives_a_bad_edit(
    model_dir: Path, tmp_path: Path, farm: SimFarm,
) -> None:
    a, b, c, d = (farm.start(name) for name in "abcd")

    def text(*engines: dict[str, Any]) -> str:
        return fleet_text(model_dir, [dict(e) for e in engines], probe=FAST_PROBE,
                          frontend_extra="drain_timeout_s = 10")

    with running_daemon(tmp_path, text(a, b, c), **WATCH) as daemon:
        path = daemon.fleet.source
        daemon.wait_serving(3)
        sup = daemon.supervisor
        untouched = sup.children["a"]
        with Load(daemon.url) as load:
            load.wait_more(10)

            # 1. add d: it joins (probe first) and then takes requests
            write(path, text(a, b, c, d))
            wait_status(daemon, lambda s: s["serving"] == 4, "d to serve")
            added = sup.children["d"]
            wait_for(lambda: farm.engines["d"].stats.requests > 0, 10, "d to get requests")

            # 2. remove c: it drains, then is gone; nothing reaches it afterwards
            write(path, text(a, b, d))
            wait_status(daemon, lambda s: "c" not in {e["name"] for e in s["engines"]},
                        "c to be gone")
            served_by_c = farm.engines["c"].stats.requests
            assert served_by_c > 0

            # 3. change b (an engine setting): replaced by a new incarnation
            old_b = sup.children["b"]
            changed_b = {**b, "context_length": 2048}
            write(path, text(a, changed_b, d))
            status = wait_status(
                daemon,
                lambda s: engines_by_name(s)["b"]["incarnation"] != old_b.incarnation
                and engines_by_name(s)["b"]["state"] == "serving"
                and not any(e["state"] == "draining" for e in s["engines"]),
                "b to be replaced",
            )
            new_b = sup.children["b"]
            assert new_b is not old_b and new_b.cfg.context_length == 2048
            assert old_b.state.value == "gone"
            assert status["last_reload"]["diff"]["changed"] == [
                {"name": "b", "fields": ["context_length"]}
            ]
            load.wait_more(10)

            # 4. a bad edit: rejected with its line and field, the fleet stays as it was
            before = {e["name"]: e["incarnation"] for e in status["engines"]}
            version = status["config"]["version"]
            write(path, text(a, changed_b, d).replace("interval_s = 0.1", "interval_s = -1"))
            status = wait_status(daemon, lambda s: s["last_reload"]["ok"] is False,
                                 "the bad edit to be rejected")
            assert status["config"]["version"] == version
            assert any("fleet.toml:8: frontend.probe.interval_s: must be greater than 0" in e
                       for e in status["last_reload"]["errors"])
            load.wait_more(10)

            # 5. restore it: accepted, nothing to change
            write(path, text(a, changed_b, d))
            status = wait_status(daemon, lambda s: s["last_reload"]["ok"] is True,
                                 "the restored file to be accepted")
            assert status["last_reload"]["diff"]["added"] == []
            assert {e["name"]: e["incarnation"] for e in status["engines"]} == before
            assert status["config"]["version"] == version
            load.wait_more(20)

        assert load.failures == []
        assert load.ok > 60
        # Nothing reached c after it was gone.
        assert farm.engines["c"].stats.requests == served_by_c
        # The untouched engines kept their incarnation and their one connection.
        assert sup.children["a"] is untouched and sup.children["d"] is added
        assert untouched.channel is not None and untouched.channel.connections_opened == 1
        assert added.channel is not None and added.channel.connections_opened == 1
        final = engines_by_name(fleet_status(daemon))
        assert final["a"]["incarnation"] == untouched.incarnation
        assert final["a"]["connections_opened"] == 1
        assert {name: e["state"] for name, e in final.items()} == {
            "a": "serving", "b": "serving", "d": "serving",
        }
        assert fleet_status(daemon)["config"]["version"] == 4  # start + three applied edits


def test_removing_and_re_adding_a_url_never_lets_the_old_incarnation_touch_the_new(
    model_dir: Path, tmp_path: Path,
) -> None:
    """The old one drains a long stream while the new one serves; its late calls are ignored."""
    x = sim_engine("x", decode_us_per_token=20000, prefill_us_per_token=0, eos_probability=0.0)
    y = sim_engine("y", decode_us_per_token=0, prefill_us_per_token=0, eos_probability=0.0)
    only_x = fleet_text(model_dir, [dict(x)], probe=FAST_PROBE)
    without_x = fleet_text(model_dir, [dict(y)], probe=FAST_PROBE)
    with_x = fleet_text(model_dir, [dict(x), dict(y)], probe=FAST_PROBE)
    with running_daemon(tmp_path, only_x, watch_interval_s=None) as daemon:
        daemon.wait_serving(1)
        sup = daemon.supervisor
        old = sup.children["x"]
        old_handle = old.handle
        sim = sup.simulators["x"]
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", daemon.url + "/v1/chat/completions", json=body,
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            assert old.in_flight == 1
            daemon.fleet.source.write_text(without_x)
            assert http.post(daemon.url + "/fleet/reload").json()["ok"]
            # Make before break: x serves on until y, which the same edit added, has joined.
            wait_for(lambda: old.state.value == "draining", 10, "the old x to drain")
            assert sup.children["y"].state.value == "serving"
            daemon.fleet.source.write_text(with_x)
            assert http.post(daemon.url + "/fleet/reload").json()["ok"]
            new = sup.children["x"]
            assert new is not old and new.id == old.id and new.incarnation > old.incarnation
            wait_for(lambda: new.state.value == "serving", 10, "the new x to serve")
            assert sup.simulators["x"] is sim  # same simulator settings: it was kept
            # Late calls from the old incarnation change nothing for the new one.
            assert old_handle is not None
            daemon.run_sync(sup.report_fault, old_handle,
                            EngineError(ErrorKind.UNAVAILABLE, "late fault"))
            daemon.run_sync(old.report_fault, EngineError(ErrorKind.UNAVAILABLE, "late fault"))
            assert old.state.value == "draining" and new.state.value == "serving"
            text = "\n".join(lines)  # the old incarnation's stream runs to its end
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        wait_for(lambda: old.state.value == "gone", 10, "the old x to be gone")
        # Its end (channel closed, simulator released, gone published) left the new one alone.
        assert sup.children["x"] is new and new.state.value == "serving"
        assert new.incarnation in sup.incarnations and old.incarnation not in sup.incarnations
        assert [e.incarnation for e in sup.catalog.engines if e.name == "x"] == [new.incarnation]
        daemon.run_sync(old.on_change, old, old.state)  # a callback after it was forgotten
        assert sup.children["x"] is new
        assert sim.stats.running == 0 and not sim.core.closing
        r = http.post(daemon.url + "/v1/completions",
                       json={"model": "demo", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


def test_frontend_settings_apply_live_and_restart_ones_are_reported(
    model_dir: Path, tmp_path: Path,
) -> None:
    engine = sim_engine("e", decode_us_per_token=0, prefill_us_per_token=0, eos_probability=0.0)
    text = fleet_text(model_dir, [dict(engine)], probe=FAST_PROBE)
    with running_daemon(tmp_path, text, watch_interval_s=None) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["e"]
        body = {"model": "demo", "prompt": "hi"}
        assert http.post(daemon.url + "/v1/completions", json=body).json()["usage"][
            "completion_tokens"] == 1024
        edited = fleet_text(
            model_dir, [dict(engine)], probe="interval_s = 0.3\ntimeout_s = 1.0\n"
            "failure_threshold = 5",
            frontend_extra="max_tokens_default = 7\nmax_body_bytes = 100\n"
            '[frontend.routing]\npolicy = "least_loaded"',
        ).replace('listen = "127.0.0.1:0"', 'listen = "127.0.0.1:1"')
        daemon.fleet.source.write_text(edited)
        result = http.post(daemon.url + "/fleet/reload").json()
        assert result["ok"], result
        assert result["diff"]["restart"] == ["listen"]
        assert set(result["diff"]["live"]) == {
            "max_body_bytes", "max_tokens_default", "probe.interval_s",
            "probe.failure_threshold", "routing.policy",
        }
        assert daemon.supervisor.children["e"] is child  # untouched
        assert child.probe.interval_s == 0.3 and child.tracker.failure_threshold == 5
        assert daemon.control.settings.policy.name == "least_loaded"
        r = http.post(daemon.url + "/v1/completions", json={**body, "prompt": "hi " * 50})
        assert r.status_code == 413  # the new max_body_bytes
        daemon.fleet.source.write_text(edited.replace("max_body_bytes = 100\n", ""))
        assert http.post(daemon.url + "/fleet/reload").json()["ok"]
        usage = http.post(daemon.url + "/v1/completions", json=body).json()["usage"]
        assert usage["completion_tokens"] == 7
        status = fleet_status(daemon)
        assert status["fleet"]["frontend"]["listen"] == daemon.fleet.frontend.listen  # kept
        assert "needs a restart" not in json.dumps(status)  # the view shows running values


def test_an_engine_that_never_answers_delays_neither_others_nor_the_reload(
    model_dir: Path, tmp_path: Path,
) -> None:
    """The silent engine's calls hang for a minute (its timeout): the reload's answer and the
    other engine's join come long before, without a clock to compare against."""
    fast = sim_engine("fast", decode_us_per_token=0, prefill_us_per_token=0)
    probe = "interval_s = 0.1\ntimeout_s = 60.0\njoin_timeout_s = 60.0"
    text = fleet_text(model_dir, [dict(fast)], probe=probe)
    blackhole = socket.socket()  # listens, never speaks HTTP/2: probes hang to the timeout
    with blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(8)
        port = blackhole.getsockname()[1]
        with running_daemon(tmp_path, text, watch_interval_s=None) as daemon:
            daemon.wait_serving(1)
            silent = {"name": "silent", "url": f"grpc://127.0.0.1:{port}", "kind": "sglang"}
            second = sim_engine("second", decode_us_per_token=0, prefill_us_per_token=0)
            daemon.fleet.source.write_text(
                fleet_text(model_dir, [dict(fast), silent, dict(second)], probe=probe))
            r = http.post(daemon.url + "/fleet/reload")
            assert r.json()["ok"]
            daemon.wait_serving(2)  # "second" joins while "silent" hangs
            assert daemon.supervisor.children["silent"].state.value == "joining"


class _Exploding:
    """A dialect whose health check raises a plain bug (not an EngineError) a few times."""

    def __init__(self, inner: Any, times: int) -> None:
        self._inner = inner
        self.left = times

    def health(self) -> Any:
        if self.left > 0:
            self.left -= 1
            raise RuntimeError("a bug in the child")
        return self._inner.health()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_crashing_child_is_restarted_and_never_touches_the_daemon_or_others(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    fast = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}
    text = fleet_text(model_dir, [sim_engine("a", **fast), sim_engine("b", **fast)],
                      probe=FAST_PROBE)
    with running_daemon(tmp_path, text, watch_interval_s=None) as daemon:
        daemon.wait_serving(2)
        a, b = daemon.supervisor.children["a"], daemon.supervisor.children["b"]
        exploding = _Exploding(a.dialect, times=2)
        daemon.run_sync(setattr, a, "dialect", exploding)
        wait_for(lambda: a.restarts == 2 and a.state.value == "serving", 10,
                 "a to crash twice and serve again")
        assert daemon.supervisor.children["a"] is a  # restarted in place: same incarnation
        assert daemon.supervisor.children["b"] is b and b.state.value == "serving"
        assert b.channel is not None and b.channel.connections_opened == 1
        assert a.channel is not None and a.channel.connections_opened == 1  # kept
        for _ in range(4):
            r = http.post(daemon.url + "/v1/completions",
                           json={"model": "demo", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
        assert "engine a child crashed; restarting in" in caplog.text
        assert fleet_status(daemon)["engines"][0]["restarts"] == 2


def test_new_simulator_settings_restart_the_simulator_after_the_old_one_drains(
    model_dir: Path, tmp_path: Path,
) -> None:
    slow = sim_engine("s", decode_us_per_token=10000, prefill_us_per_token=0,
                      eos_probability=0.0)
    text = fleet_text(model_dir, [dict(slow, simulator=dict(slow["simulator"]))],
                      probe=FAST_PROBE)
    with running_daemon(tmp_path, text, watch_interval_s=None) as daemon:
        daemon.wait_serving(1)
        sup = daemon.supervisor
        old, old_sim = sup.children["s"], sup.simulators["s"]
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 30, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", daemon.url + "/v1/chat/completions", json=body,
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            faster = {**slow, "simulator": {**slow["simulator"], "decode_us_per_token": 0}}
            daemon.fleet.source.write_text(fleet_text(model_dir, [faster], probe=FAST_PROBE))
            result = http.post(daemon.url + "/fleet/reload").json()
            assert result["diff"]["changed"] == [
                {"name": "s", "fields": ["simulator.decode_us_per_token"]}]
            new = sup.children["s"]
            assert new.state.value == "joining"  # waits for the port: the old one is draining
            text_out = "\n".join(lines)
        assert text_out.rstrip().endswith("data: [DONE]")
        wait_for(lambda: new.state.value == "serving", 10, "the new incarnation to serve")
        assert old.state.value == "gone"
        assert sup.simulators["s"] is not old_sim and old_sim.core.closing
        assert sup.simulators["s"].config.timing.decode_us_per_token == 0


def test_a_drain_that_outlasts_drain_timeout_s_ends_anyway(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    slow = sim_engine("slow", decode_us_per_token=20000, prefill_us_per_token=0,
                      eos_probability=0.0)
    other = sim_engine("other", decode_us_per_token=1000, prefill_us_per_token=0,
                       eos_probability=0.0)
    extra = "drain_timeout_s = 0.3"
    with running_daemon(tmp_path, fleet_text(model_dir, [dict(slow)], probe=FAST_PROBE,
                                             frontend_extra=extra),
                        watch_interval_s=None) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["slow"]
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 200, "stream": True}  # 4 s on the slow engine
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", daemon.url + "/v1/chat/completions", json=body,
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            daemon.fleet.source.write_text(fleet_text(
                model_dir, [dict(other)], probe=FAST_PROBE, frontend_extra=extra))
            assert http.post(daemon.url + "/fleet/reload").json()["ok"]
            wait_for(lambda: child.state.value == "gone", what="the drain to time out")
            text = "\n".join(lines)
        # The cut stream moved to the remaining engine and finished there.
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        assert "engine slow drain timed out after 0.3s with 1 requests in flight" in caplog.text


def replaced(daemon: Daemon, old: dict[str, int]) -> Callable[[dict[str, Any]], bool]:
    """Whether every engine in ``old`` (name → incarnation) serves as a new incarnation, alone."""

    def done(status: dict[str, Any]) -> bool:
        engines = status["engines"]
        return len(engines) == len(old) and all(
            e["state"] == "serving" and e["incarnation"] != old.get(e["name"]) for e in engines
        )

    return done


def incarnations(daemon: Daemon) -> dict[str, int]:
    return {name: child.incarnation for name, child in daemon.supervisor.children.items()}


def test_edits_that_replace_every_engine_make_before_they_break(
    model_dir: Path, tmp_path: Path, farm: SimFarm,
) -> None:
    """Replaced (settings changed) and swapped (removed + added): /ready never says 503."""
    a, b, c, d = (farm.start(name, decode_us=1000) for name in "abcd")

    def text(*engines: dict[str, Any]) -> str:
        return fleet_text(model_dir, [dict(e) for e in engines], probe=FAST_PROBE)

    with running_daemon(tmp_path, text(a, b), watch_interval_s=None) as daemon:
        daemon.wait_serving(2)
        with Load(daemon.url, clients=4) as load, ReadyWatch(daemon.url) as ready:
            load.wait_more(5)
            before = incarnations(daemon)
            daemon.fleet.source.write_text(
                text({**a, "context_length": 2048}, {**b, "context_length": 2048}))
            result = http.post(daemon.url + "/fleet/reload").json()
            assert [c["name"] for c in result["diff"]["changed"]] == ["a", "b"]
            wait_status(daemon, replaced(daemon, before), "a and b to be replaced")
            load.wait_more(5)

            daemon.fleet.source.write_text(text(c, d))  # every engine removed, two added
            result = http.post(daemon.url + "/fleet/reload").json()
            assert result["diff"]["removed"] == ["a", "b"]
            wait_status(daemon, lambda s: {e["name"] for e in s["engines"]} == {"c", "d"},
                        "a and b to be gone")
            load.wait_more(5)
        assert ready.not_ready == []
        assert ready.polls > 20
        assert load.failures == []
        assert farm.engines["c"].stats.requests > 0 and farm.engines["d"].stats.requests > 0


def test_replacing_every_embedded_simulator_keeps_one_serving(
    model_dir: Path, tmp_path: Path,
) -> None:
    """Embedded: a kept simulator serves both incarnations; a new one must wait for its port."""
    fast = {"decode_us_per_token": 1000, "prefill_us_per_token": 0, "eos_probability": 0.0}
    x, y = sim_engine("x", **fast), sim_engine("y", **fast)

    def text(*engines: dict[str, Any]) -> str:
        return fleet_text(model_dir, [dict(e, simulator=dict(e["simulator"])) for e in engines],
                          probe=FAST_PROBE)

    with running_daemon(tmp_path, text(x, y), watch_interval_s=None) as daemon:
        daemon.wait_serving(2)
        sims = dict(daemon.supervisor.simulators)
        with Load(daemon.url, clients=4) as load, ReadyWatch(daemon.url) as ready:
            load.wait_more(5)
            # 1. an engine setting: the same simulators serve the old and the new incarnations
            before = incarnations(daemon)
            daemon.fleet.source.write_text(
                text({**x, "context_length": 2048}, {**y, "context_length": 2048}))
            assert http.post(daemon.url + "/fleet/reload").json()["ok"]
            wait_status(daemon, replaced(daemon, before), "x and y to be replaced")
            assert daemon.supervisor.simulators == sims
            load.wait_more(5)
            # 2. a simulator setting: one port, one simulator; they take turns
            before = incarnations(daemon)
            slower = {**fast, "decode_us_per_token": 1500}
            daemon.fleet.source.write_text(text(
                {**x, "context_length": 2048, "simulator": slower},
                {**y, "context_length": 2048, "simulator": slower}))
            assert http.post(daemon.url + "/fleet/reload").json()["ok"]
            wait_status(daemon, replaced(daemon, before), "x and y to get new simulators")
            load.wait_more(5)
        new_sims = daemon.supervisor.simulators
        assert all(new_sims[name] is not sims[name] for name in "xy")
        assert ready.not_ready == []
        assert ready.polls > 20
        assert load.failures == []


def test_an_embedded_simulator_that_cannot_listen_is_tried_again(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    first = sim_engine("first", decode_us_per_token=0, prefill_us_per_token=0)
    late = sim_engine("late", decode_us_per_token=0, prefill_us_per_token=0)
    port = int(late["url"].rsplit(":", 1)[1])
    with running_daemon(tmp_path, fleet_text(model_dir, [dict(first)], probe=FAST_PROBE),
                        watch_interval_s=None) as daemon:
        daemon.wait_serving(1)
        squatter = socket.socket()
        try:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as free_port's
            squatter.bind(("127.0.0.1", port))
            squatter.listen(1)
            daemon.fleet.source.write_text(
                fleet_text(model_dir, [dict(first), dict(late)], probe=FAST_PROBE))
            assert http.post(daemon.url + "/fleet/reload").json()["ok"]
            wait_for(lambda: "engine late: the embedded simulator did not start" in caplog.text,
                     10, "the failed start to be logged")
            child = daemon.supervisor.children["late"]
            assert child.state.value == "joining" and "did not start" in child.last_error
        finally:
            squatter.close()
        wait_for(lambda: child.state.value == "serving", 10, "the simulator to listen at last")
        failures = [r for r in caplog.records if "did not start" in r.getMessage()]
        assert len(failures) == 1  # the same reason each try: said once
        assert failures[0].levelname == "WARNING"
        daemon.wait_serving(2)


def test_a_reload_keeps_exactly_the_settings_that_need_a_restart() -> None:
    running = FrontendConfig(served_model_name="a", tokenizer=Path("t1"), listen_port=1,
                             max_tokens_default=5)
    new = FrontendConfig(served_model_name="b", tokenizer=Path("t2"), listen_host="::1",
                         listen_port=2, log_json=True, max_tokens_default=9,
                         tracing=TracingConfig(otlp_endpoint="http://127.0.0.1:4318/v1/traces"),
                         replicas=ReplicasConfig(nats="nats://127.0.0.1:4222"), workers=3,
                         responses=ResponsesConfig(max_bytes=7), default_context_length=8)
    kept = keep_restart_fields(new, running)
    assert kept.tracing == running.tracing  # the tracer is built at start
    assert kept.replicas == running.replicas  # so is the replica link
    assert kept.responses == running.responses  # and the store of responses
    assert kept.default_context_length == running.default_context_length  # read at each join
    assert (kept.listen, kept.tokenizer, kept.served_model_name, kept.log_json) == (
        "127.0.0.1:1", Path("t1"), "a", False
    )
    assert kept.max_tokens_default == 9  # a live setting: the new value

    def fleet(frontend: FrontendConfig) -> FleetConfig:
        return FleetConfig(frontend=frontend, source=Path("fleet.toml"))

    # what the diff calls a restart field is exactly what is kept
    restart = diff_fleets(fleet(running), fleet(new)).restart
    assert {name.split(".")[0] for name in restart} == set(RESTART_FIELDS)
    kept_diff = diff_fleets(fleet(running), fleet(kept))
    assert kept_diff.restart == () and kept_diff.live == ("max_tokens_default",)


def test_a_reload_rereads_the_keys_file_and_keeps_the_running_keys_when_it_is_gone(
    model_dir: Path, tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# the first key\nsk-first-key\n")
    engine = sim_engine("e", decode_us_per_token=0, prefill_us_per_token=0)
    text = fleet_text(model_dir, [engine], probe=FAST_PROBE,
                      frontend_extra='[frontend.auth]\napi_keys_file = "keys.txt"')
    with running_daemon(tmp_path, text, watch_interval_s=None) as daemon:

        def models(key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            return http.get(daemon.url + "/v1/models", headers=headers).status_code

        assert (models("sk-first-key"), models("sk-second-key")) == (200, 401)
        keys.write_text("sk-second-key\n")
        result = http.post(daemon.url + "/fleet/reload").json()
        assert result["ok"] and result["diff"]["live"] == ["auth.api_keys"], result
        assert (models("sk-first-key"), models("sk-second-key")) == (401, 200)
        keys.unlink()
        result = http.post(daemon.url + "/fleet/reload").json()
        assert not result["ok"]
        assert result["errors"] == [f"{daemon.fleet.source}:6: frontend.auth.api_keys_file: "
                                    f"cannot read {keys}: No such file or directory"]
        assert models("sk-second-key") == 200  # the running fleet's keys stand
        assert "sk-second-key" not in json.dumps(fleet_status(daemon))
