#!/usr/bin/env python3
"""Several models behind one daemon: per-model TTFT and cache hit rate under a mixed load.

Why: with ``[[model]]`` tables each model has its own engines, policy and
queue. This runs one daemon serving ``--models`` models, each on its own pool
of ``--engines-per-model`` simulated SGLang engines (embedded, ``simulate =
true``) routed ``kv_aware`` on the router's own prefix memory, and drives
prefix-heavy multi-turn chats of every model at once, so the models share the
daemon (and its CPU) but never an engine. The last model's engines are
``--slow-factor`` times slower at prefill, to show that its queue does not
hold up the others.

Figures per model: TTFT p50/p90 (client-side, to the first content token),
hit rate = Σ ``cached_tokens`` / Σ ``prompt_tokens`` as the frontend reports
them, cross-checked with the daemon's ``direct_frontend_model_*_tokens_total``
series, and request errors.

Usage (also ``python scripts/bench_routing.py --multi-model ...``)::

    python scripts/bench_models.py                     # 3 models × 2 engines, ~20 s
    python scripts/bench_models.py --models 2 --conversations 8 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_overhead import HOST, MODEL_DIR, Child, cli_argv, free_ports

WORDS = ("river", "stone", "cloud", "lantern", "orchard", "harbor", "meadow", "copper",
         "violet", "engine", "signal", "garden", "winter", "thread", "canvas", "mirror")


def fleet_text(args: argparse.Namespace, listen: int, ports: Sequence[Sequence[int]]) -> str:
    lines = ["[frontend]", f'listen = "{HOST}:{listen}"', f'tokenizer = "{MODEL_DIR}"', "",
             "[frontend.probe]", "interval_s = 1.0", ""]
    for m in range(args.models):
        lines += ["[[model]]", f'name = "model-{m}"', "[model.routing]", 'policy = "kv_aware"',
                  "[model.routing.knobs]", "block_size = 16", ""]
    for m, model_ports in enumerate(ports):
        slow = args.slow_factor if m == args.models - 1 else 1.0
        for e, port in enumerate(model_ports):
            lines += ["[[engine]]", f'name = "m{m}-e{e}"', f'url = "grpc://{HOST}:{port}"',
                      'kind = "sglang"', f'model = "model-{m}"', "simulate = true",
                      "block_size = 16", "[engine.simulator]",
                      f"prefill_us_per_token = {args.prefill_us * slow}",
                      f"decode_us_per_token = {args.decode_us}", "eos_probability = 0.0", ""]
    return "\n".join(lines)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def chat(client: httpx.AsyncClient, base: str, model: str, messages: list[dict[str, str]],
               max_tokens: int) -> tuple[float, int, int, str]:
    """One streamed chat turn: (TTFT s, prompt tokens, cached tokens, answer)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, parts, usage = 0.0, [], None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", ()):
                if content := choice.get("delta", {}).get("content"):
                    ttft = ttft or time.perf_counter() - start
                    parts.append(content)
    if usage is None:
        raise RuntimeError("no usage")
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return ttft, int(usage["prompt_tokens"]), cached, "".join(parts)


async def drive(args: argparse.Namespace, base: str) -> dict[str, dict[str, Any]]:
    rng = random.Random(args.seed)
    results = {f"model-{m}": {"ttft": [], "prompt": 0, "cached": 0, "errors": 0}
               for m in range(args.models)}
    systems = [text(rng, args.system_words) for _ in range(args.models)]

    async def conversation(client: httpx.AsyncClient, model: int, seed: int) -> None:
        local = random.Random(seed)
        name, result = f"model-{model}", results[f"model-{model}"]
        history = [{"role": "system", "content": systems[model]}]
        for _ in range(args.turns):
            history.append({"role": "user", "content": text(local, 12)})
            try:
                ttft, prompt, cached, answer = await chat(client, base, name, history, 16)
            except (RuntimeError, httpx.HTTPError) as exc:
                result["errors"] += 1
                print(f"{name}: {exc}", file=sys.stderr)
                return
            result["ttft"].append(ttft)
            result["prompt"] += prompt
            result["cached"] += cached
            history.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=args.concurrency * args.models)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        gate = asyncio.Semaphore(args.concurrency * args.models)

        async def gated(model: int, seed: int) -> None:
            async with gate:
                await conversation(client, model, seed)

        async with asyncio.TaskGroup() as group:
            for c in range(args.conversations):
                for m in range(args.models):
                    group.create_task(gated(m, rng.randrange(1 << 30) + c))
    return results


def model_metric(metrics: str, name: str, model: str) -> float:
    found = re.search(rf'^direct_frontend_{name}\{{model="{re.escape(model)}"\}} (\S+)$',
                      metrics, re.M)
    return float(found.group(1)) if found else 0.0


def _serving(base: str) -> int:
    """Engines serving, as ``/ready`` says (0 while the daemon does not answer yet)."""
    try:
        return int(httpx.get(base + "/ready", timeout=2).json().get("serving", 0))
    except httpx.HTTPError:
        return 0


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--engines-per-model", type=int, default=2)
    p.add_argument("--conversations", type=int, default=12, help="per model")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="conversations at once per model")
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--prefill-us", type=float, default=200.0)
    p.add_argument("--decode-us", type=float, default=4000.0)
    p.add_argument("--slow-factor", type=float, default=4.0,
                   help="prefill slowdown of the last model's engines")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.models < 1 or args.engines_per_model < 1:
        p.error("--models and --engines-per-model must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ports = free_ports(1 + args.models * args.engines_per_model)
    listen, rest = ports[0], ports[1:]
    pools = [rest[m * args.engines_per_model:(m + 1) * args.engines_per_model]
             for m in range(args.models)]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-models-"))
    fleet = tmp / "fleet.toml"
    fleet.write_text(fleet_text(args, listen, pools))
    daemon = Child("daemon", [*cli_argv(), "run", str(fleet), "--no-watch"], tmp / "daemon.log")
    base = f"http://{HOST}:{listen}"
    try:
        deadline = time.monotonic() + 60
        total = args.models * args.engines_per_model
        while _serving(base) < total:
            daemon.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines did not all serve:\n{daemon.log_tail()}")
            time.sleep(0.1)
        started = time.perf_counter()
        results = asyncio.run(drive(args, base))
        wall = time.perf_counter() - started
        metrics = httpx.get(base + "/metrics").text
    finally:
        daemon.stop()
    print(f"{args.models} models × {args.engines_per_model} simulated SGLang engines, kv_aware "
          f"(approximate); {args.conversations} conversations × {args.turns} turns per model; "
          f"last model's prefill ×{args.slow_factor:g}; {wall:.1f} s\n")
    print(f"{'model':<10} {'requests':>8} {'errors':>6} {'TTFT p50':>10} {'TTFT p90':>10} "
          f"{'hit rate':>9} {'(daemon)':>9}")
    for model, r in results.items():
        hit = r["cached"] / max(1, r["prompt"])
        daemon_hit = model_metric(metrics, "model_cached_tokens_total", model) / max(
            1.0, model_metric(metrics, "model_prompt_tokens_total", model))
        print(f"{model:<10} {len(r['ttft']):>8} {r['errors']:>6} "
              f"{pct(r['ttft'], 0.5) * 1000:>8.1f}ms {pct(r['ttft'], 0.9) * 1000:>8.1f}ms "
              f"{hit:>9.1%} {daemon_hit:>9.1%}")
        r["ttft_mean_ms"] = statistics.fmean(r["ttft"] or [float("nan")]) * 1000
    shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"parameters": vars(args), "results": results}, separators=(",", ":")))
    return 1 if any(r["errors"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
