"""``bench_routing.py live``: the routing policies in real time, shape by shape.

Each shape (``routing_shapes.py``: fleet, traffic) gets its simulated engines
(standalone processes, ``bench_routing.py engine``) in batched scheduler steps
(``direct_frontend/simulator/steps.py``: prefill slows with the prefills ahead
of it, decode with the batch), each with its prefix cache and KV events over
ZMQ. Then, for every seed and every mode, the engines start over empty (as
new processes: empty caches, KV-event sequences from 0), a fresh daemon runs
the mode's fleet file, and the seed's sessions play against it over real
sockets: streaming chat completions whose answers are appended to the
history, sessions starting open-loop, each turn ``think`` seconds after the
previous answer. Modes: ``round_robin``, ``least_loaded``, ``cache_affinity``
(KV events), ``kv-events`` (``kv_aware`` with KV events) and ``approximate``
(``kv_aware`` without). The same sessions also play in virtual time
(``routing_shapes.run_virtual``), over more seeds (``--model-seeds``: one
run is chaotic, a request placed a millisecond later moves the rest), so
each table shows where the model ranks the modes as the real run does
(pairs of modes under 10 % apart on both sides count as level), and the
pooled-LRU reference. For the modes with KV events, how late the daemon's
index was behind the engines (its ``direct_frontend_kv_event_lag_seconds``,
scraped at the end of each run; p50 and p99 interpolated within its buckets).

Figures per mode: TTFT (client-side, sent → first content token) mean, p90
and p99 over both seeds, and each seed's mean and p90 (their spread is the
noise: the machine is shared); the engines' hit rate (Σ ``cached_tokens`` / Σ
prompt tokens, as the daemon reports them); the engines' evictions (blocks)
and requests per engine.

Usage::

    python scripts/bench_routing.py live             # the grid, ~15 min on 2 cores
    python scripts/bench_routing.py live --quick     # 2 shapes, ~5 min
    python scripts/bench_routing.py live --shapes two-engines --seeds 1 --modes kv-events
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from bench_overhead import (
    HOST,
    MODEL,
    MODEL_DIR,
    Child,
    cli_argv,
    free_ports,
    proc_cpu_seconds,
    wait_for_port,
)
from bench_routing import (
    ModeUnavailable,
    RequestFailed,
    _text,
    _words,
    engine_stats,
    machine_busy_seconds,
    metric_sum,
    one_turn,
    parse_knobs,
    parse_metrics,
    wait_all_serving,
)
from routing_shapes import MODES, OURS, POOLED_LRU, QUICK, Session, Shape, run_virtual, sessions
from routing_shapes import shapes as all_shapes
from tokenizers import Tokenizer

POLICY = {"round_robin": "round_robin", "least_loaded": "least_loaded",
          "cache_affinity": "cache_affinity", "approximate": "kv_aware", "kv-events": "kv_aware"}
WITH_EVENTS = ("cache_affinity", "kv-events")
#: the engines' window: an agent's session outgrows the demo model's 4,096 tokens
CONTEXT = 32768


# -- engines ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class EnginePorts:
    name: str
    grpc: int
    stats: int
    kv: tuple[int, int]


class Fleet:
    """One shape's engine processes, started once and reset before every run."""

    def __init__(self, shape: Shape, kind: str, tmp: pathlib.Path) -> None:
        self.shape = shape
        self.kind = kind
        ports = free_ports(4 * shape.engines)
        self.engines = [EnginePorts(f"e{n}", *ports[4 * n:4 * n + 2],
                                    (ports[4 * n + 2], ports[4 * n + 3]))
                        for n in range(shape.engines)]
        self.children: list[Child] = []
        script = pathlib.Path(__file__).resolve().with_name("bench_routing.py")
        for n, e in enumerate(self.engines):
            argv = [
                sys.executable, str(script), "engine", "--kind", kind,
                "--port", str(e.grpc), "--stats-port", str(e.stats),
                "--prefill-us", str(shape.prefill_us), "--decode-us", str(shape.decode_us),
                "--max-running", str(shape.max_running), "--block-size", str(shape.page_size),
                "--capacity-blocks", str(shape.cache_of(n) // shape.page_size),
                "--chunk-tokens", str(shape.chunk_tokens), "--step-us", str(shape.step_us),
                "--kv-events-port", str(e.kv[0]), "--kv-replay-port", str(e.kv[1]),
                "--context-length", str(CONTEXT),
            ]
            self.children.append(Child(f"{shape.name}:{e.name}", argv, tmp / f"{e.name}.log"))

    async def ready(self) -> None:
        for child, e in zip(self.children, self.engines, strict=True):
            await wait_for_port(child, e.grpc, limit_s=60)
            await wait_for_port(child, e.stats, limit_s=60)

    async def reset(self) -> list[dict[str, Any]]:
        """Every engine as a new process; their counters (which carry on) as of now."""
        return [await engine_stats(e.stats, b"reset") for e in self.engines]

    async def stats(self) -> list[dict[str, Any]]:
        return [await engine_stats(e.stats) for e in self.engines]

    def stop(self) -> None:
        for child in self.children:
            child.stop()


def fleet_text(mode: str, listen: int, fleet: Fleet, knobs: dict[str, str]) -> str:
    shape = fleet.shape
    lines = [
        "[frontend]", f'listen = "{HOST}:{listen}"', f'served_model_name = "{MODEL}"',
        f"tokenizer = {json.dumps(str(MODEL_DIR))}", "",
        "[frontend.responses]", 'backend = "memory"', "",  # nothing stored: no database
        "[frontend.routing]", f'policy = "{POLICY[mode]}"', "",
    ]
    if POLICY[mode] in ("kv_aware", "cache_affinity"):
        merged = {"block_size": str(shape.block_size), **knobs}
        lines += ["[frontend.routing.knobs]", *(f"{k} = {v}" for k, v in merged.items()), ""]
    for e in fleet.engines:
        lines += ["[[engine]]", f'name = "{e.name}"', f'url = "grpc://{HOST}:{e.grpc}"',
                  f'kind = "{fleet.kind}"', f"block_size = {shape.page_size}",
                  f"context_length = {CONTEXT}"]
        if mode in WITH_EVENTS:
            lines += [f'kv_events = ["tcp://{HOST}:{e.kv[0]}"]',
                      f'kv_replay = ["tcp://{HOST}:{e.kv[1]}"]']
        lines.append("")
    return "\n".join(lines)


# -- traffic -----------------------------------------------------------------------


class Texts:
    """The seed's words: each tenant's system prompt, each session's messages."""

    def __init__(self, shape: Shape, seed: int, plays: Sequence[Session],
                 tokenizer: Tokenizer, words: Sequence[str]) -> None:
        rng = random.Random(seed ^ 0x7E47)
        self.systems = [f"You are assistant number {k}. "
                        + _text(rng, words, tokenizer, shape.system_tokens)
                        for k in range(shape.tenants)]
        prefix = "Tool output: " if shape.agent else ""
        self.messages = {s.number: [prefix + _text(rng, words, tokenizer, t.message)
                                    for t in s.turns] for s in plays}


@dataclasses.dataclass(slots=True)
class Sample:
    session: int
    turn: int
    sent: float
    ttft: float
    prompt_tokens: int
    cached_tokens: int


async def turn(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]],
               max_tokens: int) -> tuple[float, int, int, str]:
    """One streamed chat completion: TTFT (s), prompt and cached tokens, the answer."""
    sample = await one_turn(client, base, messages, max_tokens, 0, 0)
    return sample.ttft, sample.prompt_tokens, sample.cached_tokens, sample.answer


async def play(client: httpx.AsyncClient, base: str, plays: Sequence[Session],
               texts: Texts) -> tuple[list[Sample], list[str]]:
    """Every session, each from its start time, turn after turn."""
    samples: list[Sample] = []
    errors: list[str] = []
    t0 = time.perf_counter()

    async def one(session: Session) -> None:
        await asyncio.sleep(max(0.0, session.start - (time.perf_counter() - t0)))
        history = [{"role": "system", "content": texts.systems[session.tenant]}]
        for k, step in enumerate(session.turns):
            if step.think_s:
                await asyncio.sleep(step.think_s)
            history.append({"role": "user", "content": texts.messages[session.number][k]})
            sent = time.perf_counter() - t0
            try:
                ttft, prompt, cached, answer = await turn(client, base, history, step.answer)
            except (RequestFailed, httpx.HTTPError, ValueError, KeyError) as exc:
                errors.append(f"session {session.number} turn {k}: {exc!r}")
                return  # the session stops here
            samples.append(Sample(session.number, k, sent, ttft, prompt, cached))
            history.append({"role": "assistant", "content": answer})

    async with asyncio.TaskGroup() as group:
        for session in plays:
            group.create_task(one(session))
    return samples, errors


# -- one run ---------------------------------------------------------------------------


async def run_mode(mode: str, seed: int, fleet: Fleet, plays: Sequence[Session], texts: Texts,
                   args: argparse.Namespace, tmp: pathlib.Path) -> dict[str, Any]:
    """The engines reset, a fresh daemon for ``mode``, the seed's sessions; the figures."""
    before = await fleet.reset()
    (listen,) = free_ports(1)
    path = tmp / f"fleet-{mode}-{seed}.toml"
    path.write_text(fleet_text(mode, listen, fleet, args.knobs))
    daemon = Child(f"{mode}:daemon", [*cli_argv(), "run", str(path), "--log-level", "WARNING",
                                      "--no-watch"], tmp / f"daemon-{mode}-{seed}.log")
    base = f"http://{HOST}:{listen}"
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    out: dict[str, Any] = {"mode": mode, "seed": seed}
    try:
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            try:
                await wait_all_serving(daemon, client, base, len(fleet.engines))
            except ModeUnavailable as exc:
                return {**out, "status": "unavailable", "reason": str(exc)}
            busy0, wall0 = machine_busy_seconds(), time.perf_counter()
            cpu0 = cpu_split(daemon, fleet)
            samples, errors = await play(client, base, plays, texts)
            wall = time.perf_counter() - wall0
            busy = machine_busy_seconds() - busy0
            cpu = {k: (v - cpu0[k]) / wall for k, v in cpu_split(daemon, fleet).items()}
            metrics = parse_metrics((await client.get(base + "/metrics")).text)
        daemon.check_alive()
    finally:
        daemon.stop()
    after = await fleet.stats()
    ttft = sorted(s.ttft * 1e3 for s in samples)
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    index = metric_sum(metrics, "direct_frontend_kv_index_blocks")
    shape = fleet.shape
    return {
        **out, "status": "ok" if mode not in WITH_EVENTS or index else "events not consumed",
        "requests": len(samples), "errors": errors[:5], "error_count": len(errors),
        "ttft_ms": ttft, "ttft_mean_ms": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / max(1, prompt),
        # what the engines charge for the uncached tokens: the part of TTFT that no CPU
        # contention on a shared machine touches
        "prefill_ms": (prompt - cached) * shape.prefill_us / 1e3 / max(1, len(samples)),
        "evictions": sum(a["evictions"] - b["evictions"] for a, b in zip(after, before,
                                                                          strict=True)),
        "per_engine": [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)],
        "wall_s": wall, "cores_busy": busy / max(1e-9, wall), "cores": cpu,
        "lag_buckets": lag_buckets(metrics),
    }


LAG = "direct_frontend_kv_event_lag_seconds"


def lag_buckets(samples: Sequence[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """The daemon's KV-event lag histogram, every engine's together: cumulative count by
    ``le``, and the observations' ``sum`` (empty without KV events)."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == LAG + "_bucket":
            out[labels["le"]] = out.get(labels["le"], 0.0) + value
        elif name == LAG + "_sum":
            out["sum"] = out.get("sum", 0.0) + value
    return out


def add_buckets(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for run in runs:
        for key, value in run.items():
            total[key] = total.get(key, 0.0) + value
    return total


def lag_figures(buckets: dict[str, float]) -> dict[str, float] | None:
    """p50, p99 (interpolated within a bucket, as Prometheus' ``histogram_quantile``) and mean
    of the index's lag behind the engines, in ms, and the live batches counted."""
    bounds = sorted((float(le), count) for le, count in buckets.items() if le != "sum")
    if not bounds or bounds[-1][1] == 0:
        return None
    n = bounds[-1][1]

    def quantile(q: float) -> float:
        lower, below = 0.0, 0.0
        for le, count in bounds:
            if count >= q * n:
                if math.isinf(le):
                    return lower  # above the largest finite bound: a lower bound
                return lower + (le - lower) * (q * n - below) / max(count - below, 1e-12)
            lower, below = le, count
        return lower  # (not reached: the +Inf bucket holds n)

    return {"p50_ms": 1e3 * quantile(0.5), "p99_ms": 1e3 * quantile(0.99),
            "mean_ms": 1e3 * buckets.get("sum", 0.0) / n, "batches": n}


def lag_text(buckets: dict[str, float]) -> str:
    f = lag_figures(buckets)
    return "" if f is None else (
        f"index lag p50 {f['p50_ms']:.1f} p99 {f['p99_ms']:.1f} mean {f['mean_ms']:.1f} ms over "
        f"{f['batches']:.0f} live batches")


def cpu_split(daemon: Child, fleet: Fleet) -> dict[str, float]:
    """CPU seconds so far of the daemon, the engines and this client."""
    return {"daemon": proc_cpu_seconds(daemon.pid),
            "engines": sum(proc_cpu_seconds(c.pid) for c in fleet.children),
            "client": time.process_time()}


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``values``."""
    if not values:
        return math.nan
    return values[max(0, math.ceil(q / 100 * len(values)) - 1)]


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A mode's runs (one per seed) as one row; each seed's mean and p90 kept apart."""
    ok = [r for r in runs if r.get("status") != "unavailable" and r.get("ttft_ms")]
    if not ok:
        return {"mode": runs[0]["mode"], "status": "unavailable"}
    ttft = sorted(t for r in ok for t in r["ttft_ms"])
    return {
        "mode": ok[0]["mode"], "status": ok[0].get("status", "ok"),
        "ttft_mean_ms": statistics.fmean(ttft), "ttft_p90_ms": pct(ttft, 90),
        "ttft_p99_ms": pct(ttft, 99),
        "seed_means": [r["ttft_mean_ms"] for r in ok], "seed_p90s": [r["ttft_p90_ms"] for r in ok],
        "seed_sums": [sum(r["ttft_ms"]) for r in ok],
        "seed_counts": [len(r["ttft_ms"]) for r in ok],
        "hit_rate": sum(r["cached_tokens"] for r in ok) / max(
            1, sum(r["prompt_tokens"] for r in ok)),
        "seed_hits": [r["hit_rate"] for r in ok],
        "seed_ids": [r.get("seed", i) for i, r in enumerate(ok)],
        "prefill_ms": statistics.fmean(r.get("prefill_ms", math.nan) for r in ok),
        "evictions": statistics.fmean(r["evictions"] for r in ok),
        "per_engine": ok[0]["per_engine"], "requests": sum(r["requests"] for r in ok),
        "error_count": sum(r.get("error_count", 0) for r in ok),
        "cores_busy": max((r.get("cores_busy", 0.0) for r in ok), default=0.0),
        "lag_buckets": add_buckets([r.get("lag_buckets", {}) for r in ok]),
    }


# -- report ----------------------------------------------------------------------------


def ranking(rows: dict[str, dict[str, Any]], key: str) -> list[str]:
    modes = [m for m in MODES if m in rows and rows[m].get("status") != "unavailable"]
    return sorted(modes, key=lambda m: rows[m][key])


def print_shape(shape: Shape, live: dict[str, dict[str, Any]],
                virtual: dict[str, dict[str, Any]], model_seeds: Sequence[int]) -> dict[str, Any]:
    print(f"\n## {shape.describe()}", flush=True)
    print("| mode | TTFT mean | p90 | p99 (ms) | seeds' mean / p90 | hit | seeds' hit | prefill "
          f"(ms) | evictions | per engine | model, {len(model_seeds)} seeds: mean / p90 / hit |")
    print("|---|---:|---:|---:|---|---:|---|---:|---:|---|---|")
    for mode in [*MODES, POOLED_LRU]:
        r, v = live.get(mode), virtual.get(mode)
        model = (f"{v['ttft_mean_ms']:.0f} / {v['ttft_p90_ms']:.0f} / {v['hit_rate']:.3f}"
                 if v else "–")
        if r is None or r.get("status") == "unavailable":
            if v is not None:
                print(f"| {mode} | – | – | – | – | – | – | – | – | – | {model} |")
            continue
        seeds = ", ".join(f"{m:.0f}/{p:.0f}" for m, p in zip(r["seed_means"], r["seed_p90s"],
                                                               strict=True))
        mark = "" if r["status"] == "ok" else f" ⚠ {r['status']}"
        print(f"| {mode}{mark} | {r['ttft_mean_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {seeds} | {r['hit_rate']:.3f} | "
              f"{', '.join(f'{h:.3f}' for h in r['seed_hits'])} | {r['prefill_ms']:.1f} | "
              f"{r['evictions']:.0f} | "
              f"{r['per_engine']} | {model} |")
    for mode in MODES:
        lag = lag_text(live.get(mode, {}).get("lag_buckets", {}))
        if lag:
            print(f"\n{mode}: {lag} (the daemon's {LAG}, its seeds pooled)")
    return verdict(shape, live, virtual)


def verdict(shape: Shape, live: dict[str, dict[str, Any]],
            virtual: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ours against the best other mode, cache_affinity and approximate; model's ranking."""
    out: dict[str, Any] = {"shape": shape.name}
    for name, rows in (("live", live), ("model", virtual)):
        ours = rows.get(OURS)
        if ours is None or ours.get("status") == "unavailable":
            continue
        approx = rows.get("approximate")
        if approx is not None and approx.get("status") != "unavailable":
            out[f"{name}_vs_approximate"] = versus_approximate(approx, ours)
        others = [r for m, r in rows.items() if m in MODES and m not in (OURS, "approximate")
                  and r.get("status") != "unavailable"]
        if not others:
            continue
        best = min(others, key=lambda r: r["ttft_mean_ms"])
        best_p90 = min(r["ttft_p90_ms"] for r in others)
        best_hit = max(r["hit_rate"] for r in others)
        entry = {
            "best_other": best["mode"], "mean_ratio": best["ttft_mean_ms"] / ours["ttft_mean_ms"],
            "p90_ratio": best_p90 / ours["ttft_p90_ms"], "hit_gap": ours["hit_rate"] - best_hit,
            "ranking": ranking(rows, "ttft_mean_ms"),
            "hit_ranking": ranking(rows, "hit_rate")[::-1],
            "means": {m: rows[m]["ttft_mean_ms"] for m in ranking(rows, "ttft_mean_ms")},
            "hits": {m: rows[m]["hit_rate"] for m in ranking(rows, "hit_rate")},
        }
        means = ours.get("seed_means", [])
        if len(means) > 1:  # how far the seeds' means lie apart: below it, a gap is noise
            entry["seed_spread"] = (max(means) - min(means)) / statistics.fmean(means)
        affinity = rows.get("cache_affinity")
        if affinity is not None and affinity.get("status") != "unavailable":
            entry["vs_cache_affinity"] = affinity["ttft_mean_ms"] / ours["ttft_mean_ms"]
            band = seed_band(affinity, ours)
            if band is not None:
                entry["vs_cache_affinity_band"] = band
            if POOLED_LRU in rows:
                entry["room"] = affinity["ttft_mean_ms"] / rows[POOLED_LRU]["ttft_mean_ms"]
        out[name] = entry
    return out


def versus_approximate(approx: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """Approximate's pooled TTFT mean over ours, with the band the seeds alone move it in
    (:func:`seed_band`), and ours' hit rate minus approximate's: pooled, and each seed's
    difference's mean with its standard error over the seeds both modes played (paired:
    a gap within t(n − 1) standard errors, ≈ 3 for 4 seeds, ≈ 2 for 20, is the seeds'
    noise, not the modes')."""
    entry: dict[str, Any] = {
        "ttft_ratio": approx["ttft_mean_ms"] / ours["ttft_mean_ms"],
        "hit_gap": ours["hit_rate"] - approx["hit_rate"],
    }
    band = seed_band(approx, ours)
    if band is not None:
        entry["ttft_band"] = band
    mine, theirs = paired(ours, approx, "seed_hits")
    gaps = [a - b for a, b in zip(mine, theirs, strict=True)]
    if len(gaps) > 1:
        entry["seed_hit_gap"] = (statistics.fmean(gaps),
                                 statistics.stdev(gaps) / math.sqrt(len(gaps)), len(gaps))
    return entry


def paired(one: dict[str, Any], other: dict[str, Any], key: str) -> tuple[list[Any], list[Any]]:
    """Two rows' per-seed ``key`` over the seeds both played, in the same order (a mode
    that lost a seed drops it from the other's too)."""
    mine = dict(zip(one.get("seed_ids", []), one.get(key, []), strict=False))
    theirs = dict(zip(other.get("seed_ids", []), other.get(key, []), strict=False))
    common = [seed for seed in mine if seed in theirs]
    return [mine[seed] for seed in common], [theirs[seed] for seed in common]


def approximate_text(e: dict[str, Any]) -> str:
    """One line of :func:`versus_approximate`'s figures."""
    text = f"approximate/ours mean ×{e['ttft_ratio']:.2f}"
    if "ttft_band" in e:
        text += f" (seeds resampled: ×{e['ttft_band'][0]:.2f}–{e['ttft_band'][1]:.2f})"
    text += f", hit ours − approximate {e['hit_gap']:+.3f}"
    if "seed_hit_gap" in e:
        mean, error, seeds = e["seed_hit_gap"]
        text += f" (per seed {mean:+.3f} ± {error:.3f} s.e., {seeds} seeds)"
    return text


#: resamples of the seeds for :func:`seed_band`, and the band's share of them (5–95 %)
BAND_RESAMPLES = 2000
BAND = (0.05, 0.95)


def seed_band(one: dict[str, Any], other: dict[str, Any]) -> tuple[float, float] | None:
    """``one``'s pooled TTFT mean over ``other``'s, as the seeds alone move it (5–95 %).

    The same seeds are drawn, with replacement, for both modes, as many as
    were played, and each draw's pooled means compared: how far the ratio
    lies from the one measured only because of which seeds were played
    (where each tenant's sessions land decides a run). Seeds only one mode
    played are left out; None under 3 seeds both played.
    """
    sums = paired(one, other, "seed_sums")
    counts = paired(one, other, "seed_counts")
    n = len(sums[0])
    if n < 3:
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(BAND_RESAMPLES):
        draw = [rng.randrange(n) for _ in range(n)]
        mine = sum(sums[0][i] for i in draw) / sum(counts[0][i] for i in draw)
        theirs = sum(sums[1][i] for i in draw) / sum(counts[1][i] for i in draw)
        ratios.append(mine / theirs)
    ratios.sort()
    return ratios[int(BAND[0] * len(ratios))], ratios[int(BAND[1] * len(ratios)) - 1]


def summary(v: dict[str, Any]) -> str:
    parts = [v["shape"]]
    for name in ("live", "model"):
        e = v.get(name)
        if e is None:
            continue
        text = (f"{name}: ours/best-other ({e['best_other']}) mean ×{e['mean_ratio']:.2f} "
                f"p90 ×{e['p90_ratio']:.2f}, hit {e['hit_gap']:+.3f}")
        if "seed_spread" in e:
            text += f" (ours' seeds' means {100 * e['seed_spread']:.0f} % apart)"
        if "vs_cache_affinity" in e:
            text += f", vs cache_affinity ×{e['vs_cache_affinity']:.2f}"
            if "vs_cache_affinity_band" in e:
                low, high = e["vs_cache_affinity_band"]
                text += f" (seeds resampled: ×{low:.2f}–{high:.2f})"
        if "room" in e:
            text += f", pooled-LRU room ×{e['room']:.2f}"
        text += f"; ranking {' < '.join(e['ranking'])}"
        parts.append(text)
    for name in ("live", "model"):
        if (e := v.get(f"{name}_vs_approximate")) is not None:
            parts.append(f"{name}: {approximate_text(e)}")
    live, model = v.get("live"), v.get("model")
    if live and model:
        ttft = crossed(live["means"], model["means"], lambda a, b: b / a - 1, MARGIN)
        hits = crossed(live["hits"], model["hits"], lambda a, b: b - a, HIT_MARGIN)
        parts.append(
            f"TTFT rankings {'agree' if not ttft else 'DIFFER on ' + ', '.join(ttft)} "
            f"(modes under {100 * MARGIN:.0f} % apart on both sides count as level), "
            f"hit rankings {'agree' if not hits else 'DIFFER on ' + ', '.join(hits)} "
            f"(level under {100 * HIT_MARGIN:.0f} point)")
    return "\n  - ".join(parts)


#: TTFT means closer than this (relative) are level: the seeds' noise
MARGIN = 0.10
#: hit rates closer than this (absolute) are level
HIT_MARGIN = 0.01


def crossed(one: dict[str, float], other: dict[str, float],
            gap: Callable[[float, float], float], margin: float) -> list[str]:
    """The pairs of modes ``one`` and ``other`` order oppositely where either of them
    puts the two ``margin`` or more apart (``gap(a, b)``: by how much b is above a)."""
    out = []
    for a, b in itertools.combinations([m for m in one if m in other], 2):
        x, y = gap(one[a], one[b]), gap(other[a], other[b])
        if x * y < 0 and max(abs(x), abs(y)) >= margin:
            low, high = (a, b) if x > 0 else (b, a)
            out.append(f"{low} < {high} ({x:+.2f} vs {y:+.2f})")
    return out


# -- main --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_routing.py live",
                                description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    p.add_argument("--quick", action="store_true", help=f"the shapes {', '.join(QUICK)} only")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--model-seeds", default="1-32",
                   help="the virtual-time model's seeds, comma-separated, FIRST-LAST a range "
                        "(a run of one is chaotic: a request placed a millisecond later moves "
                        "the rest; on the agent loops one seed's cache_affinity/ours ratio "
                        "lies anywhere in ×0.5–2.9, so it takes tens of seeds to rank modes "
                        "that lie 10 %% apart)")
    p.add_argument("--daemon-ms", type=float, default=None,
                   help="the model's delay from a request's send to its engine (default: "
                        "each shape's)")
    p.add_argument("--event-lag-ms", type=float, default=None,
                   help="the model's delay from a cache change to the router's index")
    p.add_argument("--engine-slowdown", type=float, default=1.0,
                   help="the model's engines' step, prefill and decode times × this (what a "
                        "busy CPU does to the live engines; 1.1 puts the tight chat's modelled "
                        "p90 on the live one)")
    p.add_argument("--kind", choices=("sglang", "vllm"), default="sglang",
                   help="the engines' contract (sglang: what SMG speaks too)")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="a [frontend.routing.knobs] entry (repeatable; the virtual runs too)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds over which sessions start (default: each shape's)")
    p.add_argument("--no-live", action="store_true", help="the virtual-time model only")
    p.add_argument("--json", action="store_true", help="also one JSON line per shape")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    if not args.engine_slowdown > 0:
        p.error("--engine-slowdown: a factor above 0")
    names = [s.name for s in all_shapes()]
    chosen = args.shapes.split(",") if args.shapes else list(QUICK if args.quick else names)
    unknown = set(chosen) - set(names)
    if unknown:
        p.error(f"unknown shape(s) {sorted(unknown)}; choose from {names}")
    args.shapes = chosen
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - set(MODES):
        p.error(f"unknown mode(s); choose from {MODES}")
    args.seeds = seed_list(p, args.seeds)
    args.model_seeds = seed_list(p, args.model_seeds)
    args.knobs = parse_knobs(p, args.knob)
    return args


def seed_list(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``1,2,5`` or ``1-32`` (or both mixed) as the seeds they name, in order."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        try:
            out += range(int(first), int(last or first) + 1)
        except ValueError:
            parser.error(f"not a seed or a range of seeds: {part!r}")
    return out


def virtual_rows(shape: Shape, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    knobs = {k: float(v) if "." in v or "e" in v else int(v) for k, v in args.knobs.items()}
    if args.daemon_ms is not None:
        shape = dataclasses.replace(shape, daemon_s=args.daemon_ms / 1e3)
    if args.event_lag_ms is not None:
        shape = dataclasses.replace(shape, event_lag_s=args.event_lag_ms / 1e3)
    if args.engine_slowdown != 1.0:
        slow = args.engine_slowdown
        shape = dataclasses.replace(shape, step_us=shape.step_us * slow,
                                    prefill_us=shape.prefill_us * slow,
                                    decode_us=shape.decode_us * slow)
    return {mode: pooled([run_virtual(shape, seed, mode, knobs) for seed in args.model_seeds])
            for mode in [*args.modes, POOLED_LRU]}


async def live_rows(shape: Shape, args: argparse.Namespace, tokenizer: Tokenizer,
                    words: Sequence[str], tmp: pathlib.Path) -> dict[str, dict[str, Any]]:
    fleet = Fleet(shape, args.kind, tmp)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    try:
        await fleet.ready()
        for seed in args.seeds:
            plays = sessions(shape, seed)
            texts = Texts(shape, seed, plays, tokenizer, words)
            for mode in args.modes:
                r = await run_mode(mode, seed, fleet, plays, texts, args, tmp)
                runs[mode].append(r)
                if r["status"] == "unavailable":
                    print(f"  {mode} seed {seed}: unavailable: {r['reason']}", flush=True)
                    continue
                print(f"  {mode} seed {seed}: TTFT mean {r['ttft_mean_ms']:.1f} p90 "
                      f"{r['ttft_p90_ms']:.1f} ms, hit {r['hit_rate']:.3f}, {r['requests']} "
                      f"requests, per engine {r['per_engine']}, {r['wall_s']:.0f} s, cores busy "
                      f"{r['cores_busy']:.2f} (ours: daemon {r['cores']['daemon']:.2f}, engines "
                      f"{r['cores']['engines']:.2f}, client {r['cores']['client']:.2f})"
                      + (f", {lag}" if (lag := lag_text(r["lag_buckets"])) else "")
                      + (f", {r['error_count']} ERRORS {r['errors'][:2]}" if r["error_count"]
                         else "") + ("" if r["status"] == "ok" else f" ⚠ {r['status']}"),
                      flush=True)
    finally:
        fleet.stop()
    return {mode: pooled(rs) for mode, rs in runs.items() if rs}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    grid = [s for s in all_shapes() if s.name in args.shapes]
    if args.duration:
        grid = [dataclasses.replace(s, duration_s=args.duration) for s in grid]
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    words = _words(tokenizer)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-routing-live-"))
    print(f"bench_routing live: {os.cpu_count()} CPUs shared by the engines, the daemon and this "
          f"client; seeds {args.seeds}; modes {args.modes}; logs in {tmp}", flush=True)
    verdicts = []
    failed = False
    try:
        for shape in grid:
            print(f"\n# {shape.name}", flush=True)
            virtual = virtual_rows(shape, args)
            live: dict[str, dict[str, Any]] = {}
            if not args.no_live:
                (tmp / shape.name).mkdir()
                live = asyncio.run(live_rows(shape, args, tokenizer, words, tmp / shape.name))
            failed |= any(r.get("error_count") or r.get("status") not in ("ok", None)
                          for r in live.values())
            verdicts.append(print_shape(shape, live, virtual, args.model_seeds))
            if args.json:
                print(json.dumps({"shape": dataclasses.asdict(shape), "live": live,
                                  "model": virtual, "verdict": verdicts[-1]},
                                 separators=(",", ":")), flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print("\n## Summary (ours = kv-events; ratios > 1: ours faster; hit: ours − best other)")
    for v in verdicts:
        print(f"- {summary(v)}")
    if not (failed or args.keep_logs):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"\nLogs kept in {tmp}")
    return 1 if failed else 0
