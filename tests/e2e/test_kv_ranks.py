"""Data-parallel engines: one cache per rank, and each request pinned to the rank holding it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from direct_frontend.simulator import SimEngine
from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.simulator.model import TimingModel
from tests.e2e.test_kv import TIMING, complete, metric
from tests.support.daemon import (
    Daemon,
    free_ports,
    kv_fleet_text,
    raw_stream,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import http
from tests.support.sim import EngineThread


def ranked_engine(model_dir: Path, kind: str, **options: object) -> EngineThread:
    engine = SimEngine.from_model_dir(
        kind, model_dir, served_model_name="demo", timing=TimingModel(), eos_probability=0.0,
        dp_size=2, kv_events_port=0, kv_replay_port=0, page_size=16, **options,
    )
    return EngineThread(engine)


def events_table(engine: SimEngine, ranks: int = 2, **extra: object) -> dict[str, object]:
    """The [[engine]] table of ``engine`` running beside, with its first ``ranks`` ranks' events."""
    return {"name": "e", "url": f"grpc://127.0.0.1:{engine.port}", "kind": engine.kind,
            "block_size": 16, "kv_events": engine.kv_events_endpoints[:ranks],
            "kv_replay": engine.kv_replay_endpoints[:ranks], **extra}


@contextlib.contextmanager
def following(model_dir: Path, tmp_path: Path, table: dict[str, object]) -> Iterator[Daemon]:
    """A daemon of the one engine ``table`` names, serving it and following its KV events."""
    with running_daemon(tmp_path, kv_fleet_text(model_dir, [table])) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["e"]
        kv = daemon.supervisor.kv
        wait_for(lambda: child.incarnation in kv.live, what="the ranks' subscriptions")
        yield daemon


def cached(body: dict[str, object]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index, no-any-return]


def test_each_conversation_stays_on_the_rank_holding_it(model_dir: Path, tmp_path: Path) -> None:
    kind = "vllm"
    with ranked_engine(model_dir, kind) as sim:
        engine = sim.engine
        with following(model_dir, tmp_path, events_table(engine)) as daemon:
            child = daemon.supervisor.children["e"]
            kv = daemon.supervisor.kv
            row = http.get(daemon.url + "/fleet").json()["engines"][0]
            assert [r["rank"] for r in row["dp_ranks"]] == [0, 1]
            ranks = engine.stats.rank_of
            first, second = list(range(300, 460)), list(range(600, 760))  # 10 blocks each
            complete(daemon, [*first, 1, 2, 3])
            key0, key1 = (f"g{child.incarnation}r{rank}" for rank in (0, 1))
            wait_for(lambda: kv.index.blocks_of(key0) >= 10, what="rank 0 to hold it")
            complete(daemon, [*second, 1, 2, 3])  # a new prefix: the emptier rank
            wait_for(lambda: kv.index.blocks_of(key1) >= 10, what="rank 1 to hold it")
            assert list(ranks.values())[-2:] == [0, 1]
            # each follow-up where its conversation lives, the idler rank 0 notwithstanding
            assert cached(complete(daemon, [*second, 4, 5, 6])) == 160
            assert list(ranks.values())[-1] == 1
            assert cached(complete(daemon, [*first, 4, 5, 6])) == 160
            assert list(ranks.values())[-1] == 0
            predicted = metric(daemon, "direct_frontend_kv_predicted_cached_tokens_total")
            reported = metric(daemon, "direct_frontend_kv_reported_cached_tokens_total")
            assert predicted == reported == 320
            assert [r["load"] for r in http.get(daemon.url + "/fleet").json()["engines"][0][
                "dp_ranks"]] == [0, 0]  # every pinned request ended


def test_a_simulated_engine_has_a_rank_per_kv_events_endpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    """``simulate = true`` with two endpoints on consecutive ports: two ranks, each pinned to."""
    events, replay = free_ports(2), free_ports(2)
    table = sim_engine("e", "vllm", **TIMING)
    table["kv_events"] = [f"tcp://127.0.0.1:{events + r}" for r in (0, 1)]
    table["kv_replay"] = [f"tcp://127.0.0.1:{replay + r}" for r in (0, 1)]
    table["block_size"] = 16
    with running_daemon(tmp_path, kv_fleet_text(model_dir, [table])) as daemon:
        daemon.wait_serving(1)
        child = daemon.supervisor.children["e"]
        kv = daemon.supervisor.kv
        wait_for(lambda: child.incarnation in kv.live, what="both ranks' subscriptions")
        engine = daemon.supervisor.simulators["e"]
        assert len(engine.kv_ranks) == 2
        conversations = [list(range(300, 460)), list(range(600, 760))]
        for n, prompt in enumerate(conversations):
            complete(daemon, [*prompt, 1, 2, 3])
            key = f"g{child.incarnation}r{n}"
            wait_for(lambda key=key: kv.index.blocks_of(key) >= 10, what=f"rank {n} to hold it")
        assert cached(complete(daemon, [*conversations[1], 4, 5, 6])) == 160
        assert list(engine.stats.rank_of.values()) == [0, 1, 1]


def test_too_few_endpoints_for_the_ranks_is_a_warning_and_nothing_is_pinned(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ranked_engine(model_dir, "vllm") as sim:
        engine = sim.engine
        with caplog.at_level("WARNING"), \
                running_daemon(tmp_path, kv_fleet_text(model_dir, [events_table(engine, 1)])) \
                as daemon:
            daemon.wait_serving(1)
            assert http.get(daemon.url + "/fleet").json()["engines"][0]["dp_ranks"] == []
            complete(daemon, [*range(300, 460), 1])
            complete(daemon, [*range(300, 460), 2])
            assert list(engine.stats.rank_of.values()) == [0, 1]  # the engine's own balance
        warned = [r.getMessage() for r in caplog.records if "data-parallel ranks" in r.getMessage()]
        assert warned == ["engine e has 2 data-parallel ranks but the fleet file lists 1 "
                          "kv_events endpoint(s): unless its servicer serves only 1 of them "
                          "(multi-node data parallelism), list one per rank (base port + rank) "
                          "so that KV-aware routing sees every rank's cache"]


def test_without_kv_events_dp_ranks_pins_by_the_approximate_memory(
    model_dir: Path, tmp_path: Path
) -> None:
    """``dp_ranks = 2`` on an engine that publishes nothing: what we sent each rank is its own."""
    table = sim_engine("e", "vllm", **TIMING)
    table["dp_ranks"] = 2
    with running_daemon(tmp_path, kv_fleet_text(model_dir, [table])) as daemon:
        daemon.wait_serving(1)
        row = http.get(daemon.url + "/fleet").json()["engines"][0]
        assert [r["rank"] for r in row["dp_ranks"]] == [0, 1]
        assert row["kv_routing"] == "approximate"
        engine = daemon.supervisor.simulators["e"]
        # 8 blocks of 16: whole units of the approximate memory (4 blocks), so what it
        # predicts is what the engine finds
        first, second = list(range(300, 428)), list(range(600, 728))
        complete(daemon, [*first, 1, 2, 3])
        complete(daemon, [*second, 1, 2, 3])  # the emptier rank, as far as we know
        assert cached(complete(daemon, [*second, 4, 5, 6])) == 128
        assert cached(complete(daemon, [*first, 4, 5, 6])) == 128
        assert list(engine.stats.rank_of.values()) == [0, 1, 1, 0]
        predicted = metric(daemon, "direct_frontend_kv_predicted_cached_tokens_total")
        assert predicted == metric(daemon, "direct_frontend_kv_reported_cached_tokens_total")


def test_a_vllm_servicer_that_names_no_ranks_is_not_pinned(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without GetLoads its first rank is unknown: a guess could be refused on every request."""
    with ranked_engine(model_dir, "vllm", serve_get_loads=False) as sim:
        engine = sim.engine
        with caplog.at_level("WARNING"), \
                running_daemon(tmp_path, kv_fleet_text(model_dir, [events_table(engine)])) \
                as daemon:
            daemon.wait_serving(1)
            assert http.get(daemon.url + "/fleet").json()["engines"][0]["dp_ranks"] == []
            complete(daemon, [*range(300, 460), 1])
        assert any("does not say which data-parallel ranks" in r.getMessage()
                   for r in caplog.records)


def test_sglang_ranks_are_indexed_apart_but_its_own_balancer_places_requests(
    model_dir: Path, tmp_path: Path
) -> None:
    """Its stock servicer drops the rank: no pin is sent, and each rank's events stay its own."""
    with ranked_engine(model_dir, "sglang") as sim:
        engine = sim.engine
        with following(model_dir, tmp_path, events_table(engine)) as daemon:
            child = daemon.supervisor.children["e"]
            kv = daemon.supervisor.kv
            assert http.get(daemon.url + "/fleet").json()["engines"][0]["dp_ranks"] == []
            prompt = list(range(300, 460))
            # the engine's balancer takes turns between its ranks (its own health probes
            # take turns too, so ours may land twice on one): each rank gets one of ours
            for n in range(1, 9):
                complete(daemon, [*prompt, n])
                if set(engine.stats.rank_of.values()) == {0, 1}:
                    break
            assert set(engine.stats.rank_of.values()) == {0, 1}
            for rank in (0, 1):
                key = f"g{child.incarnation}r{rank}"
                wait_for(lambda key=key: kv.index.blocks_of(key) >= 10, what=f"rank {rank}")


def test_a_pinned_stream_whose_engine_dies_continues_pinned_on_another(
    model_dir: Path, tmp_path: Path
) -> None:
    """Token-exact migration from one data-parallel engine to a rank of the other; every
    rank's count of our requests is back to 0 after, the dead leg's too."""
    tables = []
    for name in ("a", "b"):
        table = sim_engine(name, "vllm", decode_us_per_token=300, prefill_us_per_token=0,
                           eos_probability=0.0)
        events, replay = free_ports(2), free_ports(2)
        table["kv_events"] = [f"tcp://127.0.0.1:{events + r}" for r in (0, 1)]
        table["kv_replay"] = [f"tcp://127.0.0.1:{replay + r}" for r in (0, 1)]
        table["block_size"] = 16
        tables.append(table)
    body = {"model": "demo", "prompt": [*range(300, 460), 7], "max_tokens": 60,
            "temperature": 0, "stream": True}

    def streamed(daemon: Daemon) -> str:
        with http.stream("POST", daemon.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        return "".join(json.loads(line)["choices"][0]["text"] for line in lines)

    with running_daemon(tmp_path, kv_fleet_text(model_dir, tables)) as daemon:
        daemon.wait_serving(2)
        kv = daemon.supervisor.kv
        children = daemon.supervisor.children
        wait_for(lambda: all(c.incarnation in kv.live for c in children.values()),
                 what="every rank's subscription")
        expected = streamed(daemon)
        sims = daemon.supervisor.simulators
        home = next(name for name, sim in sims.items() if sim.stats.rank_of)
        other = "b" if home == "a" else "a"
        rank = next(iter(sims[home].stats.rank_of.values()))
        key = f"g{children[home].incarnation}r{rank}"
        wait_for(lambda: kv.index.blocks_of(key) >= 10, what="the prefix indexed")
        sims[home].faults = FaultPlan(die_after_tokens=20, only_request=1)
        assert streamed(daemon) == expected  # the prefix's engine and rank, then the other
        assert len(sims[home].fault_stats.died) == 1
        (continued,) = sims[other].stats.received.values()  # pinned there too: it names a rank
        assert continued.HasField("data_parallel_rank")
        assert sims[other].stats.rank_of == {continued.request_id: continued.data_parallel_rank}
        (first, died) = sims[home].stats.received.values()
        assert first.data_parallel_rank == died.data_parallel_rank == rank  # its prefix's rank
        for engine in http.get(daemon.url + "/fleet").json()["engines"]:
            assert [r["load"] for r in engine["dp_ranks"]] == [0, 0], engine["name"]


def test_another_routers_requests_on_a_rank_count_from_the_engines_report(
    model_dir: Path, tmp_path: Path
) -> None:
    """Router X keeps streams on the engine, two on rank 0 and one on rank 1; router Y reads
    them in GetLoads, per rank, and sends its own to the idler rank 1."""
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    long = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400, "stream": True}
    with ranked_engine(model_dir, "vllm", faults=FaultPlan(token_delay_s=0.05)) as sim:
        engine = sim.engine
        table = {"name": "e", "url": f"grpc://127.0.0.1:{engine.port}", "kind": "vllm",
                 "dp_ranks": 2}
        with running_daemon(tmp_path / "x", kv_fleet_text(model_dir, [dict(table)])) as x, \
                running_daemon(tmp_path / "y", kv_fleet_text(model_dir, [dict(table)])) as y, \
                contextlib.ExitStack() as streams:
            x.wait_serving(1)
            y.wait_serving(1)
            for _ in range(3):
                streams.enter_context(raw_stream(x.url, long, events=2))
            assert sorted(engine.stats.rank_of.values()) == [0, 0, 1]

            def row(daemon: Daemon) -> dict[str, object]:
                fleet: dict[str, object] = http.get(daemon.url + "/fleet").json()["engines"][0]
                return fleet

            wait_for(lambda: row(y)["foreign_load"] == 3, what="y to read the engine's report")
            complete(y, [5, 6, 7, 8])
            assert list(engine.stats.rank_of.values())[-1] == 1
