#!/usr/bin/env python3
"""A batch on idle capacity: interactive latency with and without a 2,000-line batch running.

Starts ``direct-frontend run`` on a fleet of simulated engines (a fixed time per token,
so the fleet has a known capacity; ``kv_aware`` routing) with two API keys, then:

1. **alone**: interactive streaming requests, open loop, at ``--load`` of the fleet's
   capacity for ``--seconds``; their TTFT p50 / p90 / p99;
2. **with the batch**: a ``--lines`` batch (``/v1/completions``, lines in groups sharing a
   long prompt prefix, shuffled in the file) is uploaded and created with the other key,
   and the same interactive load runs until the batch has completed (at least
   ``--seconds``); the interactive TTFT over that time, the batch's completion time, and
   the fleet's utilisation (tokens the engines produced over what they could have).

It prints the ratio of the interactive p90 with the batch to its p90 alone (the target:
within 10 %), the batch's time against the time it would take on exactly the capacity the
interactive load leaves idle, and the share of the batch's prompt tokens the engines had
cached (its lines sharing a prefix run together, where the KV-aware policy keeps them on
the engine that cached it). Figures, not assertions: compare them within one run.

Usage::

    python scripts/bench_batch.py                          # ~2 min
    python scripts/bench_batch.py --seconds 20 --load 0.6 --lines 2000 --batch-concurrency 8
    python scripts/bench_batch.py --external-engines     # engines off the router's CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import re
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from bench_daemon import command, daemon, free_port, pct

ROOT = pathlib.Path(__file__).resolve().parent.parent
INTERACTIVE_KEY, BATCH_KEY = "sk-interactive-0001", "sk-batch-owner-0002"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango", "uniform", "victor", "whiskey", "xray")


def fleet_text(args: argparse.Namespace, port: int, engine_ports: list[int]) -> str:
    """The fleet: simulated engines in the daemon, or (``engine_ports``) engines of their own
    processes at those ports."""
    if engine_ports:
        engines = "\n".join(textwrap.dedent(f"""\
            [[engine]]
            name = "e{i}"
            url = "grpc://127.0.0.1:{engine_port}"
            kind = "sglang"
            """) for i, engine_port in enumerate(engine_ports))
    else:
        engines = "\n".join(textwrap.dedent(f"""\
            [[engine]]
            name = "e{i}"
            url = "grpc://127.0.0.1:{free_port()}"
            kind = "sglang"
            simulate = true
            [engine.simulator]
            decode_us_per_token = {args.token_ms * 1000:.0f}
            prefill_us_per_token = {args.prefill_us:.0f}
            eos_probability = 0.0
            max_running = {args.slots_per_engine}
            """) for i in range(args.engines))
    slots = args.engines * args.slots_per_engine
    return textwrap.dedent(f"""\
        [frontend]
        listen = "127.0.0.1:{port}"
        served_model_name = "demo"
        tokenizer = "{ROOT / 'config' / 'demo-model'}"

        [frontend.auth]
        api_keys_env = "BENCH_KEYS"

        [frontend.access_log]
        enabled = false

        [frontend.routing]
        policy = "kv_aware"

        [frontend.limits]
        max_in_flight = {slots}
        max_queue = {8 * slots}
        queue_timeout_s = 60

        [frontend.responses]
        backend = "sqlite"
        path = "state/bench.db"

        [frontend.batches]
        concurrency = {args.batch_concurrency}
        """) + "\n" + engines


@contextlib.contextmanager
def engines(args: argparse.Namespace, directory: pathlib.Path) -> Iterator[list[int]]:
    """``--external-engines``: each simulated engine in a process of its own (so the
    engines' work is not the router's CPU); else none."""
    if not args.external_engines:
        yield []
        return
    ports = [free_port() for _ in range(args.engines)]
    log = (directory / "engines.log").open("wb")
    children = [subprocess.Popen([
        command(), "simulate-engine", "--kind", "sglang", "--port", str(engine_port),
        "--model-dir", str(ROOT / "config" / "demo-model"), "--served-model-name", "demo",
        "--decode-us-per-token", f"{args.token_ms * 1000:.0f}",
        "--prefill-us-per-token", f"{args.prefill_us:.0f}", "--eos-probability", "0",
        "--max-running", str(args.slots_per_engine)], stdout=log, stderr=log,
        start_new_session=True) for engine_port in ports]
    try:
        yield ports
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
        log.close()


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    refused: int = 0
    failed: int = 0


async def stream(client: httpx.AsyncClient, tokens: int, tally: Tally) -> None:
    body = {"model": "demo", "prompt": "hello", "max_tokens": tokens, "stream": True}
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers={
                "authorization": f"Bearer {INTERACTIVE_KEY}"}) as reply:
            if reply.status_code != 200:
                tally.refused += reply.status_code == 429
                tally.failed += reply.status_code != 429
                return
            first = None
            async for line in reply.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - started
    except httpx.HTTPError:
        tally.failed += 1
        return
    if first is not None:
        tally.ttft.append(first)


async def open_loop(client: httpx.AsyncClient, rate: float, tokens: int, tally: Tally,
                    rng: random.Random, until: asyncio.Event | None, seconds: float) -> None:
    """Poisson arrivals at ``rate`` per second for ``seconds`` (and until ``until`` is set);
    waits for every stream."""
    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or (until is not None and not until.is_set()):
        tasks.append(asyncio.create_task(stream(client, tokens, tally)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


def batch_file(args: argparse.Namespace, rng: random.Random) -> bytes:
    """``--lines`` completions in groups of ``--group`` sharing a long prompt, shuffled."""
    lines = []
    for i in range(args.lines):
        group = i // args.group
        shared = " ".join(random.Random(group).choice(WORDS) for _ in range(args.prefix_words))
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "demo", "prompt": f"{shared}\nQuestion {i}:",
                               "max_tokens": args.batch_tokens}})
    rng.shuffle(lines)
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def counter(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {name: counter(text, f"direct_frontend_{name}") for name in (
        "completion_tokens_total", "model_prompt_tokens_total", "model_cached_tokens_total")}


async def run_batch(client: httpx.AsyncClient, data: bytes, done: asyncio.Event,
                    report: dict[str, float]) -> None:
    auth = {"authorization": f"Bearer {BATCH_KEY}"}
    uploaded = await client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                                 files={"file": ("batch.jsonl", data)})
    uploaded.raise_for_status()
    started = time.perf_counter()
    made = await client.post("/v1/batches", headers=auth, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions",
        "completion_window": "24h"})
    made.raise_for_status()
    batch_id = made.json()["id"]
    while True:
        await asyncio.sleep(0.25)
        batch = (await client.get(f"/v1/batches/{batch_id}", headers=auth)).json()
        if batch["status"] not in ("validating", "in_progress", "finalizing"):
            break
    report["seconds"] = time.perf_counter() - started
    report["completed"] = batch["request_counts"]["completed"]
    report["failed"] = batch["request_counts"]["failed"]
    report["status_ok"] = float(batch["status"] == "completed")
    done.set()


async def phase(base: str, args: argparse.Namespace, rate: float,
                data: bytes | None) -> tuple[Tally, dict[str, float], dict[str, float], float]:
    tally, report = Tally(), {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        before = await metrics(client)
        started = time.perf_counter()
        done = asyncio.Event()
        jobs = [open_loop(client, rate, args.tokens, tally, random.Random(args.seed),
                          done if data is not None else None, args.seconds)]
        if data is not None:
            jobs.append(run_batch(client, data, done, report))
        await asyncio.gather(*jobs)
        elapsed = time.perf_counter() - started
        after = await metrics(client)
    return tally, report, {k: after[k] - before[k] for k in after}, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--slots-per-engine", type=int, default=8)
    parser.add_argument("--token-ms", type=float, default=20.0)
    parser.add_argument("--prefill-us", type=float, default=50.0, help="per uncached token")
    parser.add_argument("--tokens", type=int, default=20, help="an interactive answer's")
    parser.add_argument("--load", type=float, default=0.6, help="interactive, of capacity")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--group", type=int, default=20, help="lines sharing a prefix")
    parser.add_argument("--prefix-words", type=int, default=150)
    parser.add_argument("--batch-tokens", type=int, default=8, help="a batch line's answer")
    parser.add_argument("--batch-concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--external-engines", action="store_true",
                        help="each engine in a process of its own (not in the daemon)")
    args = parser.parse_args()
    slots = args.engines * args.slots_per_engine
    token_s = args.token_ms / 1000
    capacity_rps = slots / (args.tokens * token_s)
    rate = capacity_rps * args.load
    data = batch_file(args, random.Random(args.seed))
    print(f"bench_batch: {args.engines} engines x {args.slots_per_engine} slots, "
          f"{args.token_ms:g} ms a token; interactive {args.tokens}-token answers at "
          f"{args.load:.0%} of capacity ({rate:.1f} of {capacity_rps:.1f} req/s); batch "
          f"{args.lines} lines of {args.batch_tokens} tokens, groups of {args.group} sharing "
          f"{args.prefix_words} words, concurrency {args.batch_concurrency}")
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp, \
            engines(args, pathlib.Path(tmp)) as ports, \
            daemon(fleet_text(args, free_port(), ports), pathlib.Path(tmp),
                   {"BENCH_KEYS": f"{INTERACTIVE_KEY},{BATCH_KEY}"}) as base:
        alone, _, _, _ = asyncio.run(phase(base, args, rate, None))
        mixed, batch, used, elapsed = asyncio.run(phase(base, args, rate, data))
    # the capacity the interactive load leaves idle, in slot-seconds a second
    idle_slots = slots * (1 - args.load)
    ideal_s = args.lines * args.batch_tokens * token_s / idle_slots
    capacity_tokens = slots / token_s * elapsed
    cached = used["model_cached_tokens_total"] / max(used["model_prompt_tokens_total"], 1)
    print(f"{'phase':<14}{'TTFT p50':>11}{'p90':>10}{'p99':>10}{'requests':>10}{'refused':>9}")
    for name, tally in (("alone", alone), ("with batch", mixed)):
        print(f"{name:<14}{pct(tally.ttft, 0.5) * 1000:>8.1f} ms{pct(tally.ttft, 0.9) * 1000:>7.1f}"
              f" ms{pct(tally.ttft, 0.99) * 1000:>7.1f} ms{len(tally.ttft):>10}"
              f"{tally.refused + tally.failed:>9}")
    ratio = pct(mixed.ttft, 0.9) / pct(alone.ttft, 0.9)
    print(f"interactive TTFT p90 with the batch / alone: {ratio:.3f} (target <= 1.10: "
          f"{ratio <= 1.10})")
    print(f"batch: {'completed' if batch.get('status_ok') else 'NOT completed'}, "
          f"{batch.get('completed', 0):.0f} lines completed, {batch.get('failed', 0):.0f} "
          f"failed, in {batch.get('seconds', float('nan')):.1f} s (on exactly the idle "
          f"capacity: {ideal_s:.1f} s; ratio {batch.get('seconds', float('nan')) / ideal_s:.2f})")
    print(f"fleet utilisation while the batch ran: "
          f"{used['completion_tokens_total'] / capacity_tokens:.0%} of its token capacity "
          f"(interactive alone: {args.load:.0%}); prompt tokens cached: {cached:.0%}")


if __name__ == "__main__":
    main()
