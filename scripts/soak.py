#!/usr/bin/env python3
"""Soak: concurrent streams while engines are killed and restarted at random.

Starts ``--engines`` standalone simulator processes and a ``direct-frontend
run`` daemon in front of them, records the expected text of every prompt
(the simulator is deterministic from its token prefix), then runs
``--concurrency`` streaming clients for ``--seconds`` while a chaos task
SIGKILLs a random engine every ``--kill-every`` seconds and restarts it on the
same port ``--down-for`` seconds later (at most ``--max-down`` down at once,
never the last engine up).

Prints requests completed, failed (and how many of those failed while an
engine process was up: listening, not yet killed), retried and migrated
(from the daemon's metrics), and any duplicated or lost output (each
stream's text against the uninterrupted text, and its usage against
max_tokens). Exits 1 unless: 0 failed while an engine process was up, 0
duplicated, 0 lost.

``--churn`` is the harsh churn of issue 17: three engines, up to two down at
once, each restarted two seconds after its kill, 12 streaming clients, the
fleet file's default probe settings.

Usage::

    python scripts/soak.py                       # 3 engines, 16 streams, 30 s
    python scripts/soak.py --engines 4 --concurrency 32 --seconds 120
    python scripts/soak.py --probe-interval 5 --probe-timeout 2   # the default probe settings
    python scripts/soak.py --churn --seconds 120  # two of three engines down at once
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import pathlib
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_overhead import HOST, MODEL_DIR, Child, cli_argv, free_ports, wait_for_port, wait_ready

PROMPTS = [
    "Tell me about the sea.",
    "Write a short poem about mountains.",
    "What is the capital of a country you like?",
    "Explain how rain forms.",
    "Give me three ideas for dinner.",
    "Describe a city at night.",
    "Why do cats purr?",
    "Summarise a book you know.",
]


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    failed_while_up: int = 0  # an engine process was up when the client saw the failure
    mismatched: int = 0
    duplicated_chars: int = 0
    lost_chars: int = 0
    usage_wrong: int = 0
    kills: int = 0
    restarts: int = 0
    errors: list[str] = field(default_factory=list)
    #: engine processes listening and not killed (the chaos task keeps it)
    up: set[int] = field(default_factory=set)


def engine_kind(dp_ranks: int) -> str:
    """SGLang engines, or vLLM ones when they have data-parallel ranks (vLLM's are pinned)."""
    return "vllm" if dp_ranks > 1 else "sglang"


def fleet(listen: int, engine_ports: Sequence[int], probe_interval: float,
          probe_timeout: float, dp_ranks: int = 1) -> str:
    kind = engine_kind(dp_ranks)
    ranks = f"dp_ranks = {dp_ranks}\n" if dp_ranks > 1 else ""
    engines = "".join(
        f'\n[[engine]]\nname = "e{i}"\nurl = "grpc://{HOST}:{port}"\nkind = "{kind}"\n{ranks}'
        for i, port in enumerate(engine_ports)
    )
    # ranks are pinned by KV-aware routing (here by its approximate memory: no KV events)
    routing = '\n[frontend.routing]\npolicy = "kv_aware"\n' if dp_ranks > 1 else ""
    return (
        f'[frontend]\nlisten = "{HOST}:{listen}"\nserved_model_name = "demo"\n'
        f"tokenizer = {json.dumps(str(MODEL_DIR))}\n{routing}"
        f"\n[frontend.probe]\ninterval_s = {probe_interval}\ntimeout_s = {probe_timeout}\n"
        + engines
    )


def engine_argv(port: int, decode_us: float, dp_ranks: int = 1) -> list[str]:
    return [
        *cli_argv(), "simulate-engine", "--kind", engine_kind(dp_ranks), "--port", str(port),
        "--model-dir", str(MODEL_DIR), "--served-model-name", "demo",
        "--decode-us-per-token", str(decode_us), "--prefill-us-per-token", "5",
        "--eos-probability", "0", "--dp-size", str(dp_ranks),
    ]


async def stream_once(
    client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int
) -> tuple[str, int | None, str | None]:
    """One streaming chat request: (text, usage completion tokens, error)."""
    body = {
        "model": "demo", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    usage: int | None = None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return "", None, f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "".join(text), usage, f"error event: {event['error']['message']}"
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text), usage, None


def compare(expected: str, got: str) -> tuple[int, int]:
    """(duplicated, lost) characters of ``got`` against ``expected``."""
    duplicated = lost = 0
    matcher = difflib.SequenceMatcher(a=expected, b=got, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("insert", "replace"):
            duplicated += j2 - j1
        if tag in ("delete", "replace"):
            lost += i2 - i1
    return duplicated, lost


async def chaos(
    engines: dict[int, Child], args: argparse.Namespace, tally: Tally, stop: asyncio.Event,
    logdir: pathlib.Path,
) -> None:
    rng = random.Random(args.seed)
    down: dict[int, float] = {}
    while not stop.is_set():
        await asyncio.sleep(args.kill_every)
        now = time.monotonic()
        for port, since in list(down.items()):
            if now - since >= args.down_for:
                engines[port] = Child(f"engine:{port}",
                                      engine_argv(port, args.decode_us, args.dp_ranks),
                                      logdir / f"engine-{port}-{now:.0f}.log")
                await wait_for_port(engines[port], port)
                tally.up.add(port)
                del down[port]
                tally.restarts += 1
        up = [p for p in engines if p not in down]
        if len(up) > 1 and len(down) < (args.max_down or len(engines) - 1):
            victim = rng.choice(up)
            tally.up.discard(victim)  # down from the moment the signal is sent
            engines[victim].popen.send_signal(signal.SIGKILL)
            engines[victim].popen.wait()
            down[victim] = time.monotonic()
            tally.kills += 1


async def main(args: argparse.Namespace) -> int:
    logdir = pathlib.Path(tempfile.mkdtemp(prefix="df-soak-"))
    listen, *ports = free_ports(1 + args.engines)
    fleet_path = logdir / "fleet.toml"
    fleet_path.write_text(
        fleet(listen, ports, args.probe_interval, args.probe_timeout, args.dp_ranks))
    engines = {
        p: Child(f"engine:{p}", engine_argv(p, args.decode_us, args.dp_ranks),
                 logdir / f"engine-{p}.log")
        for p in ports
    }
    daemon = Child("daemon", [*cli_argv(), "run", str(fleet_path)], logdir / "daemon.log")
    tally = Tally()
    base = f"http://{HOST}:{listen}"
    try:
        for port, child in engines.items():
            await wait_for_port(child, port)
            tally.up.add(port)
        await wait_ready(daemon, listen)
        async with httpx.AsyncClient(timeout=60) as client:
            expected = {}
            for prompt in PROMPTS:
                text, usage, error = await stream_once(client, base, prompt, args.max_tokens)
                assert error is None and usage == args.max_tokens, (error, usage)
                expected[prompt] = text
            stop = asyncio.Event()
            deadline = time.monotonic() + args.seconds

            async def worker(seed: int) -> None:
                rng = random.Random(seed)
                while time.monotonic() < deadline:
                    prompt = rng.choice(PROMPTS)
                    try:
                        text, usage, error = await stream_once(
                            client, base, prompt, args.max_tokens
                        )
                    except httpx.HTTPError as exc:
                        text, usage, error = "", None, repr(exc)
                    if error is not None:
                        tally.failed += 1
                        if tally.up:
                            tally.failed_while_up += 1
                        tally.errors.append(error)
                        continue
                    tally.completed += 1
                    if usage != args.max_tokens:
                        tally.usage_wrong += 1
                    if text != expected[prompt]:
                        tally.mismatched += 1
                        dup, lost = compare(expected[prompt], text)
                        tally.duplicated_chars += dup
                        tally.lost_chars += lost

            chaos_task = asyncio.create_task(chaos(engines, args, tally, stop, logdir))
            await asyncio.gather(*(worker(args.seed + i) for i in range(args.concurrency)))
            stop.set()
            chaos_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await chaos_task
            metrics = (await client.get(base + "/metrics")).text
    finally:
        daemon.stop()
        for child in engines.values():
            child.stop()

    def outcome(name: str, metric: str = "engine_requests_total") -> int:
        return int(sum(float(v) for v in re.findall(
            rf'direct_frontend_{metric}{{[^}}]*outcome="{name}"[^}}]*}} (\S+)', metrics)))

    print(f"soak: {args.engines} engines, {args.concurrency} streams, {args.seconds:.0f} s, "
          f"{args.max_tokens} tokens each; logs in {logdir}")
    print(f"  engines killed / restarted: {tally.kills} / {tally.restarts}")
    print(f"  requests completed:         {tally.completed}")
    print(f"  requests failed:            {tally.failed}")
    print(f"    while an engine was up:   {tally.failed_while_up}")
    print(f"  attempts retried:           {outcome('retried')}")
    print(f"  streams migrated:           {outcome('migrated')}")
    waits = {name: outcome(name, "engine_waits_total") for name in ("served", "expired")}
    print(f"  waits for an engine:        {waits['served']} served, {waits['expired']} expired")
    print(f"  streams with other text:    {tally.mismatched}")
    print(f"  duplicated characters:      {tally.duplicated_chars}")
    print(f"  lost characters:            {tally.lost_chars}")
    print(f"  usage not equal max_tokens: {tally.usage_wrong}")
    for error in tally.errors[:5]:
        print(f"  e.g. {error}")
    ok = not (tally.failed_while_up or tally.duplicated_chars or tally.lost_chars
              or tally.usage_wrong)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--decode-us", type=float, default=2000.0, help="engine time per token")
    p.add_argument("--kill-every", type=float, default=2.0)
    p.add_argument("--down-for", type=float, default=1.0)
    p.add_argument("--max-down", type=int, default=None,
                   help="engines down at once at most (default: all but one)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dp-ranks", type=int, default=1,
                   help="data-parallel ranks per engine: vLLM engines, routed kv_aware, each "
                        "request pinned to a rank")
    p.add_argument("--probe-interval", type=float, default=0.25,
                   help="[frontend.probe] interval_s (the fleet file's default is 5.0)")
    p.add_argument("--probe-timeout", type=float, default=0.5,
                   help="[frontend.probe] timeout_s (the fleet file's default is 2.0)")
    p.add_argument("--churn", action="store_true",
                   help="issue 17's churn: 3 engines, up to 2 down at once, 12 streams, "
                        "default probe settings (options given as well still win)")
    if p.parse_known_args(argv)[0].churn:
        p.set_defaults(engines=3, concurrency=12, kill_every=1.0, down_for=2.0, max_down=2,
                       probe_interval=5.0, probe_timeout=2.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
