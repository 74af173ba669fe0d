"""Router replicas that route as one, over a real nats-server the test starts.

Every replica is the real daemon in-process; the first one embeds the
simulated engines, the others reach the same engines over gRPC (their fleet
file says ``simulate = false``), exactly as replicas on other machines would.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from direct_frontend.control.replica_wire import Placements, Subjects, decode
from tests.support.daemon import (
    Daemon,
    fleet_text,
    free_port,
    kv_fleet_text,
    raw_stream,
    sim_engine,
    wait_for,
)
from tests.support.http import http
from tests.support.nats import NatsServer, first_message, nats_binary, running_nats

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="needs nats-server")

#: each replica's store in its own memory: what crosses is asked over NATS (a shared
#: database would answer it first)
MEMORY_STORE = '[frontend.responses]\nbackend = "memory"\n'
SLOW = {"decode_us_per_token": 20_000, "prefill_us_per_token": 0, "eos_probability": 0.0}
FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}


def replicas_table(nats: str | None, link: str = "peer_timeout_s = 2.0\n") -> str:
    if nats is None:
        return ""
    return f'[frontend.replicas]\nnats = "{nats}"\n{link}'


def fleet_for(
    model_dir: Path, engines: list[dict[str, Any]], nats: str | None, *, embeds: bool,
    policy: str = "least_loaded", kv: bool = False, routing_extra: str = "",
    link: str = "peer_timeout_s = 2.0\n", read_loads: bool = True, frontend_extra: str = "",
) -> str:
    """One replica's fleet file; only the replica that ``embeds`` runs the simulators.

    ``read_loads``: whether it reads the engines' own load reports (GetLoads), which
    show it the other replicas' requests too, NATS or not. ``frontend_extra``: more
    ``[frontend.*]`` tables.
    """
    tables = copy.deepcopy(engines)
    for table in tables:
        table["simulate"] = embeds
        if not embeds:
            table.pop("simulator", None)
    extra = replicas_table(nats, link) + "\n" + frontend_extra
    probe = "interval_s = 0.2\ntimeout_s = 1.0\n" + ("" if read_loads else "read_loads = false\n")
    if kv:
        return kv_fleet_text(model_dir, tables, frontend_extra=extra, probe=probe)
    text = fleet_text(model_dir, tables, frontend_extra=extra, probe=probe)
    return text.replace("[frontend.probe]", f'[frontend.routing]\npolicy = "{policy}"\n'
                        f"{routing_extra}\n\n[frontend.probe]")


@contextlib.contextmanager
def replicas(
    tmp_path: Path, model_dir: Path, engines: list[dict[str, Any]], nats: str | None,
    count: int, **options: Any,
) -> Iterator[list[Daemon]]:
    """``count`` replicas of one fleet, the first embedding the engines; all serving."""
    started: list[Daemon] = []
    try:
        for index in range(count):
            directory = tmp_path / f"replica{index}"
            directory.mkdir()
            path = directory / "fleet.toml"
            path.write_text(fleet_for(model_dir, engines, nats, embeds=index == 0, **options))
            started.append(Daemon(path).start())
        for daemon in started:
            daemon.wait_serving(len(engines))
        yield started
    finally:
        for daemon in reversed(started):
            daemon.stop()


def fleet(daemon: Daemon) -> dict[str, Any]:
    body: dict[str, Any] = http.get(daemon.url + "/fleet").json()
    return body


def peers_of(daemon: Daemon) -> list[str]:
    view = fleet(daemon)["replicas"]
    return list(view["peers"]) if view else []


def placed(daemons: list[Daemon]) -> dict[str, int]:
    """Requests in flight per engine name, summed over the replicas that placed them."""
    out: dict[str, int] = {}
    for daemon in daemons:
        for engine in daemon.supervisor.catalog.engines:
            out[engine.name] = out.get(engine.name, 0) + engine.load.in_flight
    return out


def peer_view(daemon: Daemon) -> int:
    return sum(e.load.peer_in_flight for e in daemon.supervisor.catalog.engines)


def burst(daemons: list[Daemon], per_replica: int, stack: contextlib.ExitStack,
          shared: bool) -> None:
    """Long streams sent round-robin over the replicas, each one placed before the next.

    With sharing, each replica has heard of the others' streams before it
    places its next one (what "as one router" means across machines).
    """
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400, "stream": True}
    total = 0
    for _ in range(per_replica):
        for daemon in daemons:
            stack.enter_context(raw_stream(daemon.url, body, 2))
            total += 1
            wait_for(lambda n=total: sum(placed(daemons).values()) == n, what="the stream placed")
            if shared:
                for other in daemons:
                    mine = sum(e.load.in_flight for e in other.supervisor.catalog.engines)
                    wait_for(lambda o=other, m=mine, n=total: peer_view(o) == n - m,
                             what="the siblings to hear of it")


@pytest.mark.parametrize(("count", "policy"), [(2, "kv_aware"), (3, "least_loaded")])
def test_replicas_share_in_flight_load_and_balance_as_one_router(
    model_dir: Path, tmp_path: Path, count: int, policy: str
) -> None:
    engines = [sim_engine(f"e{i}", "sglang", **SLOW) for i in range(count)]
    with running_nats() as nats, \
            replicas(tmp_path, model_dir, engines, nats.url, count, policy=policy) as daemons:
        for daemon in daemons:
            wait_for(lambda d=daemon: len(peers_of(d)) == count - 1, what="every sibling heard")
        with contextlib.ExitStack() as stack:
            burst(daemons, 2, stack, shared=True)
            assert sorted(placed(daemons).values()) == [2] * count  # as one router would
        view = fleet(daemons[0])["replicas"]
        assert view["connected"] and not view["degraded"]


def test_a_stream_booked_here_reaches_the_siblings_at_once_not_at_the_next_tick(
    model_dir: Path, tmp_path: Path
) -> None:
    """A change of load goes out when it happens while the link is idle (issue 14).

    A sibling placing a request a few milliseconds after ours must already
    count it, else both send new prompts to the same idle engine. The tick is
    a minute here and round robin places nothing to share, so only the load
    change itself can carry the news.
    """
    engines = [sim_engine(f"e{i}", "sglang", **SLOW) for i in range(2)]
    link = "publish_interval_s = 60.0\npeer_timeout_s = 600.0\n"
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400, "stream": True}
    with running_nats() as nats, replicas(tmp_path, model_dir, engines, nats.url, 2,
                                          policy="round_robin", link=link) as (first, second):
        wait_for(lambda: peers_of(first) and peers_of(second), what="siblings")
        with raw_stream(first.url, body, 2):
            wait_for(lambda: sum(placed([first]).values()) == 1, what="the stream placed")
            wait_for(lambda: peer_view(second) == 1, timeout=20.0,
                     what="the sibling to count it long before the tick")


def test_a_stored_response_is_found_continued_and_deleted_through_any_replica(
    model_dir: Path, tmp_path: Path
) -> None:
    """The Responses API's ``previous_response_id`` on whichever replica the follow-up lands.

    The record crosses in small chunks here (as a long conversation would in
    512 KiB ones); a replica that is gone took its responses with it, and
    asking for one is a prompt "not found", not a timeout.
    """
    engines = [sim_engine("e0", "sglang", **FAST)]
    with running_nats() as nats, \
            replicas(tmp_path, model_dir, engines, nats.url, 3,
                     frontend_extra=MEMORY_STORE) as (first, second, third):
        for daemon in (first, second, third):
            wait_for(lambda d=daemon: len(peers_of(d)) == 2, what="every sibling heard")
        for daemon in (first, second, third):
            assert daemon.app is not None and daemon.app.responses is not None
            daemon.app.responses.remote.chunk_bytes = 64  # type: ignore[union-attr]
        ask = {"model": "demo", "max_output_tokens": 8}
        made = http.post(first.url + "/v1/responses", json={**ask, "input": "hi"}).json()
        assert made["store"] is True
        got = http.get(f"{second.url}/v1/responses/{made['id']}")
        assert got.status_code == 200 and got.json() == made
        follow = http.post(second.url + "/v1/responses",
                            json={**ask, "input": "more", "previous_response_id": made["id"]})
        assert follow.status_code == 200, follow.text
        alone = http.post(first.url + "/v1/responses", json={
            **ask, "store": False,
            "input": [{"role": "user", "content": "hi"}, *made["output"],
                      {"role": "user", "content": "more"}]}).json()
        assert follow.json()["usage"]["input_tokens"] == alone["usage"]["input_tokens"]
        items = http.get(f"{third.url}/v1/responses/{follow.json()['id']}/input_items",
                          params={"order": "asc"}).json()
        assert [i["type"] for i in items["data"]] == ["message", "message", "message"]
        assert http.delete(f"{third.url}/v1/responses/{made['id']}").json()["deleted"]
        assert http.get(f"{first.url}/v1/responses/{made['id']}").status_code == 404
        served = fleet(first)["replicas"]["counts"]
        assert served["responses_served"] >= 2 and served["response_fetches_failed"] == 0

        kept_by_third = http.post(third.url + "/v1/responses",
                                   json={**ask, "input": "bye"}).json()["id"]
        third.stop()
        gone = http.get(f"{second.url}/v1/responses/{kept_by_third}")
        assert gone.status_code == 404
        assert fleet(second)["replicas"]["counts"]["response_fetches_failed"] == 0


def test_a_background_response_is_polled_followed_and_cancelled_through_another_replica(
    model_dir: Path, tmp_path: Path
) -> None:
    """A client whose poll, stream or cancel lands on another replica than the one running
    its background response gets what it would get from the owner."""
    engines = [sim_engine("e0", "sglang", **SLOW)]
    with running_nats() as nats, \
            replicas(tmp_path, model_dir, engines, nats.url, 2) as (first, second):
        for daemon in (first, second):
            wait_for(lambda d=daemon: len(peers_of(d)) == 1, what="the sibling heard")
        sim = first.supervisor.simulators["e0"]
        made = http.post(first.url + "/v1/responses", json={
            "model": "demo", "input": "go on", "background": True,
            "max_output_tokens": 2000}).json()
        url = f"{second.url}/v1/responses/{made['id']}"
        wait_for(lambda: http.get(url).json()["output"] != [], what="output to show")
        assert http.get(url).json()["status"] == "in_progress"
        seen: list[dict[str, Any]] = []
        with http.stream("GET", url, params={"stream": "true"}, timeout=30) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["type"] == "response.output_text.delta":
                        break
        assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
        aborts = sim.stats.aborts_received + sim.stats.cancellations
        cancelled = http.post(url + "/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        wait_for(lambda: sim.stats.aborts_received + sim.stats.cancellations > aborts,
                 what="the engine to hear the cancel")
        own = http.get(f"{first.url}/v1/responses/{made['id']}").json()
        assert own["status"] == "cancelled"
        with http.stream("GET", url, params={"stream": "true", "starting_after": str(
                seen[-1]["sequence_number"])}, timeout=30) as reply:
            rest = [json.loads(line[6:]) for line in reply.iter_lines()
                    if line.startswith("data: ")]
        assert rest[0]["sequence_number"] == seen[-1]["sequence_number"] + 1
        assert rest[-1]["type"] == "response.cancelled"
        text = "".join(e["delta"] for e in seen + rest if e["type"] == "response.output_text.delta")
        assert text == rest[-1]["response"]["output"][0]["content"][0]["text"]
        assert fleet(second)["replicas"]["counts"]["response_fetches_failed"] == 0


def test_without_nats_replicas_share_nothing(model_dir: Path, tmp_path: Path) -> None:
    """What not sharing costs: a replica alone weighs only its own streams.

    Two streams each: every replica sees two in flight where the fleet has
    six, so its next placement balances its own share only. (The engines' own
    load reports are off here; the next test has them on.)
    """
    engines = [sim_engine(f"e{i}", "sglang", **SLOW) for i in range(3)]
    with replicas(tmp_path, model_dir, engines, None, 3, read_loads=False) as daemons, \
            contextlib.ExitStack() as s:
        burst(daemons, 2, s, shared=False)
        assert sum(placed(daemons).values()) == 6
        for daemon in daemons:
            seen = [e.load.fleet_in_flight for e in daemon.supervisor.catalog.engines]
            assert sum(seen) == 2 and max(seen) == 1  # its own two, spread over its view
        assert fleet(daemons[0])["replicas"] is None


def test_without_nats_the_engines_reports_show_the_other_replicas_load(
    model_dir: Path, tmp_path: Path,
) -> None:
    """No link, but the engines count every client: each replica sees all six at a probe."""
    engines = [sim_engine(f"e{i}", "sglang", **SLOW) for i in range(3)]
    with replicas(tmp_path, model_dir, engines, None, 3) as daemons, contextlib.ExitStack() as s:
        burst(daemons, 2, s, shared=False)
        assert sum(placed(daemons).values()) == 6
        for daemon in daemons:
            catalog = daemon.supervisor.catalog
            wait_for(lambda c=catalog: sum(e.load.fleet_in_flight for e in c.engines) == 6,
                     what="the engines' reports of the others' streams")
            assert sum(e.load.in_flight for e in catalog.engines) == 2  # its own


def test_a_fault_seen_by_one_replica_is_acted_on_by_the_other(
    model_dir: Path, tmp_path: Path
) -> None:
    from direct_frontend.simulator.faults import FaultPlan

    engines = [sim_engine("a", "sglang", **FAST), sim_engine("b", "sglang", **FAST)]
    with running_nats() as nats, \
            replicas(tmp_path, model_dir, engines, nats.url, 2, policy="round_robin") as (
                first, second):
        wait_for(lambda: peers_of(first) and peers_of(second), what="siblings")
        states: list[str] = []
        first.run_sync(first.supervisor.listeners.append,
                       lambda child, _: states.append(f"{child.name}:{child.state.value}"))
        first.supervisor.simulators["a"].faults = FaultPlan(die_after_tokens=1)
        body = {"model": "demo", "prompt": "x", "max_tokens": 8}
        for _ in range(2):  # round robin: one of them reaches a, which dies under it
            r = http.post(second.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text  # migrated to b
        first.supervisor.simulators["a"].faults = FaultPlan()
        wait_for(lambda: fleet(first)["replicas"]["counts"]["faults_acted_on"] >= 1,
                 what="the first replica to act on the second's fault")
        assert "a:unhealthy" in states  # taken out though none of its own requests failed
        assert fleet(second)["replicas"]["counts"]["faults_shared"] >= 1
        first.wait_serving(2)  # its probes bring it back


def kv_engine(name: str) -> dict[str, Any]:
    table = sim_engine(name, "vllm", **FAST)
    table["kv_events"] = f"tcp://127.0.0.1:{free_port()}"
    table["kv_replay"] = f"tcp://127.0.0.1:{free_port()}"
    table["block_size"] = 16
    return table


def overlaps(daemon: Daemon, prompt: list[int]) -> dict[str, int]:
    """The cached leading blocks the replica's KV index predicts, per engine name."""
    kv = daemon.supervisor.kv

    def look() -> dict[str, int]:
        return {kv.ranks[key][0]: blocks for key, blocks in kv.index.lookup(prompt).items()}

    result: dict[str, int] = daemon.run_sync(look)
    return result


def test_a_late_replica_warms_from_a_sibling_and_predicts_what_it_predicts(
    model_dir: Path, tmp_path: Path
) -> None:
    engines = [kv_engine("a"), kv_engine("b")]
    prompts = [[100 + 300 * p + i for i in range(16 * (2 + p))] for p in range(6)]
    def start(name: str, nats: str, embeds: bool) -> Daemon:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "fleet.toml").write_text(
            fleet_for(model_dir, engines, nats, embeds=embeds, kv=True))
        return Daemon(directory / "fleet.toml").start()

    with running_nats() as nats:
        first = start("first", nats.url, embeds=True)
        try:
            first.wait_serving(2)
            wait_for(lambda: len(first.supervisor.kv.live) == 2, what="KV subscriptions")
            for prompt in prompts:
                r = http.post(first.url + "/v1/completions",
                               json={"model": "demo", "prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
            wait_for(lambda: len(first.supervisor.kv.index) >= sum(len(p) // 16 for p in prompts),
                     what="the first replica's index to learn every prompt")
            for sim in first.supervisor.simulators.values():
                sim.kv_publisher.forget_history()  # a cold replica could not replay any of it
            second = start("second", nats.url, embeds=False)
            try:
                second.wait_serving(2)
                wait_for(lambda: len(second.supervisor.kv.live) == 2, what="KV subscriptions")
                warm = fleet(second)["replicas"]["kv_warm_start"]
                assert warm.startswith("from "), warm
                for prompt in prompts:
                    expected = overlaps(first, prompt)
                    assert expected, "the first replica predicts a hit"
                    assert overlaps(second, prompt) == expected
                # and it stays in step: a new prompt reaches both through live events
                fresh = [1850 + i for i in range(64)]
                http.post(second.url + "/v1/completions",
                           json={"model": "demo", "prompt": fresh, "max_tokens": 2})
                wait_for(lambda: overlaps(first, fresh) and
                         overlaps(second, fresh) == overlaps(first, fresh),
                         what="both replicas to learn the new prompt")
            finally:
                second.stop()
        finally:
            first.stop()


def test_nats_killed_and_restarted_under_load_fails_no_request(
    model_dir: Path, tmp_path: Path
) -> None:
    engines = [sim_engine("a", "sglang", **FAST), sim_engine("b", "sglang", **FAST)]
    nats = NatsServer().start()
    try:
        with replicas(tmp_path, model_dir, engines, nats.url, 2) as daemons:
            for daemon in daemons:
                wait_for(lambda d=daemon: len(peers_of(d)) == 1, what="siblings")
            failures: list[str] = []
            done = threading.Event()
            sent = [0]

            def load() -> None:
                with httpx.Client(timeout=10) as client:
                    while not done.is_set():
                        daemon = daemons[sent[0] % 2]
                        r = client.post(daemon.url + "/v1/completions",
                                        json={"model": "demo", "prompt": "x", "max_tokens": 4})
                        sent[0] += 1
                        if r.status_code != 200:
                            failures.append(r.text)

            worker = threading.Thread(target=load)
            worker.start()
            try:
                wait_for(lambda: sent[0] >= 20, what="load running")
                nats.kill()
                for daemon in daemons:
                    wait_for(lambda d=daemon: fleet(d)["replicas"]["degraded"], what="degraded")
                # the gauge follows at the link's next round
                wait_for(lambda: "direct_frontend_replica_degraded 1.0" in http.get(
                    daemons[0].url + "/metrics").text, what="the degraded gauge")
                during = sent[0]
                wait_for(lambda: sent[0] >= during + 20, what="requests served while degraded")
                nats.start()
                for daemon in daemons:
                    wait_for(lambda d=daemon: not fleet(d)["replicas"]["degraded"]
                             and len(peers_of(d)) == 1, timeout=15, what="resynced")
                after = sent[0]
                wait_for(lambda: sent[0] >= after + 20, what="requests after the resync")
            finally:
                done.set()
                worker.join(30)
            assert failures == []
            wait_for(lambda: "direct_frontend_replica_degraded 0.0" in http.get(
                daemons[0].url + "/metrics").text, what="the gauge back at 0")
    finally:
        nats.kill()


def test_placements_made_while_nats_is_down_reach_a_sibling_back_after_they_were_sent(
    model_dir: Path, tmp_path: Path
) -> None:
    """NATS keeps nothing for a subscriber that is not there: a sibling back on the link
    after the replica that placed requests while it was down sent them still hears them,
    sent again when the replica hears that sibling anew."""
    engines = [sim_engine(f"e{i}", "sglang", **FAST) for i in range(3)]
    nats = NatsServer().start()
    try:
        with replicas(tmp_path, model_dir, engines, nats.url, 2, policy="kv_aware") as (a, b):
            wait_for(lambda: peers_of(a) and peers_of(b), what="siblings")
            nats.kill()
            wait_for(lambda: fleet(a)["replicas"]["degraded"] and fleet(b)["replicas"]["degraded"],
                     what="degraded")
            prompt = "a prefix placed while the link is down " * 8
            r = http.post(a.url + "/v1/completions",
                           json={"model": "demo", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            policy_b = b.control.models.get("demo").settings.policy
            text_model = a.control.models.get("demo").relay.text_model
            ids = text_model.encode(prompt, add_special_tokens=True)
            hashes = policy_b.hashes(ids)

            def known_to_b() -> dict[str, int]:
                found: dict[str, int] = b.run_sync(
                    lambda: policy_b.approx.lookup_at(hashes, policy_b.clock()))
                return found

            assert known_to_b() == {}
            subject = Subjects(a.control.settings.frontend.replicas.cluster).placements
            with b.frozen(), a.frozen() as thaw_a:  # b comes back late
                nats.start()
                sent = decode(Placements, first_message(nats.url, subject, then=thaw_a))
                assert sent is not None
                assert list(hashes) in [h[: len(hashes)] for _, h in sent.each()]
            wait_for(lambda: bool(known_to_b()), what="the placements sent again")
            unit = policy_b.approx.unit  # the memory matches whole units of blocks
            assert max(known_to_b().values()) == len(hashes) // unit * unit
    finally:
        nats.kill()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_replica_does_not_start_against_a_nats_server_anyone_may_use(
    model_dir: Path, tmp_path: Path, workers: str
) -> None:
    """``run`` exits with one line naming the server and the way out, before serving (with
    ``--workers``, the parent: not each worker in a restart loop)."""
    engines = [sim_engine("e0", "sglang", **FAST)]
    path = tmp_path / "fleet.toml"
    with running_nats(auth=False) as nats:
        path.write_text(fleet_for(model_dir, engines, nats.url, embeds=False))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        ran = subprocess.run([sys.executable, "-m", "direct_frontend.cli", "run", str(path),
                              "--workers", workers],
                             capture_output=True, text=True, timeout=60, env=env)
    assert ran.returncode == 1, ran.stderr
    assert (f"direct-frontend: cannot start: replicas: not sharing over NATS at {nats.url}: "
            "it lets any client in") in ran.stderr
    assert "set insecure = true in [frontend.replicas]" in ran.stderr
    assert "Traceback" not in ran.stderr
