#!/usr/bin/env python3
"""Time per pod event on the membership path, as a pool grows to ``--pods`` pods.

Each event is what the daemon does for one watch event before the
supervisor: the pool's membership updated (``PoolMembership.event``), the
fleet rebuilt with the pools' engines (``with_pool_engines``) and diffed
against the running one (``diff_engines``). Pods are added Ready, flipped
NotReady, back to Ready, then deleted, so the fleet grows to ``--pods``
engines and shrinks back to none. Prints the median, p99 and worst
microseconds per event at each stage. The daemon coalesces events that arrive
together (``control/pods.py`` ``COALESCE_S``), so a burst costs one rebuild,
not one per event: these figures are the worst case, one event at a time.

Usage::

    python scripts/bench_pods.py --pods 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from direct_frontend.fleet.diff import diff_engines
from direct_frontend.fleet.load import parse_fleet
from direct_frontend.fleet.pools import PoolMembership, with_pool_engines
from tests.support.kube import pod, set_ready

FLEET = """\
[frontend]
served_model_name = "demo"
tokenizer = "tok"

[[pool]]
name = "web"
selector = "app=engine"
kind = "sglang"
port = 50051
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000)
    args = parser.parse_args()
    fleet = parse_fleet(FLEET, Path("fleet.toml"))
    membership = PoolMembership(fleet.pools[0])
    membership.relist([], "1")
    running = fleet
    pods = [pod(f"p{i}", f"10.{i // 60000}.{i // 250 % 240}.{i % 250 + 1}", None)
            for i in range(args.pods)]
    stages = {
        "add": [("ADDED", p) for p in pods],
        "not ready": [("MODIFIED", set_ready(p, False)) for p in pods],
        "ready again": [("MODIFIED", p) for p in pods],
        "delete": [("DELETED", p) for p in pods],
    }
    print(f"{args.pods} pods, one event at a time (µs per event: median / p99 / worst)")
    for stage, events in stages.items():
        costs: list[float] = []
        for kind, item in events:
            started = time.perf_counter()
            membership.event(kind, item)
            new = with_pool_engines(running, {"web": membership.engines})
            diff = diff_engines(running, new)
            running = new
            costs.append((time.perf_counter() - started) * 1e6)
            assert len(diff.added) + len(diff.removed) <= 1
        costs.sort()
        p99 = costs[min(len(costs) - 1, int(len(costs) * 0.99))]
        print(f"  {stage:12} {statistics.median(costs):9.0f} {p99:9.0f} {costs[-1]:9.0f}"
              f"   (fleet ends with {len(running.engines)} engines)")


if __name__ == "__main__":
    main()
