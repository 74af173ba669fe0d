"""CPU of the ``kv_aware`` routing path per long prompt, in process, against a baseline.

Builds the policy as the daemon does (``make_policy`` from ``[frontend.routing]``
``policy = "kv_aware"``, no KV events: the approximate memory, with each
engine's capacity as discovery reports it) over ``--engines`` engines, then
routes ``--requests`` unique prompts of about ``--tokens`` token ids that
share a ``--head`` of ids (a chat template's), ``--concurrency`` at a time,
each made just before it is routed (as a tokenized prompt is; the making is
not timed): each placement is begun on its engine, prefilled, and completed with a
16-token answer (``on_complete``) once ``--concurrency`` newer ones are out.
That is the routing work a long prompt costs (hashing its blocks, the
memory's lookup, placement and LRU, the answer's extension), without the
HTTP, tokenizing and engine work around it.

Prints the CPU (``time.process_time`` around the routing calls) per request, the median of
``--rounds`` rounds, each round a fresh process per side run in alternating
order; with ``--baseline REV`` (a git revision or a directory holding a
``direct_frontend`` package, as bench_overhead.py takes it) the ratio too.

Run: ``PYTHONPATH=$PWD python scripts/bench_route_cost.py --baseline main``.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

ANSWER = 16


def route(args: argparse.Namespace) -> float:
    """One side's run in this process: CPU ms per routed request (after a warm-up)."""
    from direct_frontend.engines.neutral import EngineInfo, EngineRole
    from direct_frontend.fleet.schema import RoutingConfig
    from direct_frontend.kv.prefix import PromptIds
    from direct_frontend.routing.catalog import Catalog, EngineHandle
    from direct_frontend.routing.factory import make_policy
    from direct_frontend.routing.policies import RequestView

    def handle(i: int) -> EngineHandle:
        info = EngineInfo("demo", role=EngineRole.BOTH, kv_capacity_tokens=args.capacity_tokens)
        return EngineHandle(f"engine-{i}", "sglang", f"grpc://engine-{i}:1", i + 1,
                            EngineRole.BOTH, info, 131_072, None)

    policy = make_policy(RoutingConfig(policy="kv_aware"))
    catalog = Catalog(1, tuple(handle(i) for i in range(args.engines)))
    rng = random.Random(args.seed)
    head = [rng.randrange(1, 150_000) for _ in range(args.head)]
    warm = args.requests // 4
    inflight: list[tuple[object, PromptIds, list[int]]] = []
    spent = 0.0
    for i in range(warm + args.requests):
        # made just before it is routed (as a tokenized prompt is), its making not timed
        body = array.array("I", rng.randbytes(4 * (args.tokens + rng.randrange(200))))
        prompt = PromptIds(head + [x % 150_000 + 1 for x in body])
        answer = [rng.randrange(1, 150_000) for _ in range(ANSWER)]
        start = time.process_time()
        placement = policy.choose(catalog, RequestView(prompt, ANSWER))
        assert placement is not None
        placement.engine.load.begin(len(prompt), placement.blocks, placement.dp_rank)
        if placement.prefilled is not None:
            placement.prefilled()
        inflight.append((placement, prompt, answer))
        if len(inflight) > args.concurrency:
            done, ids, out = inflight.pop(0)
            done.engine.load.end(len(ids), done.blocks, done.dp_rank)  # type: ignore[attr-defined]
            policy.on_complete(done, ids, out)  # type: ignore[arg-type]
        if i >= warm:
            spent += time.process_time() - start
    return float(spent / args.requests * 1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--tokens", type=int, default=18_000)
    p.add_argument("--head", type=int, default=32, help="leading ids every prompt shares")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--capacity-tokens", type=int, default=1_048_576,
                   help="each engine's KV cache as discovery reports it (the simulator's at a "
                        "131,072-token context)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--baseline", default=None, metavar="REV_OR_DIR")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(route(args)))
        return
    sides = {"candidate": pathlib.Path(__file__).resolve().parent.parent}
    if args.baseline is not None:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from bench_overhead import baseline_source

        sides["baseline"] = baseline_source(args.baseline)
    child = [sys.executable, __file__, "--child", *sys.argv[1:]]
    if "--baseline" in child:  # (the child is one side; it takes no baseline)
        at = child.index("--baseline")
        del child[at:at + 2]
    figures: dict[str, list[float]] = {name: [] for name in sides}
    for round_no in range(args.rounds):
        order = list(sides.items()) if round_no % 2 == 0 else list(sides.items())[::-1]
        for name, source in order:
            env = dict(os.environ, PYTHONPATH=str(source))
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
            figures[name].append(json.loads(out.stdout))
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"kv_aware routing path, {args.requests} unique prompts of ~{args.tokens} ids "
          f"({args.head} shared), {args.engines} engines, c={args.concurrency}; "
          f"medians of {args.rounds} rounds:")
    for name, value in medians.items():
        rounds = " ".join(f"{v:.3f}" for v in figures[name])
        print(f"  {name:<10} {value:.3f} ms CPU / request   ({rounds})")
    if "baseline" in medians:
        print(f"  candidate / baseline: {medians['candidate'] / medians['baseline']:.2f}")


if __name__ == "__main__":
    main()
