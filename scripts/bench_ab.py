#!/usr/bin/env python3
"""A/B the frontend's overhead: a baseline checkout against this one, in the same run.

Runs ``scripts/bench_overhead.py --json`` in rounds that alternate between the
two daemons (baseline, candidate, baseline, candidate, …) so both see the same
machine, then prints, per concurrency level, the median of each figure for
each side and the ratio candidate / baseline. A ratio below 1 is better for
every figure shown (CPU per request and per token, added latency is shown as a
difference instead, since it can be near zero or negative).

The baseline is any directory holding a ``direct_frontend`` package (e.g. a
``git worktree add /tmp/base <rev>``); its daemon runs with that directory on
``PYTHONPATH``, with the same venv and engine. The candidate is this checkout.

Usage::

    git worktree add /tmp/base main~3
    python scripts/bench_ab.py /tmp/base --rounds 3 --concurrency 1,8,32

Arguments it does not know go to ``bench_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench_overhead.py"
CPU_FIGURES = ("daemon_cpu_ms_per_request", "daemon_cpu_us_per_token")
LATENCY_FIGURES = ("added_ttft_p50_ms", "added_total_p50_ms")


def daemon_cmd(source: pathlib.Path) -> str:
    """The daemon, importing ``direct_frontend`` from ``source``."""
    return shlex.join([
        "env", f"PYTHONPATH={source}", sys.executable, "-c",
        "import sys; from direct_frontend.cli import main; sys.exit(main())",
    ])


def one_run(source: pathlib.Path, extra: Sequence[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH), "--json", "--startup-runs", "0",
           "--daemon-cmd", daemon_cmd(source), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench_overhead failed for {source}:\n{proc.stdout}\n{proc.stderr}")
    last = proc.stdout.strip().splitlines()[-1]
    result: dict[str, Any] = json.loads(last)
    return result


def median_by_level(runs: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    by_level: dict[int, dict[str, list[float]]] = {}
    for run in runs:
        for level in run["levels"]:
            figures = by_level.setdefault(level["concurrency"], {})
            for name in CPU_FIGURES:
                figures.setdefault(name, []).append(level["frontend"][name])
            for name in LATENCY_FIGURES:
                figures.setdefault(name, []).append(level[name])
            figures.setdefault("req_per_s", []).append(level["frontend"]["req_per_s"])
    return {
        c: {name: statistics.median(values) for name, values in figures.items()}
        for c, figures in by_level.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("baseline", type=pathlib.Path, help="directory with the baseline package")
    p.add_argument("--rounds", type=int, default=3, help="runs per side, alternating")
    args, bench_args = p.parse_known_args(argv)  # the rest goes to bench_overhead.py
    baseline = args.baseline.resolve()
    if not (baseline / "direct_frontend").is_dir():
        raise SystemExit(f"{baseline} has no direct_frontend package")
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "candidate": []}
    for round_no in range(args.rounds):
        for side, source in (("baseline", baseline), ("candidate", ROOT)):
            print(f"round {round_no + 1}/{args.rounds}: {side} ({source})", flush=True)
            runs[side].append(one_run(source, bench_args))
    base, cand = median_by_level(runs["baseline"]), median_by_level(runs["candidate"])
    print(f"\nmedians of {args.rounds} alternating runs per side; "
          f"baseline {baseline}, candidate {ROOT}")
    header = f"{'c':>3}  {'figure':<28}{'baseline':>10}{'candidate':>11}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for c in sorted(base):
        for name in (*CPU_FIGURES, "req_per_s"):
            b, n = base[c][name], cand[c][name]
            print(f"{c:>3}  {name:<28}{b:>10.3f}{n:>11.3f}{n / b:>8.3f}")
        for name in LATENCY_FIGURES:
            b, n = base[c][name], cand[c][name]
            print(f"{c:>3}  {name:<28}{b:>10.3f}{n:>11.3f}{'Δ ' + format(n - b, '+.3f'):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
