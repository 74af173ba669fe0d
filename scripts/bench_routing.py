#!/usr/bin/env python3
"""Compare the routing policies on one prefix-heavy, multi-turn chat workload.

Why: KV-aware routing pays only if it sends a request where its prefix is
already cached *and* keeps the fleet balanced. This runs the same seeded
workload through every policy, each on a fresh fleet of simulated engines
(cold caches), and puts TTFT, the engines' own cache hit rate and the load
spread side by side.

Modes: ``round_robin``, ``least_loaded``, ``cache_affinity`` (the baseline
policy of issue 15, on KV events), ``approximate`` (``kv_aware`` with no
``kv_events`` in the fleet file: the router's own prefix memory) and
``kv-events`` (``kv_aware`` with every engine's ``kv_events``/``kv_replay``).

``bench_routing.py grid`` runs the same policy objects against engines
modelled in virtual time instead (``routing_sim.py``: open-loop multi-turn
tenants, LRU block caches, prefill that slows with concurrent prefills): a
deterministic grid over cache size, tenants, prompt length and load, which
wall-clock runs on a shared machine cannot resolve. This real-socket mode is
the confirmation that the daemon does what the model says.

Workload: ``--system-prompts`` long system prompts shared (with a Zipf
``--skew``) by ``--conversations`` chats of ``--turns`` turns; each turn appends
the previous answer and a new user message, so every prompt extends the
previous one. ``--concurrency`` clients take conversations from one queue and
put each back after its turn, so a conversation's next turn comes roughly one
round of the other conversations later. The engines are deterministic from
their prompt, so every mode sends exactly the same prompts (checked: a digest
of every prompt length and answer is compared across modes).

Engines: standalone processes of this script (``engine`` subcommand, the
:class:`SimEngine` API), because ``simulate-engine`` has no flags for KV events,
cache capacity or block size. Prefill costs ``--prefill-us`` per *uncached*
prompt token, so cache hits show up in TTFT; each engine's prefix cache holds
``--capacity-factor`` × (whole working set / engines) blocks: one engine's share,
not everything, so placement matters.

Figures: TTFT (client-side, request sent → first content token); the modelled
prefill (uncached tokens × ``--prefill-us``: the part of TTFT routing controls,
immune to CPU noise on a shared machine); hit rate = Σ
``usage.prompt_tokens_details.cached_tokens`` / Σ ``prompt_tokens`` as the
frontend reports them; requests per engine from the engines' own counters
(cross-checked with the daemon's ``direct_frontend_engine_requests_total``); and,
to explain hit rates, how many later turns found their own history cached.
For ``kv-events`` the daemon's ``direct_frontend_kv_index_blocks`` must be non-zero,
else the row is flagged: the KV events were not consumed. Each mode runs
``--repeat`` times, interleaved with the others, and the figures are pooled.

Exit status: 0 ok, 1 request errors or a workload mismatch, 2 a mode could not
run (e.g. the daemon refused the policy) or its KV events were not consumed.

Usage::

    python scripts/bench_routing.py                    # 4 engines, 2 × 256 requests per mode, ~70 s
    python scripts/bench_routing.py --repeat 1 --conversations 32      # ~20 s
    python scripts/bench_routing.py --modes kv-events --knob overlap_weight=4
    python scripts/bench_routing.py --json             # also one JSON line at the end
    python scripts/bench_routing.py --multi-model      # per-model TTFT and hit rate
                                                       # (scripts/bench_models.py)
    python scripts/bench_routing.py grid               # the virtual-time grid, ~3 min
    python scripts/bench_routing.py grid --points 0,4 --seeds 1 --knob overlap_weight=2
    python scripts/bench_routing.py grid --oracle      # also bounds no router can beat, and
                                                       # references (pooled LRU, exact greedy)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx
from tokenizers import Tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_overhead import (  # a sibling script, as soak.py does
    HOST,
    MODEL,
    MODEL_DIR,
    Child,
    cli_argv,
    code_under_test,
    free_ports,
    machine_busy_seconds,
    proc_cpu_seconds,
    wait_for_port,
)

MODES = ("round_robin", "least_loaded", "cache_affinity", "approximate", "kv-events")
POLICY = {"round_robin": "round_robin", "least_loaded": "least_loaded",
          "cache_affinity": "cache_affinity", "approximate": "kv_aware", "kv-events": "kv_aware"}
WITH_EVENTS = ("cache_affinity", "kv-events")  # modes whose engines publish KV events
# Engine timing: a large model's ratio (prefill 5k tokens/s, decode 125 tokens/s per sequence),
# so an uncached ~700-token prompt costs ~140 ms of TTFT and a cached one a few ms. Slower than
# "50 µs / 1 ms" on purpose: at 1 ms/token, 16 streams kept a 2-core machine CPU-bound (1.9
# cores busy; TTFT 2-3× the modelled prefill), so TTFT measured CPU queueing, not cache hits.
DEFAULT_PREFILL_US = 200.0
DEFAULT_DECODE_US = 8000.0
TEMPLATE_TOKENS_PER_MESSAGE = 5  # "<|im_start|>role\n … <|im_end|>\n" in the demo ChatML template


# -- workload ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Conversation:
    system: int  # index of its system prompt
    users: tuple[str, ...]  # one user message per turn
    max_tokens: tuple[int, ...]  # answer length per turn (the engines never stop early)


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    systems: tuple[str, ...]
    system_tokens: tuple[int, ...]
    conversations: tuple[Conversation, ...]
    working_set_blocks: int  # estimated distinct KV blocks of the whole run

    @property
    def requests(self) -> int:
        return sum(len(c.users) for c in self.conversations)


def _words(tokenizer: Tokenizer) -> list[str]:
    """Vocabulary entries that are one token each: " word" (leading space, letters)."""
    words = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=False)):
        text = tokenizer.decode([i])
        if text.startswith(" ") and text[1:].isalpha():
            words.append(text)
    return words


def _text(rng: random.Random, words: Sequence[str], tokenizer: Tokenizer, tokens: int) -> str:
    """Random words cut to exactly ``tokens`` tokens of the demo tokenizer."""
    text = "".join(rng.choice(words) for _ in range(tokens + 8))
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:tokens]
    return tokenizer.decode(ids).strip()


def build_workload(args: argparse.Namespace) -> Workload:
    """The seeded workload; every mode replays it. System prompts get Zipf(``skew``) popularity."""
    rng = random.Random(args.seed)
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    words = _words(tokenizer)
    systems = tuple(
        f"You are assistant number {k}." + " " + _text(rng, words, tokenizer, args.system_tokens)
        for k in range(args.system_prompts)
    )
    system_tokens = tuple(len(tokenizer.encode(s, add_special_tokens=False).ids) for s in systems)
    weights = [1 / (k + 1) ** args.skew for k in range(args.system_prompts)]
    lo, hi = args.user_tokens
    conversations = []
    for _ in range(args.conversations):
        system = rng.choices(range(args.system_prompts), weights)[0]
        users = tuple(_text(rng, words, tokenizer, rng.randint(lo, hi)) for _ in range(args.turns))
        answers = tuple(
            max(1, args.answer_tokens + rng.randint(-args.answer_jitter, args.answer_jitter))
            for _ in range(args.turns)
        )
        conversations.append(Conversation(system, users, answers))
    bs = args.block_size
    blocks = sum(math.ceil(t / bs) for t in system_tokens)
    for conv in conversations:
        own = sum(len(tokenizer.encode(u, add_special_tokens=False).ids) for u in conv.users)
        own += sum(conv.max_tokens) + TEMPLATE_TOKENS_PER_MESSAGE * 2 * len(conv.users)
        blocks += math.ceil(own / bs)
    return Workload(systems, system_tokens, tuple(conversations), blocks)


# -- engines (child processes) --------------------------------------------------------------


def engine_argv(args: argparse.Namespace, port: int, stats_port: int, capacity: int,
                kv_ports: tuple[int, int] | None) -> list[str]:
    argv = [
        sys.executable, str(pathlib.Path(__file__).resolve()), "engine",
        "--kind", args.kind, "--port", str(port), "--stats-port", str(stats_port),
        "--prefill-us", str(args.prefill_us), "--decode-us", str(args.decode_us),
        "--max-running", str(args.max_running), "--block-size", str(args.block_size),
        "--capacity-blocks", str(capacity),
    ]
    if kv_ports is not None:
        argv += ["--kv-events-port", str(kv_ports[0]), "--kv-replay-port", str(kv_ports[1])]
    return argv


def engine_main(argv: Sequence[str]) -> None:
    """``bench_routing.py engine ...``: one simulated engine plus a JSON-lines stats port.

    The stats port answers any line with the engine's own counters and cache
    figures, which the standard control channel does not report.
    """
    from direct_frontend.simulator.engine import SimEngine
    from direct_frontend.simulator.model import TimingModel

    p = argparse.ArgumentParser(prog="bench_routing.py engine")
    p.add_argument("--kind", choices=("vllm", "sglang"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--stats-port", type=int, required=True)
    p.add_argument("--prefill-us", type=float, required=True)
    p.add_argument("--decode-us", type=float, required=True)
    p.add_argument("--max-running", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--capacity-blocks", type=int, required=True)
    p.add_argument("--kv-events-port", type=int)
    p.add_argument("--kv-replay-port", type=int)
    p.add_argument("--chunk-tokens", type=int, default=0,
                   help="batched scheduler steps (simulator/steps.py): prefill tokens per step")
    p.add_argument("--step-us", type=float, default=0.0, help="with --chunk-tokens")
    p.add_argument("--context-length", type=int, default=4096)
    a = p.parse_args(argv)
    engine = SimEngine.from_model_dir(
        a.kind, MODEL_DIR, served_model_name=MODEL,
        timing=TimingModel(a.prefill_us, a.decode_us, a.max_running, a.chunk_tokens, a.step_us),
        eos_probability=0.0, seed=0,  # same seed everywhere: same prompt → same answer
        block_size=a.block_size, page_size=a.block_size, kv_capacity_blocks=a.capacity_blocks,
        kv_events_port=a.kv_events_port, kv_replay_port=a.kv_replay_port,
        context_length=a.context_length,
    )

    def reset() -> None:
        """As a new process: an empty cache, KV events from seq 0 with no history."""
        for rank in engine.kv_ranks:
            rank.cache.reset()
            if rank.publisher is not None:
                rank.publisher.reset_sequence()

    async def stats(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Any line: the counters as JSON; ``reset``: first start over (routing_live.py)."""
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                if line.strip() == b"reset":
                    reset()
                s, cache = engine.stats, engine.kv.cache
                writer.write(json.dumps({
                    "requests": s.requests, "completed": s.completed, "running": s.running,
                    "waiting": s.waiting, "cache_blocks": len(cache),
                    "capacity_blocks": cache.capacity_blocks, "hit_blocks": cache.hits,
                    "evictions": cache.evictions,
                }).encode() + b"\n")
                await writer.drain()
        writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(stats, HOST, a.stats_port)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, engine.close)
        try:
            await engine.serve_forever(HOST, a.port, ready=lambda: print("ready", flush=True))
        finally:
            server.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


async def engine_stats(port: int, command: bytes = b"get") -> dict[str, Any]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(command + b"\n")
        return dict(json.loads(await reader.readline()))
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# -- the daemon -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class EnginePorts:
    name: str
    grpc: int
    stats: int
    kv: tuple[int, int] | None  # (events PUB, replay ROUTER) when the engine publishes


def fleet_text(mode: str, listen: int, engines: Sequence[EnginePorts], block_size: int,
               kind: str, knobs: dict[str, str]) -> str:
    lines = [
        "[frontend]", f'listen = "{HOST}:{listen}"', f'served_model_name = "{MODEL}"',
        f"tokenizer = {json.dumps(str(MODEL_DIR))}", "",
        "[frontend.routing]", f'policy = "{POLICY[mode]}"', "",
    ]
    if POLICY[mode] in ("kv_aware", "cache_affinity"):
        merged = {"block_size": str(block_size), **knobs}  # a --knob block_size=N wins
        lines += ["[frontend.routing.knobs]"]
        lines += [f"{name} = {value}" for name, value in merged.items()] + [""]
    lines += ["[frontend.probe]", "interval_s = 0.5", "timeout_s = 2.0", ""]
    for e in engines:
        lines += ["[[engine]]", f'name = "{e.name}"', f'url = "grpc://{HOST}:{e.grpc}"',
                  f'kind = "{kind}"']
        if e.kv is not None:
            lines += [f'kv_events = ["tcp://{HOST}:{e.kv[0]}"]',
                      f'kv_replay = ["tcp://{HOST}:{e.kv[1]}"]']
        lines.append("")
    return "\n".join(lines)


class ModeUnavailable(Exception):
    """The daemon would not run this mode (it exited or never served every engine)."""


def refusal_reason(log_text: str) -> str:
    """The most telling line of a dead daemon's log (the exception, else the last line)."""
    lines = [line.strip(" |") for line in log_text.splitlines() if line.strip(" |")]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line) or "error" in line.lower():
            return line
    return lines[-1] if lines else "no output"


async def wait_all_serving(daemon: Child, client: httpx.AsyncClient, base: str, engines: int,
                           limit_s: float = 60.0) -> None:
    """Poll ``/ready`` until it reports every engine serving; fail fast if the daemon dies."""
    deadline = time.monotonic() + limit_s
    while True:
        code = daemon.popen.poll()
        if code is not None:
            reason = refusal_reason(daemon.log_path.read_text(errors="replace"))
            raise ModeUnavailable(f"the daemon exited ({code}) before serving: {reason}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            body = (await client.get(base + "/ready")).json()
            if body.get("serving") == engines:
                return
        if time.monotonic() > deadline:
            raise ModeUnavailable(f"not every engine serving after {limit_s:.0f}s:\n"
                                  + daemon.log_tail())
        await asyncio.sleep(0.02)


_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text → (name, labels, value) samples (no escaping in our label values)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            out.append((m["name"], labels, float(m["value"])))
    return out


def metric_sum(samples: Sequence[tuple[str, dict[str, str], float]], name: str,
               **match: str) -> float | None:
    values = [v for n, labels, v in samples
              if n == name and all(labels.get(k) == want for k, want in match.items())]
    return sum(values) if values else None


# -- one mode -------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Sample:
    conversation: int
    turn: int
    ttft: float
    total: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    answer: str


class RequestFailed(Exception):
    pass


async def one_turn(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]],
                   max_tokens: int, conversation: int, turn: int) -> Sample:
    """One streamed chat completion; TTFT at the first non-empty content delta."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    ttft = 0.0
    start = time.perf_counter()
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RequestFailed(f"error event: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", ()):
                content = choice.get("delta", {}).get("content")
                if content:
                    if not parts:
                        ttft = time.perf_counter() - start
                    parts.append(content)
    total = time.perf_counter() - start
    if usage is None or not parts:
        raise RequestFailed(f"no usage or no text (usage={usage})")
    details = usage.get("prompt_tokens_details") or {}
    return Sample(conversation, turn, ttft, total, int(usage["prompt_tokens"]),
                  int(details.get("cached_tokens") or 0), int(usage["completion_tokens"]),
                  "".join(parts))


async def drive(client: httpx.AsyncClient, base: str, workload: Workload,
                concurrency: int) -> tuple[list[Sample], list[str]]:
    """Every turn of every conversation, ``concurrency`` at a time, turns in round order."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    histories: list[list[dict[str, str]]] = []
    for i, conv in enumerate(workload.conversations):
        histories.append([{"role": "system", "content": workload.systems[conv.system]}])
        queue.put_nowait(i)
    samples: list[Sample] = []
    errors: list[str] = []

    async def worker() -> None:
        while True:
            i = await queue.get()
            conv, history = workload.conversations[i], histories[i]
            turn = (len(history) - 1) // 2
            history.append({"role": "user", "content": conv.users[turn]})
            try:
                sample = await one_turn(client, base, history, conv.max_tokens[turn], i, turn)
            except (RequestFailed, httpx.HTTPError, ValueError, KeyError) as exc:
                errors.append(f"conversation {i} turn {turn}: {exc!r}")
                queue.task_done()  # the conversation stops here
                continue
            samples.append(sample)
            history.append({"role": "assistant", "content": sample.answer})
            if turn + 1 < len(conv.users):
                queue.put_nowait(i)
            queue.task_done()

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(worker()) for _ in range(concurrency)]
        await queue.join()
        for task in tasks:
            task.cancel()
    return samples, errors


def placement(samples: Sequence[Sample], block_size: int) -> dict[str, int]:
    """How often a turn found its own conversation's history cached (why hit rates differ).

    A later turn "reused its history" when the engine had cached all but the
    last block of the previous turn's prompt: it landed where that turn ran
    (or where its history still was). Engines never say which one served a
    request, so this is read from ``cached_tokens``.
    """
    prompts = {(s.conversation, s.turn): s.prompt_tokens for s in samples}
    later = reused = 0
    for s in samples:
        previous = prompts.get((s.conversation, s.turn - 1))
        if previous is None:
            continue
        later += 1
        reused += s.cached_tokens >= previous - block_size
    return {"later_turns": later, "later_turns_reusing_history": reused}


def modelled_prefill_ms(samples: Sequence[Sample], prefill_us: float) -> list[float]:
    """What the engines' timing model charges for each prompt: uncached tokens × prefill cost.

    TTFT minus this is queueing plus frontend/client/CPU overhead.
    """
    return [(s.prompt_tokens - s.cached_tokens) * prefill_us / 1e3 for s in samples]


def cpu_split(daemon: Child, engines: Sequence[Child]) -> dict[str, float]:
    """CPU seconds so far of the daemon, all engines and this client (to spot a CPU-bound run)."""
    return {"daemon": proc_cpu_seconds(daemon.pid),
            "engines": sum(proc_cpu_seconds(e.pid) for e in engines),
            "client": time.process_time()}


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def spread(counts: Sequence[int]) -> dict[str, float]:
    mean = statistics.fmean(counts)
    return {"min": min(counts), "max": max(counts),
            "cv": statistics.pstdev(counts) / mean if mean else 0.0}


async def run_mode(mode: str, args: argparse.Namespace, workload: Workload, capacity: int,
                   tmp: pathlib.Path, children: list[Child]) -> dict[str, Any]:
    """A fresh fleet (cold caches) and daemon for ``mode``, the whole workload, the figures."""
    n = args.engines
    ports = free_ports(1 + n * 4)
    listen = ports[0]
    engines = [
        EnginePorts(f"e{i}", ports[1 + 4 * i], ports[2 + 4 * i],
                    (ports[3 + 4 * i], ports[4 + 4 * i]) if mode in WITH_EVENTS else None)
        for i in range(n)
    ]
    started = time.perf_counter()
    procs = []
    for e in engines:
        child = Child(f"{mode}:{e.name}", engine_argv(args, e.grpc, e.stats, capacity, e.kv),
                      tmp / f"{mode}-{e.name}.log")
        children.append(child)
        procs.append(child)
    for child, e in zip(procs, engines, strict=True):
        await wait_for_port(child, e.grpc, limit_s=60)
        await wait_for_port(child, e.stats, limit_s=60)
    fleet = tmp / f"fleet-{mode}.toml"
    fleet.write_text(fleet_text(mode, listen, engines, args.block_size, args.kind, args.knobs))
    daemon_cmd = shlex.split(args.daemon_cmd) if args.daemon_cmd else cli_argv()
    daemon = Child(f"{mode}:daemon",
                   [*daemon_cmd, "run", str(fleet), "--log-level", "WARNING", "--no-watch"],
                   tmp / f"{mode}-daemon.log")
    children.append(daemon)
    base = f"http://{HOST}:{listen}"
    result: dict[str, Any] = {"mode": mode, "policy": POLICY[mode],
                              "kv_events_configured": mode in WITH_EVENTS}
    limits = httpx.Limits(max_connections=args.concurrency + 4,
                          max_keepalive_connections=args.concurrency + 4)
    try:
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            try:
                await wait_all_serving(daemon, client, base, n)
            except ModeUnavailable as exc:
                result.update(status="unavailable", reason=str(exc))
                return result
            result["setup_s"] = time.perf_counter() - started
            cpu0 = cpu_split(daemon, procs)
            busy0, t0 = machine_busy_seconds(), time.perf_counter()
            samples, errors = await drive(client, base, workload, args.concurrency)
            wall = time.perf_counter() - t0
            busy = machine_busy_seconds() - busy0
            cpu = {k: v - cpu0[k] for k, v in cpu_split(daemon, procs).items()}
            metrics = parse_metrics((await client.get(base + "/metrics")).text)
        stats = {e.name: await engine_stats(e.stats) for e in engines}
        daemon.check_alive()
    finally:
        daemon.stop()
        for child in procs:
            child.stop()

    ttft = [s.ttft * 1e3 for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    per_engine = [int(stats[e.name]["requests"]) for e in engines]
    daemon_per_engine = [int(metric_sum(metrics, "direct_frontend_engine_requests_total",
                                        engine=e.name) or 0) for e in engines]
    index_blocks = metric_sum(metrics, "direct_frontend_kv_index_blocks")
    reuse = placement(samples, args.block_size)
    digest = hashlib.sha256()
    for s in sorted(samples, key=lambda s: (s.conversation, s.turn)):
        digest.update(f"{s.conversation}/{s.turn}/{s.prompt_tokens}/{s.answer}\n".encode())
    result.update(
        status="ok",
        requests=len(samples), errors=errors[:10], error_count=len(errors),
        ttft_ms=ttft, latency_ms=[s.total * 1e3 for s in samples],
        prefill_ms=modelled_prefill_ms(samples, args.prefill_us),
        prompt_tokens=prompt, cached_tokens=cached,
        engine_requests=per_engine, daemon_engine_requests=daemon_per_engine,
        engine_cache_blocks=[int(stats[e.name]["cache_blocks"]) for e in engines],
        evictions=sum(int(s["evictions"]) for s in stats.values()),
        kv_predicted_cached_tokens=metric_sum(metrics,
                                              "direct_frontend_kv_predicted_cached_tokens_total"),
        kv_reported_cached_tokens=metric_sum(metrics,
                                             "direct_frontend_kv_reported_cached_tokens_total"),
        kv_index_blocks=index_blocks,
        wall_s=wall, machine_cores_busy=busy / wall,
        cores_busy={k: v / wall for k, v in cpu.items()},
        workload_digest=digest.hexdigest()[:16],
        **reuse,
    )
    if mode in WITH_EVENTS and not index_blocks:
        result["status"] = "kv-events-not-consumed"
        result["reason"] = (
            "the daemon ran kv_aware but its KV index stayed empty "
            f"(direct_frontend_kv_index_blocks = {index_blocks}): the fleet file's kv_events "
            "were not consumed, so this row did not measure KV-event routing"
        )
    return result


def aggregate(mode: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One mode over its repeats: TTFT and hit rate pooled over every request, spread per run.

    A run that could not happen makes the mode unavailable; the per-run
    figures stay under ``runs`` (without the per-request lists).
    """
    for run in runs:
        if run["status"] == "unavailable":
            return {"mode": mode, "policy": run["policy"], "status": "unavailable",
                    "reason": run["reason"], "runs": []}
    ttft = [t for run in runs for t in run["ttft_ms"]]
    latency = [t for run in runs for t in run["latency_ms"]]
    prompt = sum(run["prompt_tokens"] for run in runs)
    cached = sum(run["cached_tokens"] for run in runs)
    bad = [run for run in runs if run["status"] != "ok"]
    prefill = [t for run in runs for t in run["prefill_ms"]]
    lists = ("ttft_ms", "latency_ms", "prefill_ms")
    slim = [{k: v for k, v in run.items() if k not in lists} for run in runs]
    for run, full in zip(slim, runs, strict=True):
        run["ttft_mean_ms"] = statistics.fmean(full["ttft_ms"] or [math.nan])
        run["hit_rate"] = run["cached_tokens"] / run["prompt_tokens"] if run["prompt_tokens"] \
            else 0.0
        run["spread"] = spread(run["engine_requests"])
    predicted = [run["kv_predicted_cached_tokens"] for run in runs]
    return {
        "mode": mode, "policy": runs[0]["policy"],
        "status": bad[0]["status"] if bad else "ok",
        "reason": bad[0].get("reason", "") if bad else "",
        "repeats": len(runs), "requests": len(ttft),
        "error_count": sum(run["error_count"] for run in runs),
        "errors": [e for run in runs for e in run["errors"]][:10],
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p50_ms": pct(ttft, 50) if ttft else math.nan,
        "ttft_p90_ms": pct(ttft, 90) if ttft else math.nan,
        "ttft_p99_ms": pct(ttft, 99) if ttft else math.nan,
        "latency_mean_ms": statistics.fmean(latency) if latency else math.nan,
        "prefill_mean_ms": statistics.fmean(prefill) if prefill else math.nan,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "requests_per_engine_min": min(min(run["engine_requests"]) for run in runs),
        "requests_per_engine_max": max(max(run["engine_requests"]) for run in runs),
        "spread_cv": statistics.fmean(run["spread"]["cv"] for run in slim),
        "kv_predicted_cached_tokens": (
            None if any(p is None for p in predicted) else sum(predicted)),
        "kv_reported_cached_tokens": sum(run["kv_reported_cached_tokens"] or 0 for run in runs),
        "later_turns_reusing_history": sum(r["later_turns_reusing_history"] for r in runs)
        / max(1, sum(r["later_turns"] for r in runs)),
        "runs": slim,
    }


# -- report ---------------------------------------------------------------------------------


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def table(results: Sequence[dict[str, Any]]) -> str:
    head = ("| mode | TTFT mean (ms) | TTFT p90 (ms) | modelled prefill mean (ms) | "
            "cache hit rate | requests per engine (min–max) | spread CV |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["status"] == "unavailable":
            lines.append(f"| {r['mode']} (unavailable) | – | – | – | – | – | – |")
            continue
        mark = " ⚠ events not consumed" if r["status"] != "ok" else ""
        lines.append(
            f"| {r['mode']}{mark} | {r['ttft_mean_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
            f"{r['prefill_mean_ms']:.1f} | {fmt_pct(r['hit_rate'])} | "
            f"{r['requests_per_engine_min']}–{r['requests_per_engine_max']} | "
            f"{r['spread_cv']:.2f} |"
        )
    return "\n".join(lines)


def parameters(args: argparse.Namespace, workload: Workload, capacity: int) -> str:
    sys_tokens = f"{min(workload.system_tokens)}–{max(workload.system_tokens)}"
    per_system = [0] * len(workload.systems)
    for c in workload.conversations:
        per_system[c.system] += 1
    repeats = (f"; each mode run {args.repeat} times, interleaved, figures pooled "
               "(CV: mean of the runs')") if args.repeat > 1 else ""
    return "\n".join([
        f"- {args.engines} simulated `{args.kind}` engines (standalone processes), fresh "
        f"(cold caches) for each run; prefill {args.prefill_us:g} µs per uncached prompt "
        f"token, decode {args.decode_us:g} µs/token, max_running {args.max_running}, "
        f"block size {args.block_size}",
        f"- prefix cache {capacity} blocks per engine = {args.capacity_factor:g} × working set "
        f"(≈{workload.working_set_blocks} blocks) / {args.engines} engines",
        f"- workload (seed {args.seed}): {args.system_prompts} system prompts of {sys_tokens} "
        f"tokens, {args.conversations} conversations × {args.turns} turns = "
        f"{workload.requests} requests; user messages {args.user_tokens[0]}–"
        f"{args.user_tokens[1]} tokens, answers {args.answer_tokens}±{args.answer_jitter} "
        f"tokens; conversations per system prompt (Zipf {args.skew:g}): {per_system}",
        f"- {args.concurrency} concurrent streaming clients (`/v1/chat/completions`); "
        "TTFT = request sent → first content token, at the client; modelled prefill = "
        "uncached prompt tokens × prefill cost, the part of TTFT routing controls (the rest is "
        f"queueing and CPU){repeats}",
        "- kv_aware knobs: " + ", ".join(
            f"{k} = {v}" for k, v in {"block_size": args.block_size, **args.knobs}.items())
        + ", the rest default",
    ])


def notes(results: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    digests = {run["workload_digest"] for r in results for run in r["runs"]}
    if len(digests) > 1:
        out.append("WORKLOAD MISMATCH: the runs did not send the same prompts/answers "
                   f"(digests {sorted(digests)})")
    cores = os.cpu_count() or 1
    for r in results:
        if r["status"] != "ok":
            out.append(f"{r['mode']}: {r['status'].upper()}: {r['reason']}")
        if r.get("error_count"):
            out.append(f"{r['mode']}: {r['error_count']} requests failed, e.g. {r['errors'][:3]}")
        for i, run in enumerate(r["runs"]):
            if run["engine_requests"] != run["daemon_engine_requests"]:
                out.append(f"{r['mode']} run {i + 1}: engine counters {run['engine_requests']} "
                           f"differ from the daemon's {run['daemon_engine_requests']}")
        busy = [run for run in r["runs"] if run["machine_cores_busy"] > 0.85 * cores]
        if busy:
            other = max(run["machine_cores_busy"] - sum(run["cores_busy"].values())
                        for run in busy)
            out.append(f"{r['mode']}: CPU-bound in {len(busy)} of {len(r['runs'])} runs (up to "
                       f"{max(run['machine_cores_busy'] for run in busy):.2f} of {cores} cores "
                       f"busy, up to {max(0.0, other):.2f} by other processes or the kernel): "
                       "TTFT is inflated; the modelled prefill is not")
    return out


def details(results: Sequence[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        if r["status"] == "unavailable":
            continue
        kv = ""
        if r["policy"] != "round_robin" and r["kv_predicted_cached_tokens"] is not None:
            kv = (f"; router predicted {int(r['kv_predicted_cached_tokens'])} cached tokens, "
                  f"engines reported {int(r['kv_reported_cached_tokens'])}")
        lines.append(f"- {r['mode']}: TTFT p50 {r['ttft_p50_ms']:.1f} / p99 "
                     f"{r['ttft_p99_ms']:.1f} ms, latency mean {r['latency_mean_ms']:.1f} ms; "
                     f"turns 2+ reusing their conversation's cached history: "
                     f"{fmt_pct(r['later_turns_reusing_history'])}{kv}")
        for run in r["runs"]:
            c = run["cores_busy"]
            other = max(0.0, run["machine_cores_busy"] - sum(c.values()))
            index = ("" if run["kv_index_blocks"] is None
                     else f", KV index {int(run['kv_index_blocks'])} blocks")
            lines.append(
                f"  - per engine {run['engine_requests']}, TTFT mean {run['ttft_mean_ms']:.1f} "
                f"ms, hit {fmt_pct(run['hit_rate'])}, {run['evictions']} evictions, cache "
                f"{run['engine_cache_blocks']} blocks at end{index}; {run['wall_s']:.1f} s, "
                f"cores busy {run['machine_cores_busy']:.2f} (daemon {c['daemon']:.2f}, "
                f"engines {c['engines']:.2f}, client {c['client']:.2f}, other {other:.2f})"
            )
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------


def parse_knobs(parser: argparse.ArgumentParser, knobs: Sequence[str]) -> dict[str, str]:
    """The ``--knob NAME=VALUE`` options, by name (a malformed one is the parser's error)."""
    parsed: dict[str, str] = {}
    for knob in knobs:
        name, eq, value = knob.partition("=")
        if not eq or not re.fullmatch(r"[a-z_]+", name.strip()):
            parser.error(f"--knob {knob!r} is not NAME=VALUE")
        parsed[name.strip()] = value.strip()
    return parsed


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--repeat", type=int, default=2,
                   help="runs per mode (interleaved across modes, figures pooled)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--kind", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--skew", type=float, default=0.5,
                   help="Zipf exponent of system-prompt popularity (0: uniform)")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=lambda s: tuple(int(x) for x in s.split("-")),
                   default=(20, 60), help="user message length range, e.g. 20-60")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--answer-jitter", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prefill-us", type=float, default=DEFAULT_PREFILL_US,
                   help="per uncached prompt token")
    p.add_argument("--decode-us", type=float, default=DEFAULT_DECODE_US,
                   help="per generated token")
    p.add_argument("--max-running", type=int, default=8, help="per engine; more wait in a queue")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-factor", type=float, default=1.5,
                   help="engine cache = factor × working set / engines")
    p.add_argument("--capacity-blocks", type=int, default=None, help="overrides the factor")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="a [frontend.routing.knobs] entry for the kv_aware modes (repeatable)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--daemon-cmd", default=None,
                   help="command standing for `direct-frontend` (shell-quoted), to A/B a daemon")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}; choose from {MODES}")
    if len(args.user_tokens) != 2 or args.user_tokens[0] > args.user_tokens[1]:
        p.error("--user-tokens is LO-HI")
    args.knobs = parse_knobs(p, args.knob)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


async def bench(args: argparse.Namespace, workload: Workload, capacity: int,
                tmp: pathlib.Path, children: list[Child]) -> list[dict[str, Any]]:
    """Every mode ``--repeat`` times, interleaved so machine noise hits every mode alike."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    for i in range(args.repeat):
        for mode in args.modes:
            if runs[mode] and runs[mode][-1]["status"] == "unavailable":
                continue  # it will not start the next time either
            r = await run_mode(mode, args, workload, capacity, tmp / f"{i + 1}", children)
            runs[mode].append(r)
            tag = f"{mode} (run {i + 1}/{args.repeat})"
            if r["status"] == "unavailable":
                print(f"{tag}: unavailable: {r['reason']}", flush=True)
            else:
                print(f"{tag}: TTFT mean {statistics.fmean(r['ttft_ms'] or [math.nan]):.1f} ms, "
                      f"hit rate {fmt_pct(r['cached_tokens'] / max(1, r['prompt_tokens']))}, "
                      f"per engine {r['engine_requests']} ({r['wall_s']:.1f} s)"
                      + (" [KV events not consumed]" if r["status"] != "ok" else ""),
                      flush=True)
    return [aggregate(mode, runs[mode]) for mode in args.modes]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # same clean-up path as Ctrl-C
    workload = build_workload(args)
    capacity = args.capacity_blocks or math.ceil(
        args.capacity_factor * workload.working_set_blocks / args.engines)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-routing-"))
    for i in range(args.repeat):
        (tmp / f"{i + 1}").mkdir()
    children: list[Child] = []
    print(f"bench_routing: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; engines, "
          f"daemon and client share them.\n{code_under_test()}\nLogs: {tmp}\n", flush=True)
    ok = False
    try:
        results = asyncio.run(bench(args, workload, capacity, tmp, children))
        ok = True
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for child in reversed(children):
            child.stop()
        if not ok:
            for child in children[-args.engines - 1:]:
                with contextlib.suppress(OSError):
                    print(f"--- {child.name} log tail ---\n{child.log_tail()}", file=sys.stderr)
    problems = notes(results)
    bad = any(r["status"] != "ok" for r in results)
    failed = any(r["error_count"] for r in results if r["status"] != "unavailable") or any(
        "MISMATCH" in p for p in problems)
    if not (bad or failed or args.keep_logs):
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + table(results) + "\n")
    print(parameters(args, workload, capacity) + "\n")
    print(details(results))
    if problems:
        print("\n" + "\n".join(f"! {p}" for p in problems))
    if bad or failed:
        print(f"\nLogs kept in {tmp}")
    if args.json:
        print(json.dumps({"parameters": vars(args), "capacity_blocks": capacity,
                          "working_set_blocks": workload.working_set_blocks,
                          "results": results}, separators=(",", ":")))
    return 1 if failed else 2 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine_main(sys.argv[2:])
    elif "--multi-model" in sys.argv:  # several models, one daemon: per-model figures
        from bench_models import main as multi_model
        sys.exit(multi_model([a for a in sys.argv[1:] if a != "--multi-model"]))
    elif len(sys.argv) > 1 and sys.argv[1] == "live":
        from routing_live import main as live_main  # a sibling script, on sys.path above
        sys.exit(live_main(sys.argv[2:]))
    elif len(sys.argv) > 1 and sys.argv[1] == "grid":
        from routing_sim import main as grid_main  # a sibling script, on sys.path above
        sys.exit(grid_main(sys.argv[2:]))
    else:
        sys.exit(main())
