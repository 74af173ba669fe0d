"""Admin surface end to end: /fleet, /fleet/events, auth, ``check --against`` and ``top``."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
import trio_websocket
from typer.testing import CliRunner

from direct_frontend.cli import app as cli
from direct_frontend.control.events import EventHub
from direct_frontend.top import FleetModel, events_url, follow, session
from tests.support.daemon import Daemon, fleet_text, free_port, running_daemon, sim_engine, wait_for
from tests.support.http import http, sdk_http

ADMIN_TOKEN = "admin-7f3a9c2e5b1d"
API_KEY = "sk-test-4e8b2a6c9d0f"
FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}
PROBE = "interval_s = 0.1\ntimeout_s = 1.0"
SECURED = (
    f'[frontend.admin]\ntoken = "{ADMIN_TOKEN}"\n[frontend.auth]\napi_keys = ["{API_KEY}"]'
)


def admin(token: str = ADMIN_TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def engine_table(model_dir: Path, engine: dict[str, Any]) -> str:
    """Just the [[engine]] table (and its simulator table) of ``engine``."""
    text = fleet_text(model_dir, [engine])
    return text[text.index("[[engine]]"):]


@pytest.fixture()
def secured(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> Iterator[Daemon]:
    caplog.set_level(logging.DEBUG)
    text = fleet_text(model_dir, [sim_engine("a", **FAST)], probe=PROBE, frontend_extra=SECURED)
    with running_daemon(tmp_path, text, watch_interval_s=0.02) as daemon:
        daemon.wait_serving(1)
        yield daemon
    assert ADMIN_TOKEN not in caplog.text and API_KEY not in caplog.text


def test_openai_endpoints_need_an_api_key_when_configured(secured: Daemon) -> None:
    url = secured.url
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = http.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert http.get(url + "/v1/models").status_code == 401
    assert http.get(url + "/v1/models/demo").status_code == 401
    for path in ("/tokenize", "/detokenize"):  # vLLM's, outside /v1: the keys cover them too
        assert http.post(url + path, json={"model": "demo", "tokens": [1]}).status_code == 401
    assert http.post(url + "/tokenize", json={"model": "demo", "prompt": "hi"},
                      headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert http.get(url + "/health").status_code == 200  # probes need no key
    assert http.get(url + "/ready").status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0,
                           http_client=sdk_http())
    assert client.completions.create(**body).usage is not None  # type: ignore[call-overload]
    bad = openai.OpenAI(http_client=sdk_http(), base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Anthropic's clients send theirs as x-api-key: taken for the API keys, never for /fleet
    assert http.get(url + "/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    assert http.get(url + "/v1/models", headers={"x-api-key": "nope"}).status_code == 401
    assert http.get(url + "/fleet", headers={"x-api-key": ADMIN_TOKEN}).status_code == 401


def test_metrics_need_the_admin_token_when_one_is_set(secured: Daemon) -> None:
    """The metrics name engines, adapters and models: the admin token guards them too."""
    url = secured.url + "/metrics"
    for headers in ({}, admin("nope"), {"Authorization": f"Bearer {API_KEY}"}):
        denied = http.get(url, headers=headers)
        assert denied.status_code == 401 and "x-request-id" in denied.headers
    scrape = http.get(url, headers=admin())
    assert scrape.status_code == 200 and "direct_frontend_" in scrape.text


def test_fleet_needs_the_admin_token_and_never_shows_secrets(secured: Daemon) -> None:
    url = secured.url
    assert http.get(url + "/fleet").status_code == 401
    assert http.get(url + "/fleet", headers=admin("nope")).status_code == 401
    assert http.get(url + "/fleet", headers={"Authorization": f"Bearer {API_KEY}"}
                     ).status_code == 401  # an API key is not an admin token
    assert http.post(url + "/fleet/reload").status_code == 401
    r = http.get(url + "/fleet", headers=admin())
    assert r.status_code == 200
    assert ADMIN_TOKEN not in r.text and API_KEY not in r.text
    status = r.json()
    assert status["fleet"]["frontend"]["admin"]["token"] == "<redacted>"
    assert status["fleet"]["frontend"]["auth"]["api_keys"] == ["<redacted>"]
    (engine,) = status["engines"]
    assert engine["name"] == "a" and engine["state"] == "serving"
    assert engine["model"] == "demo" and engine["incarnation"] >= 1
    assert engine["last_probe"]["ok"] is True and engine["connections_opened"] == 1
    assert {"load", "since", "url", "kind", "role", "last_error"} <= set(engine)
    assert status["config"]["version"] == 1 and status["last_reload"] is None
    result = http.post(url + "/fleet/reload", headers=admin())
    assert result.status_code == 200 and result.json()["diff"]["added"] == []


def test_admin_can_be_disabled(model_dir: Path, tmp_path: Path) -> None:
    text = fleet_text(model_dir, [], probe=PROBE,
                      frontend_extra="allow_empty_fleet = true\n[frontend.admin]\nenabled = false")
    with running_daemon(tmp_path, text, watch_interval_s=None) as daemon:
        assert http.get(daemon.url + "/fleet").status_code == 404
        assert http.post(daemon.url + "/fleet/reload").status_code == 404

        with pytest.raises(trio_websocket.ConnectionRejected):
            trio.run(session, daemon.url, print)


def test_events_stream_a_snapshot_then_state_changes_and_reloads(
    secured: Daemon, model_dir: Path,
) -> None:
    path = secured.fleet.source
    original = path.read_text()

    class Enough(Exception):
        pass

    async def main() -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        with pytest.raises(trio_websocket.ConnectionRejected) as refused:
            await session(secured.url, seen.append)
        assert refused.value.status_code == 401

        def on_event(event: dict[str, Any]) -> None:
            seen.append(event)
            if len(seen) == 1:  # the snapshot: now change the fleet
                added = original + "\n" + engine_table(model_dir, sim_engine("b", **FAST))
                path.write_text(added)
            elif (event["type"] == "engine" and event["engine"]["name"] == "b"
                  and event["engine"]["state"] == "serving"):
                raise Enough

        with trio.fail_after(10), pytest.raises(Enough):
            await session(secured.url, on_event, token=ADMIN_TOKEN)
        return seen

    seen = trio.run(main)
    assert seen[0]["type"] == "snapshot"
    assert [e["name"] for e in seen[0]["fleet"]["engines"]] == ["a"]
    reloads = [e["reload"] for e in seen if e["type"] == "reload"]
    assert reloads and reloads[0]["ok"] and reloads[0]["diff"]["added"] == ["b"]
    states = [(e["previous"], e["engine"]["state"]) for e in seen
              if e["type"] == "engine" and e["engine"]["name"] == "b"]
    assert states[-1] == ("joining", "serving")
    assert all(ADMIN_TOKEN not in json.dumps(e) for e in seen)


def test_the_load_tick_carries_each_engines_requests_so_far(secured: Daemon) -> None:
    """What ``top``'s REQS column shows moves with traffic, not only on a state change."""
    client = openai.OpenAI(base_url=secured.url + "/v1", api_key=API_KEY, max_retries=0,
                           http_client=sdk_http())
    for _ in range(2):
        client.completions.create(model="demo", prompt="hi", max_tokens=2)

    class Enough(Exception):
        pass

    ticks: list[dict[str, Any]] = []

    def on_event(event: dict[str, Any]) -> None:
        if event["type"] == "load":
            ticks.append(event)
            raise Enough

    async def main() -> None:
        with trio.fail_after(10), pytest.raises(Enough):
            await session(secured.url, on_event, token=ADMIN_TOKEN)

    trio.run(main)
    (tick,) = ticks
    assert tick["engines"] == {"a#1": 0}
    assert tick["requests"]["a#1"] >= 2


def test_a_slow_subscriber_never_blocks_the_publisher_and_is_marked() -> None:
    async def main() -> None:
        hub = EventHub(buffer=4)
        with hub.subscribe() as slow, hub.subscribe() as fast:
            for i in range(100):
                hub.publish({"type": "n", "i": i})  # synchronous: cannot block
                if i % 2 == 0:
                    while fast.rx.statistics().current_buffer_used:
                        fast.rx.receive_nowait()
            assert slow.dropped == 96 and slow.lagging
            assert fast.dropped == 0
            assert slow.take_lag() == 96  # the stale queue is discarded; a snapshot follows
            assert slow.rx.statistics().current_buffer_used == 0
            assert hub.dropped_total == 96
            hub.close()
            with pytest.raises(trio.EndOfChannel):
                await slow.rx.receive()

    trio.run(main)


def test_check_against_a_running_daemon_prints_the_dry_run(
    secured: Daemon, model_dir: Path, tmp_path: Path,
) -> None:
    running = secured.fleet.source.read_text()
    candidate = tmp_path / "candidate" / "fleet.toml"
    candidate.parent.mkdir()
    extra = engine_table(model_dir, sim_engine("new", **FAST))
    candidate.write_text(
        running.replace("interval_s = 0.1", "interval_s = 0.5").replace(API_KEY, "sk-other-key")
        + "\n" + extra
    )
    runner = CliRunner()
    refused = runner.invoke(cli, ["check", str(candidate), "--against", secured.url])
    assert refused.exit_code == 1 and "HTTP 401" in refused.output
    result = runner.invoke(cli, ["check", str(candidate), "--against", secured.url],
                           env={"DIRECT_FRONTEND_ADMIN_TOKEN": ADMIN_TOKEN})
    assert result.exit_code == 0, result.output
    assert "running config v1" in result.output
    assert "+ engine new (joins: probe first, then serves)" in result.output
    assert "~ frontend.probe.interval_s (applies live)" in result.output
    assert "= 1 engine(s) unchanged: a" in result.output
    assert ADMIN_TOKEN not in result.output and API_KEY not in result.output
    assert "sk-other-key" not in result.output
    as_json = runner.invoke(cli, ["check", str(candidate), "--against", secured.url, "--json",
                                  "--admin-token", ADMIN_TOKEN])
    assert json.loads(as_json.output)["added"] == ["new"]
    assert http.get(secured.url + "/fleet", headers=admin()).json()["config"]["version"] == 1
    local = runner.invoke(cli, ["check", str(candidate)])
    assert local.exit_code == 0 and "sk-other-key" not in local.output
    assert re.search(r"auth.api_keys +1 \(redacted\)", local.output)


def test_top_model_renders_the_fleet() -> None:
    model = FleetModel()
    engine = {"name": "a", "incarnation": 1, "state": "joining", "load": 0, "requests": 0,
              "role": "both", "kind": "sglang", "url": "grpc://h:1", "since": 100.0,
              "last_probe": None, "last_error": None}
    model.apply({"type": "snapshot", "fleet": {"engines": [engine], "config": {"version": 2},
                                               "last_reload": None}})
    model.apply({"type": "engine", "previous": "joining",
                 "engine": {**engine, "state": "serving",
                            "last_probe": {"ok": True, "message": "", "at": 1}}})
    model.apply({"type": "load", "engines": {"a#1": 3}})
    model.apply({"type": "reload", "reload": {
        "ok": True, "trigger": "file", "at": 0, "version": 3,
        "diff": {"added": ["b"], "removed": [], "changed": [], "live": [], "restart": []}}})
    model.connected = True
    lines = model.render("http://x", colour=False, now=130.0)
    assert lines[0] == "direct-frontend top  http://x  [connected]"
    assert lines[1].startswith("engines 1/1 serving   config v3")
    assert "ok, +b" in lines[2]
    assert lines[4].split() == ["NAME", "STATE", "GEN", "LOAD", "REQS", "ROLE", "KIND", "URL",
                                "FOR", "PROBE"]
    assert lines[5].split() == ["a", "serving", "1", "3", "0", "both", "sglang", "grpc://h:1",
                                "30s", "ok"]
    model.apply({"type": "engine", "previous": "draining", "engine": {**engine, "state": "gone"}})
    assert model.engines == {}
    assert events_url("http://h:8000/") == "ws://h:8000/fleet/events"
    assert events_url("https://h") == "wss://h/fleet/events"


def test_top_follows_the_fleet_across_a_daemon_restart(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    text = fleet_text(model_dir, [sim_engine("a", **FAST)], probe=PROBE).replace(
        'listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"')
    views: list[tuple[bool, list[str]]] = []
    lock = threading.Lock()
    started = threading.Event()
    handles: dict[str, Any] = {}

    def on_update(model: FleetModel) -> None:
        with lock:
            views.append((model.connected, model.render("x", colour=False)))

    async def main() -> None:
        handles["token"] = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            handles["scope"] = scope
            started.set()
            await follow(f"http://127.0.0.1:{port}", on_update, backoff=(0.05,))

    def serving_view(after: int) -> bool:
        with lock:
            return any(c and any(" serving " in line for line in lines)
                       for c, lines in views[after:])

    follower = threading.Thread(target=trio.run, args=(main,), daemon=True)
    follower.start()
    started.wait(5)
    try:
        with running_daemon(tmp_path, text, watch_interval_s=None) as first:
            first.wait_serving(1)
            wait_for(lambda: serving_view(0), 10, "top to show the first daemon")
        mark = len(views)
        wait_for(lambda: any(not c for c, _ in views[mark:]), 10, "top to notice the restart")
        with lock:
            assert any("retrying in" in lines[0] for c, lines in views[mark:] if not c)
        mark = len(views)
        with running_daemon(tmp_path, text, watch_interval_s=None) as second:
            second.wait_serving(1)
            wait_for(lambda: serving_view(mark), 10, "top to reconnect to the new daemon")
    finally:
        trio.from_thread.run_sync(handles["scope"].cancel, trio_token=handles["token"])
        follower.join(5)
    assert not follower.is_alive()
