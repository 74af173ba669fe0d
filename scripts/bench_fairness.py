#!/usr/bin/env python3
"""Fair share in real time: a quiet tenant's latency while another floods the fleet.

Starts ``direct-frontend run`` on a fleet of simulated engines (a fixed time
per token, so the fleet has a known capacity) with two API keys, then runs
open-loop streaming load in three phases of ``--seconds`` each:

1. **alone**: the quiet tenant sends at ``--quiet-share`` of the fleet's capacity;
2. **fair**: the same, while the flooding tenant sends at ``--flood-factor`` times the
   capacity with another key (its own tenant);
3. **one queue**: the same as 2, but the flood sends with the quiet tenant's key, so both
   are one tenant and share one first-come-first-served queue: what admission was before.

It prints the quiet tenant's TTFT p50 and p99 in each phase (and as ratios to
phase 1), its refused requests, the share of its requests that waited for an
admission slot (from ``/metrics``: what admission costs it, apart from the
rest of the path), the tokens each tenant was served per second and the
fleet's utilisation (tokens served over capacity) in phases 2 and 3.
``--weights 3:1`` instead floods with both keys at once, weighted 3:1, and
prints the split of the tokens served. ``--no-preempt`` runs the daemon with
``[frontend.limits] preempt = false`` (the last line counts the flood's streams preempted
otherwise). ``--tiers`` runs the service tiers
instead: the quiet tenant (allowed ``priority``) sends at ``--quiet-share``
(0.6 of capacity by default there) alone, then beside a ``flex`` flood (a
batch on idle capacity: the interactive TTFT should hardly move), then
beside a ``default`` flood, asking ``default`` and then ``priority``.
Figures, not assertions: compare them within one run.

The fleet routes ``least_loaded`` by default (``--routing``): with
``round_robin`` a request let in to a free slot may be placed on an engine
that has none (the turn ignores load) and wait in that engine's own queue,
which no admission policy sees.

Usage::

    python scripts/bench_fairness.py                     # ~1 min
    python scripts/bench_fairness.py --seconds 20 --flood-factor 10 --quiet-share 0.2
    python scripts/bench_fairness.py --weights 3:1
    python scripts/bench_fairness.py --tiers             # ~1.5 min
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import re
import statistics
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

import httpx
from bench_daemon import daemon, free_port, pct

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUIET_KEY, FLOOD_KEY = "sk-quiet-tenant-0001", "sk-flood-tenant-0002"
#: the daemon's keys, and which is which (the fleet file reads them from the environment)
ENV = {"BENCH_KEYS": f"{QUIET_KEY},{FLOOD_KEY}", "BENCH_QUIET_KEY": QUIET_KEY,
       "BENCH_FLOOD_KEY": FLOOD_KEY}


def fleet_text(args: argparse.Namespace, port: int,
               weights: tuple[float, float] = (1.0, 1.0)) -> str:
    engines = "\n".join(textwrap.dedent(f"""\
        [[engine]]
        name = "e{i}"
        url = "grpc://127.0.0.1:{free_port()}"
        kind = "sglang"
        simulate = true
        [engine.simulator]
        decode_us_per_token = {args.token_ms * 1000:.0f}
        prefill_us_per_token = 0
        eos_probability = 0.0
        max_running = {args.slots_per_engine}
        """) for i in range(args.engines))
    tenants = textwrap.dedent(f"""\
        [[frontend.tenants.tenant]]
        api_key_env = "BENCH_QUIET_KEY"
        name = "quiet"
        weight = {weights[1]}
        priority = true

        [[frontend.tenants.tenant]]
        api_key_env = "BENCH_FLOOD_KEY"
        name = "flood"
        weight = {weights[0]}
        """)
    return textwrap.dedent(f"""\
        [frontend]
        listen = "127.0.0.1:{port}"
        served_model_name = "demo"
        tokenizer = "{ROOT / 'config' / 'demo-model'}"

        [frontend.auth]
        api_keys_env = "BENCH_KEYS"

        [frontend.access_log]
        enabled = false

        [frontend.responses]
        backend = "memory"  # nothing stored: no database shared with other runs

        [frontend.routing]
        policy = "{args.routing}"

        [frontend.limits]
        max_in_flight = {args.engines * args.slots_per_engine}
        max_queue = {4 * args.engines * args.slots_per_engine}
        queue_timeout_s = 30
        {"" if args.flex_reserve is None else f"flex_reserve = {args.flex_reserve}"}
        preempt = {"true" if args.preempt else "false"}

        [frontend.tenants]
        """) + tenants + "\n" + engines


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    refused: int = 0
    failed: int = 0
    tokens: int = 0
    admitted: int = 0  # from /metrics: admissions, those that waited, those over 50 ms
    waited: int = 0
    waited_long: int = 0
    ended: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) per stream

    def tokens_until(self, moment: float) -> int:
        """Tokens of the streams that ended by ``moment`` (while every tenant still sent)."""
        return sum(tokens for when, tokens in self.ended if when <= moment)


async def stream(client: httpx.AsyncClient, key: str, tokens: int, tally: Tally,
                 tier: str | None = None) -> None:
    body: dict[str, object] = {"model": "demo", "prompt": "hello", "max_tokens": tokens,
                               "stream": True}
    if tier is not None:
        body["service_tier"] = tier
    started = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as reply:
            if reply.status_code == 429:
                tally.refused += 1
                return
            if reply.status_code != 200:
                tally.failed += 1
                return
            async for line in reply.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - started
    except httpx.HTTPError:
        tally.failed += 1
        return
    if first is not None:
        tally.ttft.append(first)
        tally.tokens += tokens
        tally.ended.append((time.perf_counter(), tokens))


async def open_loop(client: httpx.AsyncClient, key: str, rate: float, seconds: float,
                    tokens: int, tally: Tally, rng: random.Random,
                    tier: str | None = None) -> None:
    """Poisson arrivals at ``rate`` per second for ``seconds``; waits for every stream."""
    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(stream(client, key, tokens, tally, tier)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


async def phase(base: str, args: argparse.Namespace, capacity_rps: float,
                flood_key: str | None, flood_factor: float, quiet_tier: str | None = None,
                flood_tier: str | None = None) -> tuple[Tally, Tally, float]:
    """Both tenants' tallies, and how long it took (arrivals, then the queue's drain); the
    quiet tenant's admission waits (from ``/metrics``) go into its tally."""
    rng = random.Random(args.seed)
    quiet, flood = Tally(), Tally()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        before = await waited(client)
        started = args.started = time.perf_counter()
        jobs = [open_loop(client, QUIET_KEY, capacity_rps * args.quiet_share, args.seconds,
                          args.tokens, quiet, rng, quiet_tier)]
        if flood_key is not None:
            jobs.append(open_loop(client, flood_key, capacity_rps * flood_factor,
                                  args.seconds, args.tokens, flood, random.Random(args.seed + 1),
                                  flood_tier))
        await asyncio.gather(*jobs)
        elapsed = time.perf_counter() - started
        after = await waited(client)
    quiet.admitted, quiet.waited, quiet.waited_long = (a - b for a, b in zip(after, before,
                                                                            strict=True))
    return quiet, flood, elapsed


#: the streams taken off their engines for another tenant, in /metrics
_PREEMPTED = re.compile(r'^direct_frontend_engine_requests_total\{[^}]*outcome="preempted"'
                        r'[^}]*\} (\S+)$', re.M)
#: the quiet tenant's admission waits in /metrics: every tier's, of any model
_WAITS = re.compile(r'^direct_frontend_tenant_wait_seconds_(bucket|count)\{(.*)\} (\S+)$', re.M)


async def waited(client: httpx.AsyncClient) -> tuple[int, int, int]:
    """The quiet tenant's admissions so far: how many, how many waited for a slot at all,
    and how many waited over 50 ms."""
    text = (await client.get("/metrics")).text
    total = none = short = 0.0
    for kind, labels, value in _WAITS.findall(text):
        if 'tenant="quiet"' not in labels:
            continue
        if kind == "count":
            total += float(value)
        elif 'le="0.0"' in labels:
            none += float(value)
        elif 'le="0.05"' in labels:
            short += float(value)
    return int(total), int(total - none), int(total - short)


def row(name: str, quiet: Tally, flood: Tally, seconds: float, base: Tally,
        capacity_tps: float, waits: bool = True) -> None:
    p50, p90, p99 = (pct(quiet.ttft, q) for q in (0.5, 0.9, 0.99))
    used = (quiet.tokens + flood.tokens) / seconds / capacity_tps
    waited = (f"{quiet.waited / max(quiet.admitted, 1):>7.0%}"
              f"{quiet.waited_long / max(quiet.admitted, 1):>7.0%}" if waits else f"{'-':>14}")
    print(f"{name:<16}{p50 * 1000:>9.1f} ms{p90 * 1000:>7.0f} ms{p99 * 1000:>7.0f} ms"
          f"{p50 / pct(base.ttft, 0.5):>7.2f}{p90 / pct(base.ttft, 0.9):>7.2f}"
          f"{p99 / pct(base.ttft, 0.99):>7.2f}{quiet.refused + quiet.failed:>8}{waited}"
          f"{quiet.tokens / seconds:>8.0f}{flood.tokens / seconds:>8.0f}{used:>7.2f}")


def header(other: str) -> None:
    print(f"{'phase':<16}{'quiet TTFT p50':>12}{'p90':>10}{'p99':>10}{'×p50':>7}{'×p90':>7}"
          f"{'×p99':>7}{'refused':>8}{'waited':>7}{'>50ms':>7}{'quiet':>8}{other:>8}"
          f"{'used':>7}")
    print(f"{'':<79}{'(of its admissions)':>14}{'tok/s':>8}{'tok/s':>8}")


def tiers(base: str, args: argparse.Namespace, capacity_rps: float, capacity_tps: float) -> None:
    """The quiet tenant alone, beside a flex flood, beside a default flood (asking default,
    then priority)."""
    alone, _, alone_s = asyncio.run(phase(base, args, capacity_rps, None, 0))
    flexed, batch, flex_s = asyncio.run(
        phase(base, args, capacity_rps, FLOOD_KEY, args.flood_factor, flood_tier="flex"))
    fair, flooded, fair_s = asyncio.run(
        phase(base, args, capacity_rps, FLOOD_KEY, args.flood_factor))
    ahead, behind, ahead_s = asyncio.run(
        phase(base, args, capacity_rps, FLOOD_KEY, args.flood_factor, quiet_tier="priority"))
    header("flood")
    row("alone", alone, Tally(), alone_s, alone, capacity_tps)
    row("+ flex flood", flexed, batch, flex_s, alone, capacity_tps)
    row("+ default flood", fair, flooded, fair_s, alone, capacity_tps)
    row("priority, same", ahead, behind, ahead_s, alone, capacity_tps)
    idle = 1 - args.quiet_share
    print(f"targets: interactive TTFT p90 beside a flex flood within 10 % of alone "
          f"({pct(flexed.ttft, 0.9) / pct(alone.ttft, 0.9):.2f}x); the flex flood served "
          f"{batch.tokens / flex_s / capacity_tps:.2f} of capacity (idle: {idle:.2f}); "
          f"priority p90 beside a default flood {pct(ahead.ttft, 0.9) / pct(alone.ttft, 0.9):.2f}x"
          f" of alone (default: {pct(fair.ttft, 0.9) / pct(alone.ttft, 0.9):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--slots-per-engine", type=int, default=4)
    parser.add_argument("--token-ms", type=float, default=25.0)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quiet-share", type=float, default=None,
                        help="of capacity (default 0.2; 0.6 with --tiers)")
    parser.add_argument("--flood-factor", type=float, default=10.0)
    parser.add_argument("--weights", default=None, help="FLOOD:QUIET, e.g. 3:1")
    parser.add_argument("--tiers", action="store_true", help="the service tiers' phases")
    parser.add_argument("--flex-reserve", type=int, default=None,
                        help="[frontend.limits] flex_reserve (default: the daemon's)")
    parser.add_argument("--no-preempt", dest="preempt", action="store_false",
                        help="[frontend.limits] preempt = false (the daemon's default: true)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--routing", default="least_loaded",
                        help="the fleet's [frontend.routing] policy")
    args = parser.parse_args()
    if args.quiet_share is None:
        args.quiet_share = 0.6 if args.tiers else 0.2
    slots = args.engines * args.slots_per_engine
    capacity_rps = slots / (args.tokens * args.token_ms / 1000)
    capacity_tps = slots / (args.token_ms / 1000)
    print(f"bench_fairness: {args.engines} engines x {args.slots_per_engine} slots, "
          f"{args.tokens} tokens of {args.token_ms:g} ms: capacity {capacity_rps:.1f} req/s; "
          f"{args.seconds:g} s a phase; routing {args.routing}")
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        directory = pathlib.Path(tmp)
        if args.weights is not None:
            heavy, light = (float(w) for w in args.weights.split(":"))
            with daemon(fleet_text(args, free_port(), (heavy, light)), directory,
                        ENV) as base:
                args.quiet_share = args.flood_factor  # both flood
                quiet, flood, _ = asyncio.run(
                    phase(base, args, capacity_rps, FLOOD_KEY, args.flood_factor))
            # while both send: after the arrivals stop, the queue's drain serves what each left
            until = args.started + args.seconds
            ratio = flood.tokens_until(until) / max(quiet.tokens_until(until), 1)
            target = heavy / light
            print(f"weights {heavy:g}:{light:g}, both at {args.flood_factor:g}x capacity: served "
                  f"tokens while both sent {flood.tokens_until(until)} : "
                  f"{quiet.tokens_until(until)} = {ratio:.2f} "
                  f"(target {target:g}, within 10 %: {abs(ratio / target - 1) <= 0.1})")
            return
        with daemon(fleet_text(args, free_port()), directory, ENV) as base:
            if args.tiers:
                tiers(base, args, capacity_rps, capacity_tps)
                return
            alone, _, _ = asyncio.run(phase(base, args, capacity_rps, None, 0))
            fair, flooded, fair_s = asyncio.run(
                phase(base, args, capacity_rps, FLOOD_KEY, args.flood_factor))
            preempted = sum(float(n) for n in _PREEMPTED.findall(
                httpx.get(base + "/metrics").text))
            fifo, fifo_flood, fifo_s = asyncio.run(
                phase(base, args, capacity_rps, QUIET_KEY, args.flood_factor))
    header("flood")
    row("alone", alone, Tally(), args.seconds, alone, capacity_tps)
    row("fair", fair, flooded, fair_s, alone, capacity_tps)
    row("one queue", fifo, fifo_flood, fifo_s, alone, capacity_tps, waits=False)
    fair_use = (fair.tokens + flooded.tokens) / fair_s
    fifo_use = (fifo.tokens + fifo_flood.tokens) / fifo_s
    p50, p99 = (pct(fair.ttft, q) / pct(alone.ttft, q) for q in (0.5, 0.99))
    print(f"targets: quiet p50 within 2x of alone ({p50:.2f}), "
          f"p99 within 3x ({p99:.2f}), 0 of its requests "
          f"refused ({fair.refused + fair.failed}), utilisation >= 90 % of one queue's "
          f"({fair_use / fifo_use:.2f})")
    print(f"(median quiet TTFT alone {statistics.median(alone.ttft) * 1000:.1f} ms over "
          f"{len(alone.ttft)} requests; {len(fair.ttft)} beside the flood; "
          f"{preempted:.0f} of the flood's {len(flooded.ttft)} streams preempted)")


if __name__ == "__main__":
    main()
