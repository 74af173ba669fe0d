"""The long-prompt mode of ``bench_overhead.py`` (``--long``): agent-sized prompts.

Workloads (``--long unique,agent,huge``), each run against every side in the
same run, in alternating order: the candidate daemon, the ``--baseline REV``
daemon, and with ``--smg PATH`` an SMG router (``smg launch``) in front of the
same simulated engines (zero engine time unless ``--long-decode-us``; the
simulator serves SGLang's gRPC contract, which SMG speaks):

- ``unique``: unique chat prompts of about ``--long-tokens`` tokens (one user
  message of fresh words), each streamed ``--long-stream`` tokens, at
  concurrency ``--long-concurrency``;
- ``agent``: ``--agent-conversations`` conversations of ``--agent-turns``
  turns, run in lockstep (turn t of every conversation at once), each turn
  adding an assistant tool call and a tool result of about
  ``--agent-result-tokens`` tokens (``--agent-one-at-a-time``: a turn's requests
  sent one after another); CPU per turn (the process CPU clock: exact to the
  nanosecond, where the 10 ms ticks would round a turn away), and the last ten
  turns' against the first ten's;
- ``huge``: ``--huge-count`` concurrent chat prompts of ``--huge-bytes``
  bytes, against the engines' ``--long-context`` tokens, then against a
  TensorRT-LLM engine (which reports no context length; SMG does not speak
  its contract); a first burst warms the server up, the second is measured
  (RSS before it, at its peak and a second after it: what a burst leaves).

``--long-policy`` sets the daemons' routing policy (SMG's follows it),
``--long-kv-events`` has the SGLang engines publish KV events the daemons
subscribe to (``kv_aware`` then routes by the exact index), and
``--daemon-cmd`` (e.g. a profiling wrapper) starts the candidate daemon.

Each phase reports the server's CPU per request (utime+stime of its process,
all threads, less what the ``/health`` probes cost it: measured per probe when
the server starts), TTFT p50/p99, the event loop's worst stall (``GET /health``
probed every ``--probe-ms`` on a connection of its own throughout the phase),
and RSS (the peak during the phase, and a second after it ends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import shlex
import time
from collections.abc import Sequence
from typing import Any

import bench_overhead as bo
from tokenizers import Tokenizer

from direct_frontend.text.demo_model import corpus

HOST = bo.HOST
MODEL = bo.MODEL


# -- prompts ------------------------------------------------------------------------------


def _words() -> list[str]:
    words = sorted({w for line in corpus() for w in line.split() if w.isascii()})
    return words


class Prose:
    """Fresh English-like text from the demo corpus' words (seeded), sized in tokens."""

    def __init__(self, seed: int = 31) -> None:
        self.rng = random.Random(seed)
        self.words = _words()
        tokenizer = Tokenizer.from_file(str(bo.MODEL_DIR / "tokenizer.json"))
        sample = self.text(20_000)
        self.chars_per_token = len(sample) / len(
            tokenizer.encode(sample, add_special_tokens=False).ids)

    def text(self, chars: int) -> str:
        """About ``chars`` characters of words, sentences and the odd paragraph break."""
        rng, words = self.rng, self.words
        out: list[str] = []
        size = 0
        while size < chars:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))
            sentence += rng.choice((". ", ". ", "? ", ".\n\n"))
            out.append(sentence)
            size += len(sentence)
        return "".join(out)[:chars]

    def tokens(self, n: int) -> str:
        return self.text(int(n * self.chars_per_token))


def chat_body(messages: Sequence[dict[str, Any]], tokens: int, stream: bool = True,
              tools: bool = False) -> bytes:
    fields: dict[str, Any] = {"model": MODEL, "messages": list(messages), "max_tokens": tokens,
                              "temperature": 0, "stream": stream}
    if stream:
        fields["stream_options"] = {"include_usage": True}
    if tools:
        fields["tools"] = TOOLS
    return json.dumps(fields, separators=(",", ":")).encode()


def http_post(port: int, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


# -- watchers -----------------------------------------------------------------------------


class HealthProbe:
    """``GET /health`` every ``interval`` on one keep-alive connection: the worst answer time."""

    def __init__(self, port: int, interval: float) -> None:
        self.port = port
        self.interval = interval
        self.times: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        reader, writer = await asyncio.open_connection(HOST, self.port)
        request = f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
        try:
            while True:
                start = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                found = re.search(rb"(?i)content-length: *(\d+)", head)
                if found:
                    await reader.readexactly(int(found[1]))
                self.times.append(time.perf_counter() - start)
                await asyncio.sleep(self.interval)
        finally:
            writer.close()

    def __enter__(self) -> HealthProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    @property
    def worst_ms(self) -> float:
        return max(self.times, default=float("nan")) * 1e3


class RssWatch:
    """The peak resident size of a process, read from /proc every ``interval``."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, bo.rss_mb(self.pid))
            await asyncio.sleep(self.interval)

    def __enter__(self) -> RssWatch:
        self.peak = bo.rss_mb(self.pid)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


# -- sides --------------------------------------------------------------------------------


@dataclasses.dataclass
class Server:
    """One server under test: a daemon (candidate, baseline) or SMG."""

    name: str
    child: bo.Child
    port: int
    #: the server's CPU per ``GET /health`` (seconds), subtracted from a phase's CPU
    probe_cpu: float = 0.0


async def calibrate_probe(server: Server, probes: int = 300) -> None:
    """What one ``GET /health`` costs the server, so a phase's CPU is its requests' alone."""
    reader, writer = await asyncio.open_connection(HOST, server.port)
    request = f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    cpu = bo.proc_cpu_seconds(server.child.pid)
    try:
        for _ in range(probes):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            found = re.search(rb"(?i)content-length: *(\d+)", head)
            if found:
                await reader.readexactly(int(found[1]))
    finally:
        writer.close()
    server.probe_cpu = (bo.proc_cpu_seconds(server.child.pid) - cpu) / probes


#: an engine's gRPC port → its KV events' publisher and replay ports (engines that publish)
KvPorts = dict[int, tuple[int, int]]


def long_fleet(listen: int, engines: Sequence[tuple[str, int]], policy: str,
               context: int | None, kv: KvPorts | None = None) -> str:
    lines = ["[frontend]", f'listen = "{HOST}:{listen}"', f'served_model_name = "{MODEL}"',
             f"tokenizer = {json.dumps(str(bo.MODEL_DIR))}", "",
             "[frontend.routing]", f'policy = "{policy}"', ""]
    for i, (kind, port) in enumerate(engines):
        lines += ["[[engine]]", f'name = "engine-{i}"', f'url = "grpc://{HOST}:{port}"',
                  f'kind = "{kind}"']
        if kv and port in kv:
            events, replay = kv[port]
            lines += [f'kv_events = ["tcp://{HOST}:{events}"]',
                      f'kv_replay = ["tcp://{HOST}:{replay}"]']
        lines.append("")
    del context  # the engines report it (or not)
    return "\n".join(lines)


async def start_engines(kind: str, count: int, context: int, tmp: pathlib.Path,
                        children: list[bo.Child], tag: str, kv_events: bool = False,
                        decode_us: float = 0.0) -> tuple[list[int], KvPorts]:
    ports = bo.free_ports(count)
    kv: KvPorts = {}
    for i, port in enumerate(ports):
        extra: list[str] = []
        if kv_events:
            events, replay = bo.free_ports(2)
            kv[port] = (events, replay)
            extra = ["--kv-events-port", str(events), "--kv-replay-port", str(replay)]
        child = bo.Child(f"engine {tag}-{i}", [
            *bo.cli_argv(), "simulate-engine", "--kind", kind, "--host", HOST, "--port", str(port),
            "--model-dir", str(bo.MODEL_DIR), "--served-model-name", MODEL,
            "--prefill-us-per-token", "0", "--decode-us-per-token", str(decode_us),
            "--eos-probability", "0", "--max-running", "256", "--context-length", str(context),
            *extra,
        ], tmp / f"engine-{tag}-{i}.log")
        children.append(child)
        await bo.wait_for_port(child, port)
    return ports, kv


async def start_daemons(sides: Sequence[bo.Side], kind: str, ports: Sequence[int],
                        args: argparse.Namespace, tmp: pathlib.Path, children: list[bo.Child],
                        tag: str, kv: KvPorts | None = None) -> list[Server]:
    servers = []
    for side in sides:
        (listen,) = bo.free_ports(1)
        fleet = tmp / f"fleet-{tag}-{side.name}.toml"
        fleet.write_text(long_fleet(listen, [(kind, p) for p in ports], args.long_policy,
                                    args.long_context, kv))
        env = dict(os.environ) if side.source is None else bo.daemon_env(side.source)
        state = tmp / f"state-{tag}-{side.name}"  # a store of its own (schemas differ by rev)
        state.mkdir(parents=True, exist_ok=True)
        env["STATE_DIRECTORY"] = str(state)
        cmd = (shlex.split(args.daemon_cmd) if args.daemon_cmd and side.name == "candidate"
               else bo.cli_argv())
        child = bo.Child(f"daemon {tag} ({side.name})", [
            *cmd, "run", str(fleet), "--log-level", "WARNING"],
            tmp / f"daemon-{tag}-{side.name}.log", env)
        children.append(child)
        await bo.wait_ready(child, listen)
        servers.append(Server(side.name, child, listen))
        await calibrate_probe(servers[-1])
    return servers


async def start_smg(path: str, ports: Sequence[int], args: argparse.Namespace,
                    tmp: pathlib.Path, children: list[bo.Child]) -> Server:
    listen, metrics = bo.free_ports(2)
    policy = "cache_aware" if args.long_policy in ("kv_aware", "cache_affinity") else "round_robin"
    child = bo.Child("smg", [
        path, "launch", "--host", HOST, "--port", str(listen),
        "--worker-urls", *[f"grpc://{HOST}:{p}" for p in ports],
        "--model-path", str(bo.MODEL_DIR), "--policy", policy, "--log-level", "warn",
        "--prometheus-host", HOST, "--prometheus-port", str(metrics),
    ], tmp / "smg.log")
    children.append(child)
    deadline = time.monotonic() + 60
    while True:  # ready when a model is served (its workers joined)
        child.check_alive()
        if await bo.http_status(listen, "/v1/models") == 200 and await _smg_serves(listen):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"smg not ready:\n{child.log_tail()}")
        await asyncio.sleep(0.2)
    server = Server("smg", child, listen)
    await calibrate_probe(server)
    return server


async def _smg_serves(port: int) -> bool:
    body = chat_body([{"role": "user", "content": "hi"}], 2, stream=False)
    status, _ = await post_once(port, "/v1/chat/completions", body)
    return status == 200


# -- requests -----------------------------------------------------------------------------


async def post_once(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body); the body read by content-length
    or to the end."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(http_post(port, path, body))
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split()[1])
        found = re.search(rb"(?i)content-length: *(\d+)", head)
        data = await reader.readexactly(int(found[1])) if found else await reader.read()
        return status, data
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def streamed(conn: bo.HttpConnection, body: bytes) -> bo.Sample:
    conn.request = http_post(conn.port, "/v1/chat/completions", body)
    return await conn.one()


@dataclasses.dataclass
class Measured:
    cpu_ms: float  # per request
    ttft_p50_ms: float
    ttft_p99_ms: float
    worst_health_ms: float
    rss_peak_mb: float
    rss_after_mb: float
    requests: int
    rss_before_mb: float = 0.0
    statuses: dict[int, int] = dataclasses.field(default_factory=dict)


async def measure(server: Server, bodies: Sequence[bytes], concurrency: int, tokens: int,
                  args: argparse.Namespace, stream: bool = True) -> Measured:
    """Send ``bodies`` at ``concurrency``; CPU, TTFT, /health's worst and RSS around it."""
    queue = list(reversed(bodies))
    samples: list[bo.Sample] = []
    statuses: dict[int, int] = {}
    pid = server.child.pid

    async def worker() -> None:
        conn = bo.HttpConnection(server.port, b"", tokens)
        try:
            while queue:
                body = queue.pop()
                if stream:
                    samples.append(await streamed(conn, body))
                    statuses[200] = statuses.get(200, 0) + 1
                else:
                    start = time.perf_counter()
                    status, _ = await post_once(server.port, "/v1/chat/completions", body)
                    elapsed = time.perf_counter() - start
                    samples.append(bo.Sample(elapsed, elapsed, 0))
                    statuses[status] = statuses.get(status, 0) + 1
        finally:
            await conn.close()

    before = bo.rss_mb(pid)
    cpu = bo.proc_cpu_seconds(pid)
    with HealthProbe(server.port, args.probe_ms / 1e3) as probe, RssWatch(pid) as rss:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await asyncio.sleep(2 * args.probe_ms / 1e3)
    used = bo.proc_cpu_seconds(pid) - cpu - len(probe.times) * server.probe_cpu
    await asyncio.sleep(1.0)
    ttft = [s.ttft * 1e3 for s in samples]
    return Measured(used * 1e3 / len(bodies), bo.pct(ttft, 50), bo.pct(ttft, 99),
                    probe.worst_ms, rss.peak, bo.rss_mb(pid), len(bodies), statuses=statuses,
                    rss_before_mb=before)


# -- workloads ----------------------------------------------------------------------------


def unique_body(prose: Prose, tag: str, args: argparse.Namespace) -> bytes:
    text = f"Request {tag}: " + prose.tokens(args.long_tokens)
    return chat_body([{"role": "user", "content": text}], args.long_stream)


async def unique(servers: Sequence[Server], prose: Prose, args: argparse.Namespace,
                 rounds: int) -> dict[str, list[Measured]]:
    out: dict[str, list[Measured]] = {s.name: [] for s in servers}
    c = args.long_concurrency
    for round_no in range(rounds):
        order = servers if round_no % 2 == 0 else servers[::-1]
        for server in order:
            tag = f"{round_no}-{server.name}"
            warm = [unique_body(prose, f"{tag}-w{i}", args) for i in range(c)]
            await measure(server, warm, c, args.long_stream, args)
            bodies = [unique_body(prose, f"{tag}-{i}", args) for i in range(args.long_requests)]
            out[server.name].append(await measure(server, bodies, c, args.long_stream, args))
            print(f"  unique, round {round_no + 1}, {server.name}: "
                  f"{out[server.name][-1].cpu_ms:.2f} ms CPU / request", flush=True)
    return out


def agent_turn_messages(prose: Prose, conv: int, turns: int, result_tokens: int
                        ) -> list[list[dict[str, Any]]]:
    """The messages of each turn's request, turn 0 (the task) to ``turns - 1``."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + prose.tokens(300)},
        {"role": "user", "content": f"Task {conv}: " + prose.tokens(60)},
    ]
    out = [list(messages)]
    for turn in range(1, turns):
        call = {"id": f"call_{conv}_{turn}", "type": "function", "function": {
            "name": "read_file", "arguments": json.dumps({"path": f"src/file_{turn}.py"})}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": prose.tokens(result_tokens)})
        out.append(list(messages))
    return out


async def agent(servers: Sequence[Server], prose: Prose, args: argparse.Namespace,
                ) -> dict[str, list[float]]:
    """Per server, daemon CPU (ms) per request of each turn, conversations in lockstep."""
    k = args.agent_conversations
    out: dict[str, list[float]] = {}
    for server in servers:
        convs = [agent_turn_messages(prose, 1000 * len(out) + i, args.agent_turns,
                                     args.agent_result_tokens) for i in range(k)]
        per_turn = []
        for turn in range(args.agent_turns):
            bodies = [chat_body(conv[turn], args.long_stream) for conv in convs]
            cpu = bo.proc_cpu_seconds(server.child.pid)
            sends = (streamed(bo.HttpConnection(server.port, b"", args.long_stream), b)
                     for b in bodies)
            if args.agent_one_at_a_time:
                for send in sends:
                    await send
            else:
                await asyncio.gather(*sends)
            per_turn.append((bo.proc_cpu_seconds(server.child.pid) - cpu) * 1e3 / k)
        out[server.name] = per_turn
        first, last = per_turn[:10], per_turn[-10:]
        print(f"  agent, {server.name}: first 10 turns {sum(first) / len(first):.2f} ms, last 10 "
              f"{sum(last) / len(last):.2f} ms CPU / request", flush=True)
    return out


async def huge(servers: Sequence[Server], prose: Prose, args: argparse.Namespace,
               label: str) -> dict[str, Measured]:
    out = {}
    text = prose.text(args.huge_bytes)
    for server in servers:
        bodies = [chat_body([{"role": "user", "content": f"{server.name} {i} " + text}],
                            args.long_stream, stream=False) for i in range(args.huge_count)]
        await measure(server, bodies, args.huge_count, args.long_stream, args, stream=False)
        out[server.name] = m = await measure(server, bodies, args.huge_count, args.long_stream,
                                             args, stream=False)
        print(f"  huge ({label}), {server.name}: statuses {m.statuses}, /health worst "
              f"{m.worst_health_ms:.0f} ms, RSS before {m.rss_before_mb:.0f} MiB, peak "
              f"{m.rss_peak_mb:.0f} MiB, after {m.rss_after_mb:.0f} MiB", flush=True)
    return out


# -- the mode -----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("long prompts (--long)")
    g.add_argument("--long", default=None, metavar="MODES",
                   help="run the long-prompt workloads instead of the cells: comma-separated "
                        "unique, agent, huge")
    g.add_argument("--smg", default=None, metavar="PATH",
                   help="also measure SMG (the `smg` executable of a venv with smg installed) "
                        "in front of the same engines (unique and agent)")
    g.add_argument("--long-tokens", type=int, default=18_000)
    g.add_argument("--long-requests", type=int, default=48, help="per side and round")
    g.add_argument("--long-concurrency", type=int, default=8)
    g.add_argument("--long-stream", type=int, default=16, help="tokens streamed per request")
    g.add_argument("--long-engines", type=int, default=2)
    g.add_argument("--long-context", type=int, default=131_072)
    g.add_argument("--long-policy", default="kv_aware",
                   help="the daemons' routing policy (SMG: cache_aware for kv_aware, else "
                        "round_robin)")
    g.add_argument("--long-kv-events", action="store_true",
                   help="the SGLang engines publish KV events and the daemons subscribe (the "
                        "exact index instead of the approximate memory, with kv_aware)")
    g.add_argument("--long-decode-us", type=float, default=0.0,
                   help="the simulated engines' (SGLang and TensorRT-LLM) decode time per "
                        "token, µs (default: none). With none a "
                        "request's tokens leave the simulator as fast as its own loop sends "
                        "them, so how many reads they take grows with what else it is busy "
                        "with (parsing and hashing the other long prompts); a real engine "
                        "spaces them by its decode steps")
    g.add_argument("--agent-conversations", type=int, default=4)
    g.add_argument("--agent-turns", type=int, default=40)
    g.add_argument("--agent-result-tokens", type=int, default=500)
    g.add_argument("--agent-one-at-a-time", action="store_true",
                   help="send a turn's requests one after another, not at once: the "
                        "conversations' held state the same, no requests in flight together")
    g.add_argument("--huge-count", type=int, default=8)
    g.add_argument("--huge-bytes", type=int, default=1_600_000)
    g.add_argument("--probe-ms", type=float, default=10.0, help="GET /health every this long")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def report(results: dict[str, Any]) -> str:
    lines = [f"engines' decode time: {results.get('decode_us', 0.0):g} µs per token"]
    if "unique" in results:
        u = results["unique"]
        names = list(u)
        lines.append(f"unique prompts (~{results['tokens']} tokens, c={results['concurrency']}), "
                     f"medians of {results['rounds']} rounds:")
        lines.append(f"  {'figure':<26}" + "".join(f"{n:>12}" for n in names)
                     + "".join(f"{'/' + n:>12}" for n in names[1:]))
        for key, label in (("cpu_ms", "CPU / request (ms)"), ("ttft_p50_ms", "TTFT p50 (ms)"),
                           ("ttft_p99_ms", "TTFT p99 (ms)"),
                           ("worst_health_ms", "/health worst (ms)"),
                           ("rss_peak_mb", "RSS peak (MiB)"), ("rss_after_mb", "RSS after (MiB)")):
            values = [bo._median([getattr(m, key) for m in u[n]]) for n in names]
            row = f"  {label:<26}" + "".join(f"{v:>12.2f}" for v in values)
            row += "".join(f"{_ratio(values[0], v):>12}" for v in values[1:])
            lines.append(row)
    if "probe_cpu_us" in results:
        costs = ", ".join(f"{name} {us:.0f} µs" for name, us in results["probe_cpu_us"].items())
        lines.append(f"  (each server's CPU per GET /health, subtracted from the above: {costs})")
    if "agent" in results:
        lines.append(f"agent conversations ({results['turns']} turns): CPU / request by turn (ms)")
        for name, per_turn in results["agent"].items():
            first, last = per_turn[:10], per_turn[-10:]
            f, la = sum(first) / len(first), sum(last) / len(last)
            lines.append(f"  {name:<12} first 10 {f:7.2f}, last 10 {la:7.2f}, last/first "
                         f"{la / f:.2f}; by turn: " + " ".join(f"{x:.1f}" for x in per_turn))
    if "profile" in results:
        lines.append("[candidate] " + bo.report_profile(results["profile"]))
    for label in ("huge", "huge_no_context"):
        if label in results:
            lines.append(f"{label.replace('_', ' ')}: {results['huge_count']} concurrent "
                         f"{results['huge_bytes'] / 1e6:.1f} MB chat prompts")
            for name, m in results[label].items():
                lines.append(f"  {name:<12} statuses {m.statuses}, /health worst "
                             f"{m.worst_health_ms:.0f} ms, RSS before {m.rss_before_mb:.0f}, "
                             f"peak {m.rss_peak_mb:.0f}, after {m.rss_after_mb:.0f} MiB, "
                             f"CPU {m.cpu_ms:.0f} ms / request")
    return "\n".join(lines)


async def run(args: argparse.Namespace, sides: list[bo.Side], tmp: pathlib.Path,
              children: list[bo.Child]) -> dict[str, Any]:
    modes = {m.strip() for m in args.long.split(",") if m.strip()}
    unknown = modes - {"unique", "agent", "huge"}
    if unknown:
        raise SystemExit(f"--long: unknown mode(s) {', '.join(sorted(unknown))}")
    prose = Prose()
    results: dict[str, Any] = {"rounds": args.rounds, "tokens": args.long_tokens,
                               "concurrency": args.long_concurrency, "turns": args.agent_turns,
                               "huge_count": args.huge_count, "huge_bytes": args.huge_bytes,
                               "decode_us": args.long_decode_us}
    if modes & {"unique", "agent", "huge"}:
        ports, kv = await start_engines("sglang", args.long_engines, args.long_context, tmp,
                                        children, "sglang", args.long_kv_events,
                                        args.long_decode_us)
        servers = await start_daemons(sides, "sglang", ports, args, tmp, children, "sglang", kv)
        if args.smg and modes & {"unique", "agent"}:
            servers.append(await start_smg(args.smg, ports, args, tmp, children))
        results["probe_cpu_us"] = {s.name: s.probe_cpu * 1e6 for s in servers}
        if "unique" in modes:
            results["unique"] = await unique(servers, prose, args, args.rounds)
            if args.profile is not None:  # one more round of the candidate, sampled
                profiler = bo.Profiler(servers[0].child.pid, args.profile, args.profile_rate)
                try:
                    await unique(servers[:1], prose, args, 1)
                finally:
                    profiler.stop()
                results["profile"] = bo.summarize_profile(args.profile)
        if "agent" in modes:
            profiler = None
            if args.profile is not None and "unique" not in modes:  # the candidate's turns, sampled
                profiler = bo.Profiler(servers[0].child.pid, args.profile, args.profile_rate)
            try:
                results["agent"] = await agent(servers[:1] if profiler else servers, prose, args)
            finally:
                if profiler is not None:
                    profiler.stop()
            if profiler is not None:
                results["profile"] = bo.summarize_profile(args.profile)
        if "huge" in modes:
            results["huge"] = await huge([s for s in servers if s.name != "smg"], prose, args,
                                         f"{args.long_context}-token context")
        for server in servers:
            server.child.stop()
    if "huge" in modes:
        ports, _ = await start_engines("trtllm", 1, args.long_context, tmp, children, "trtllm",
                                       decode_us=args.long_decode_us)
        servers = await start_daemons(sides, "trtllm", ports, args, tmp, children, "trtllm")
        results["huge_no_context"] = await huge(servers, prose, args, "no context reported")
        for server in servers:
            server.child.stop()
    return results
