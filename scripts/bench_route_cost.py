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

With ``--agent``: ``--conversations`` conversations of ``--turns`` turns
instead, routed in lockstep (turn t of every conversation, then their
answers), each turn the last one's prompt, its ``ANSWER``-id answer and
``--step`` new ids (a tool result), made as the prompt cache makes it (a
:class:`PromptIds` that knows the last prompt was its start). What grows
with the history there is what the routing path redoes for the blocks it
already saw: the figure is the CPU per request of the first ten turns and of
the last ten, and their ratio.

Prints the CPU (``time.process_time`` around the routing calls) per request, the median of
``--rounds`` rounds, each round a fresh process per side run in alternating
order; with ``--baseline REV`` (a git revision or a directory holding a
``direct_frontend`` package, as bench_overhead.py takes it) the ratio too.

Run: ``PYTHONPATH=$PWD python scripts/bench_route_cost.py --baseline main [--agent]``.
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
from typing import Any

ANSWER = 16


def fleet(args: argparse.Namespace) -> tuple[Any, Any]:
    """The ``kv_aware`` policy as the daemon makes it, and a catalog of ``--engines``."""
    from direct_frontend.engines.neutral import EngineInfo, EngineRole
    from direct_frontend.fleet.schema import RoutingConfig
    from direct_frontend.routing.catalog import Catalog, EngineHandle
    from direct_frontend.routing.factory import make_policy

    def handle(i: int) -> EngineHandle:
        info = EngineInfo("demo", role=EngineRole.BOTH, kv_capacity_tokens=args.capacity_tokens)
        return EngineHandle(f"engine-{i}", "sglang", f"grpc://engine-{i}:1", i + 1,
                            EngineRole.BOTH, info, 131_072, None)

    return (make_policy(RoutingConfig(policy="kv_aware")),
            Catalog(1, tuple(handle(i) for i in range(args.engines))))


def prompt_ids_type() -> Any:
    """``PromptIds`` where this side's tree keeps them (``text/`` since they hold u32 bytes,
    ``kv/prefix.py`` before)."""
    try:
        from direct_frontend.text.prompt_ids import PromptIds
    except ImportError:
        from direct_frontend.kv.prefix import PromptIds  # type: ignore[attr-defined]
    return PromptIds


def route(args: argparse.Namespace) -> float:
    """One side's run in this process: CPU ms per routed request (after a warm-up)."""
    from direct_frontend.routing.policies import RequestView

    PromptIds = prompt_ids_type()

    policy, catalog = fleet(args)
    rng = random.Random(args.seed)
    head = [rng.randrange(1, 150_000) for _ in range(args.head)]
    warm = args.requests // 4
    inflight: list[tuple[object, Any, list[int]]] = []
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
            policy.on_complete(done, ids, out)
        if i >= warm:
            spent += time.process_time() - start
    return float(spent / args.requests * 1000)


def route_agent(args: argparse.Namespace) -> list[float]:
    """One side's agent run in this process: CPU ms per request of each turn."""
    from direct_frontend.routing.policies import RequestView

    PromptIds = prompt_ids_type()

    policy, catalog = fleet(args)
    rng = random.Random(args.seed)

    def fresh(n: int) -> list[int]:
        return [x % 150_000 + 1 for x in array.array("I", rng.randbytes(4 * n))]

    head = fresh(args.head)
    prompts = [PromptIds(head + fresh(args.step)) for _ in range(args.conversations)]
    per_turn = []
    for _ in range(args.turns):
        spent = 0.0
        answers = [fresh(ANSWER) for _ in prompts]
        start = time.process_time()
        placed = []
        for prompt in prompts:
            placement = policy.choose(catalog, RequestView(prompt, ANSWER))
            assert placement is not None
            placement.engine.load.begin(len(prompt), placement.blocks, placement.dp_rank)
            if placement.prefilled is not None:
                placement.prefilled()
            placed.append(placement)
        for placement, prompt, answer in zip(placed, prompts, answers, strict=True):
            placement.engine.load.end(len(prompt), placement.blocks, placement.dp_rank)
            policy.on_complete(placement, prompt, answer)
        spent += time.process_time() - start
        per_turn.append(spent / len(prompts) * 1000)
        # the next turn: as the prompt cache makes it (this prompt known, the rest new)
        prompts = [PromptIds(prompt + tuple(answer + fresh(args.step)), prompt.chains,
                             len(prompt))
                   for prompt, answer in zip(prompts, answers, strict=True)]
    return per_turn


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
    p.add_argument("--agent", action="store_true",
                   help="agent conversations growing each turn instead of unique prompts")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--step", type=int, default=500, help="new ids per turn (a tool result)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(route_agent(args) if args.agent else route(args)))
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
    runs: dict[str, list[Any]] = {name: [] for name in sides}
    for round_no in range(args.rounds):
        order = list(sides.items()) if round_no % 2 == 0 else list(sides.items())[::-1]
        for name, source in order:
            env = dict(os.environ, PYTHONPATH=str(source))
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(out.stdout))
    if args.agent:
        report_agent(args, runs)
        return
    figures: dict[str, list[float]] = runs
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"kv_aware routing path, {args.requests} unique prompts of ~{args.tokens} ids "
          f"({args.head} shared), {args.engines} engines, c={args.concurrency}; "
          f"medians of {args.rounds} rounds:")
    for name, value in medians.items():
        rounds = " ".join(f"{v:.3f}" for v in figures[name])
        print(f"  {name:<10} {value:.3f} ms CPU / request   ({rounds})")
    if "baseline" in medians:
        print(f"  candidate / baseline: {medians['candidate'] / medians['baseline']:.2f}")


def report_agent(args: argparse.Namespace, runs: dict[str, list[list[float]]]) -> None:
    """Per side, the median over rounds of each turn's CPU; the first ten turns' mean, the
    last ten's, and their ratio (and the last ten's against the baseline's)."""
    print(f"kv_aware routing path, {args.conversations} agent conversations of {args.turns} "
          f"turns (+{args.step} ids and a {ANSWER}-id answer a turn), {args.engines} engines; "
          f"medians of {args.rounds} rounds:")
    last_of = {}
    for name, rounds in runs.items():
        turns = [statistics.median(values) for values in zip(*rounds, strict=True)]
        first, last = statistics.fmean(turns[:10]), statistics.fmean(turns[-10:])
        last_of[name] = last
        print(f"  {name:<10} first 10 turns {first:.3f} ms, last 10 {last:.3f} ms CPU / request"
              f"   last / first {last / first:.2f}")
    if "baseline" in last_of:
        print(f"  last 10, candidate / baseline: "
              f"{last_of['candidate'] / last_of['baseline']:.2f}")


if __name__ == "__main__":
    main()
