#!/usr/bin/env python3
"""The admission policy in virtual time: the daemon's own Admission, engines as slot queues.

``bench_fairness.py`` runs the real daemon in real time, so its tail figures carry the
machine's noise (a p99 of about 40 requests is their maximum). This runs the same loads on
``pipeline/admission.py`` under Trio's mock clock, with engines reduced to FIFO slots held
for a request's decode and the fewest-in-flight placement of ``least_loaded``: no HTTP, no
noise, any number of seconds and seeds, so a policy's figures are exact and repeatable. What
it leaves out (the daemon's own latency) is what the real bench adds to every request.
Preemption runs as the relay's does: a request asked off its engine stops, waits for a slot
again (``Admission.requeue``) and runs what it had left after a prefill's time (the first
token's); ``--no-preempt`` and ``--max-preemptions`` set the knobs.

Modes:

- ``fair``: a quiet tenant at ``--quiet-share`` of capacity alone for ``--seconds``, then
  beside a flood at ``--flood-factor`` times capacity: the quiet tenant's TTFT percentiles
  (over ``--seeds`` runs) beside the flood, the share of its requests that waited at all, and
  the fleet's utilisation;
- ``tiers``: an interactive tenant at ``--load`` of capacity alone, then beside a flex flood
  (after a warm-up alone): its TTFT percentiles in both, and what the flood was served;
- ``weights``: two tenants flooding, weighted 3:1: the split of the requests served.

Usage::

    python scripts/sim_admission.py fair --seeds 10
    python scripts/sim_admission.py fair --engines 4 --slots 16 --jitter 0.3
    python scripts/sim_admission.py tiers --engines 4 --slots 16 --reserve 8
    python scripts/sim_admission.py weights
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import statistics
from dataclasses import dataclass, field

import trio
import trio.testing

from direct_frontend.fleet.schema import TenantConfig, TenantsConfig
from direct_frontend.openai.types import Tier
from direct_frontend.pipeline.admission import Admission, AdmissionConfig, Rejected
from direct_frontend.pipeline.preempt import Hold

#: what every request costs besides its wait (a first token from an idle engine)
OVERHEAD_S = 0.005

#: (tenant, rate as a multiple of capacity, tier)
Load = tuple[str, float, Tier]


@dataclass
class Run:
    ttft: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    served: collections.Counter[str] = field(default_factory=collections.Counter)
    #: those that ended while every load still sent (the queue's drain after is left out)
    served_while: collections.Counter[str] = field(default_factory=collections.Counter)
    used: float = 0.0  # slot-seconds held over slot-seconds there were
    preempted: collections.Counter[str] = field(default_factory=collections.Counter)


class Engines:
    """The fleet as FIFO slots, placed on fewest-in-flight; ``busy``: the decode seconds run."""

    def __init__(self, engines: int, slots: int) -> None:
        self.slots = [trio.Semaphore(slots) for _ in range(engines)]
        self.in_flight = [0] * engines
        self.busy = 0.0

    async def decode(self, hold: Hold, total: float, left: float) -> float:
        """Run ``left`` of ``total`` seconds of decode on the least loaded engine, with
        ``hold`` preemptible meanwhile; what is left when it was preempted (0: it ended). A
        resumed request (``left < total``) prefills again first."""
        in_flight = self.in_flight
        engine = min(range(len(in_flight)), key=lambda e: (in_flight[e], e))
        in_flight[engine] += 1
        try:
            async with self.slots[engine]:
                if left < total:
                    await trio.sleep(OVERHEAD_S)
                began = trio.current_time()
                with trio.CancelScope() as scope:
                    hold.running(lambda: scope.cancel() is None, lambda: int(
                        (total - left + trio.current_time() - began) * 1000))
                    await trio.sleep(left)
                hold.running(None)
                ran = trio.current_time() - began
                self.busy += ran
                return left - ran if scope.cancelled_caught else 0.0
        finally:
            in_flight[engine] -= 1


async def serve(admission: Admission, args: argparse.Namespace, loads: list[Load],
                seed: int) -> Run:
    """Open-loop Poisson arrivals of every load for ``--seconds``, each request holding a
    slot of the least loaded engine for its decode; waits for the last to end."""
    run = Run()
    fleet = Engines(args.engines, args.slots)
    duration = args.tokens * args.token_ms / 1000
    flex_duration = (args.flex_tokens or args.tokens) * args.token_ms / 1000
    capacity_rps = args.engines * args.slots / duration
    jitter = random.Random(seed + 100)
    until = trio.current_time() + args.seconds

    async def request(tenant: str, tier: Tier) -> None:
        asked = trio.current_time()
        try:
            async with admission.slot(1, tenant, tier) as hold:
                run.ttft[tenant].append(trio.current_time() - asked + OVERHEAD_S)
                total = (flex_duration if tier == "flex" else duration) * jitter.uniform(
                    1 - args.jitter, 1 + args.jitter)
                left = await fleet.decode(hold, total, total)
                while left > 0:
                    run.preempted[tenant] += 1
                    if not await admission.requeue(hold, math.inf):
                        return
                    left = await fleet.decode(hold, total, left)
                run.served[tenant] += 1
                if trio.current_time() <= until:
                    run.served_while[tenant] += 1
        except Rejected:
            run.refused[tenant] += 1

    async def arrivals(tenant: str, share: float, tier: Tier, rng: random.Random) -> None:
        async with trio.open_nursery() as nursery:
            end = trio.current_time() + args.seconds
            while trio.current_time() < end:
                nursery.start_soon(request, tenant, tier)
                await trio.sleep(rng.expovariate(capacity_rps * share))

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for index, (tenant, share, tier) in enumerate(loads):
            nursery.start_soon(arrivals, tenant, share, tier, random.Random(seed + index))
    run.used = fleet.busy / ((trio.current_time() - started) * args.engines * args.slots)
    return run


def simulate(args: argparse.Namespace, loads: list[Load], seed: int,
             warm: list[Load] | None = None, tenants: TenantsConfig | None = None) -> Run:
    """``loads`` on a new Admission (after ``warm`` alone, if given), under the mock clock."""
    slots = args.engines * args.slots
    config = AdmissionConfig(slots, 4 * slots, 30.0, 600.0, args.reserve or max(1, slots // 8),
                             args.preempt, args.max_preemptions)

    async def main() -> Run:
        admission = Admission(config, tenants=tenants)
        if warm:
            await serve(admission, args, warm, seed)
        return await serve(admission, args, loads, seed)

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def line(name: str, ttft: list[float], extra: str = "") -> None:
    waited = sum(t > OVERHEAD_S + 1e-6 for t in ttft) / max(len(ttft), 1)
    print(f"{name:<20} n={len(ttft):<5} p50 {pct(ttft, 0.5) * 1000:6.1f} ms  "
          f"p90 {pct(ttft, 0.9) * 1000:6.1f} ms  p99 {pct(ttft, 0.99) * 1000:6.1f} ms  "
          f"waited {waited:4.0%}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("fair", "tiers", "weights"))
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="per engine")
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--token-ms", type=float, default=25.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quiet-share", type=float, default=0.2)
    parser.add_argument("--flood-factor", type=float, default=10.0)
    parser.add_argument("--quiet-tier", default="default", choices=("priority", "default"),
                        help="fair: the quiet tenant's tier (the flood's is default)")
    parser.add_argument("--load", type=float, default=0.6, help="tiers: interactive load")
    parser.add_argument("--reserve", type=int, default=0, help="flex_reserve (0: default)")
    parser.add_argument("--flex-tokens", type=int, default=0,
                        help="tiers: a flex request's tokens (0: --tokens)")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="each request's decode varies by up to this fraction")
    parser.add_argument("--no-preempt", dest="preempt", action="store_false",
                        help="[frontend.limits] preempt = false")
    parser.add_argument("--max-preemptions", type=int, default=2,
                        help="[frontend.limits] max_preemptions")
    args = parser.parse_args()
    seeds = range(args.seed, args.seed + args.seeds)
    print(f"sim_admission {args.mode}: {args.engines} engines x {args.slots} slots, "
          f"{args.tokens} tokens of {args.token_ms:g} ms, {args.seconds:g} s x {args.seeds} "
          f"seeds, jitter {args.jitter:g}")
    if args.mode == "fair":
        quiet: Load = ("quiet", args.quiet_share, args.quiet_tier)
        alone: list[float] = []
        beside: list[float] = []
        used = []
        preempted = served = 0
        for seed in seeds:
            alone += simulate(args, [quiet], seed).ttft["quiet"]
            run = simulate(args, [quiet, ("flood", args.flood_factor, "default")], seed,
                           warm=[quiet])
            beside += run.ttft["quiet"]
            used.append(run.used)
            preempted += run.preempted["flood"]
            served += run.served["flood"]
        line("quiet alone", alone)
        line("beside the flood", beside, f"  utilisation {statistics.mean(used):.3f}, "
             f"{preempted / max(served, 1):.1%} of the flood's preempted")
    elif args.mode == "tiers":
        app: Load = ("app", args.load, "default")
        alone, beside, flex = [], [], []
        for seed in seeds:
            alone += simulate(args, [app], seed).ttft["app"]
            run = simulate(args, [app, ("batch", args.flood_factor, "flex")], seed, warm=[app])
            beside += run.ttft["app"]
            flex.append(run.served["batch"] * (args.flex_tokens or args.tokens) * args.token_ms
                        / 1000
                        / (args.seconds * args.engines * args.slots))
        line("interactive alone", alone)
        line("beside a flex flood", beside,
             f"  flex served {statistics.mean(flex):.2f} of capacity (idle {1 - args.load:.2f})")
    else:
        tenants = TenantsConfig(tenant=(TenantConfig(name="a", weight=3, flow="a"),
                                        TenantConfig(name="b", weight=1, flow="b")))
        for seed in seeds:
            run = simulate(args, [("a", args.flood_factor, "default"),
                                  ("b", args.flood_factor, "default")], seed, tenants=tenants)
            a, b = run.served_while["a"], run.served_while["b"]
            print(f"weights 3:1: served while both sent {a} : {b} = {a / max(b, 1):.2f}")


if __name__ == "__main__":
    main()
