#!/usr/bin/env python3
"""Measure the latency and CPU the frontend adds over calling an engine directly.

One simulated SGLang engine runs with zero engine time (no prefill or decode
delay, never EOS), so whatever separates the two paths below is our cost:

* **direct**: a pure-asyncio grpclib client in this process streams
  ``SglangScheduler/Generate`` from the engine;
* **frontend**: the same prompt (token ids) and ``max_tokens`` as an OpenAI
  ``/v1/completions`` stream through ``direct-frontend run`` (HTTP/1.1, SSE),
  read by a lean raw-socket client so that the client costs little next to
  the server.

For each concurrency level it prints TTFT and total latency (p50/p99) of both
paths, the added latency, throughput, and the daemon's CPU per request and per
streamed token (utime+stime from ``/proc/<pid>/stat``), next to the targets.
It also times the daemon's start-up (process start → ``GET /ready`` 200) on a
copy of the demo fleet with free ports. ``--profile FILE`` samples the daemon
with py-spy during the frontend phase of the highest level and summarises the
hot spots in ``direct_frontend``.

Daemon, engine and client share the machine, so the "cores busy" row shows
each one's share and "other" (everything else running): with a busy
neighbour the latencies are not comparable between runs; the daemon's CPU per
request is the steadier figure. Under load the direct path is bounded by the
engine and this client, not by any frontend.

Usage::

    python scripts/bench_overhead.py                      # ~20 s on 2 cores
    python scripts/bench_overhead.py --concurrency 32 --profile /tmp/df.txt
    python scripts/bench_overhead.py --json               # also one JSON line at the end
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpclib.client import Channel, UnaryStreamMethod
from tokenizers import Tokenizer

from protos import sglang_scheduler_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "config" / "demo-model"
DEMO_FLEET = ROOT / "config" / "fleet.toml"
GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
MODEL = "demo"  # the simulator's and the bench fleet's served model name
PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun today"
)
PROMPT_TOKENS = 16
HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Targets (figures to print beside the measurements, not assertions).
TARGET_ADDED_TTFT_P50_MS = 2.0  # at c=1
TARGET_ADDED_TOTAL_P50_MS = 3.0  # at c=1, 64-token stream
TARGET_CPU_PER_TOKEN_US = 50.0  # under load
TARGET_CPU_PER_REQUEST_MS = 1.5  # under load


# -- child processes ------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports; all held open while choosing so none repeats."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket())
            sock.bind((HOST, 0))
            ports.append(sock.getsockname()[1])
        return ports


def _die_with_parent() -> None:
    """Children get SIGTERM if this process dies hard (SIGKILL), so none is left behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def cli_argv() -> list[str]:
    """The ``direct-frontend`` entry point of this venv (falls back to PATH)."""
    beside = pathlib.Path(sys.executable).parent / "direct-frontend"
    found = str(beside) if beside.exists() else shutil.which("direct-frontend")
    if found is None:
        raise SystemExit("direct-frontend is not installed (pip install -e .)")
    return [found]


class Child:
    """A process we started: its own session (Ctrl-C reaches only us), stopped by its pid."""

    def __init__(self, name: str, argv: Sequence[str], log_path: pathlib.Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.started = time.perf_counter()
        self.popen = subprocess.Popen(
            list(argv), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def check_alive(self) -> None:
        """Fail fast, with the log tail, instead of waiting out a timeout."""
        code = self.popen.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def cpu_seconds(self) -> float:
        """utime+stime of the process (all its threads), from /proc."""
        return proc_cpu_seconds(self.pid)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (graceful), then SIGKILL; idempotent."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def proc_cpu_seconds(pid: int) -> float:
    """utime+stime (fields 14, 15) in seconds; the comm field may contain spaces."""
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine was not idle (all cores; steal counts as busy)."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already included in user/nice
    return (sum(fields) - idle - guest) / CLK_TCK


async def wait_for_port(child: Child, port: int, limit_s: float = 30.0) -> None:
    """Connect until the engine accepts (polling, bounded), failing early if it died."""
    deadline = time.monotonic() + limit_s
    while True:
        child.check_alive()
        try:
            _, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} did not listen on {port}") from None
            await asyncio.sleep(0.005)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


async def http_status(port: int, path: str) -> int:
    """Status of one ``GET`` on a fresh connection; 0 if nothing listens yet."""
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError:
        return 0
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        line = await reader.readline()
        return int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def wait_ready(child: Child, port: int, limit_s: float = 60.0) -> float:
    """Poll ``/ready`` until 200; returns seconds since the process was started."""
    deadline = time.monotonic() + limit_s
    while True:
        child.check_alive()
        if await http_status(port, "/ready") == 200:
            return time.perf_counter() - child.started
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} not ready after {limit_s:.0f}s:\n{child.log_tail()}")
        await asyncio.sleep(0.005)


def bench_fleet(listen_port: int, engine_port: int, otlp_endpoint: str | None = None) -> str:
    """One real (non-simulated) SGLang engine behind the frontend (tracing to a collector)."""
    tracing = "" if otlp_endpoint is None else (
        f"\n[frontend.tracing]\notlp_endpoint = {json.dumps(otlp_endpoint)}\n"
    )
    return (
        "[frontend]\n"
        f'listen = "{HOST}:{listen_port}"\n'
        f'served_model_name = "{MODEL}"\n'
        f"tokenizer = {json.dumps(str(MODEL_DIR))}\n"
        "\n[[engine]]\n"
        'name = "bench-engine"\n'
        f'url = "grpc://{HOST}:{engine_port}"\n'
        'kind = "sglang"\n'
        f"{tracing}"
    )


def demo_fleet_copy(listen_port: int, engine_ports: Sequence[int]) -> str:
    """config/fleet.toml with free ports and an absolute tokenizer path; checked by re-parsing."""
    text = DEMO_FLEET.read_text()
    parsed = tomllib.loads(text)
    engines = parsed.get("engine", [])
    if len(engines) > len(engine_ports):
        raise ValueError("more engines in the demo fleet than ports")
    text = text.replace(f'"{parsed["frontend"]["listen"]}"', f'"{HOST}:{listen_port}"', 1)
    for engine, port in zip(engines, engine_ports, strict=False):
        text = text.replace(f'"{engine["url"]}"', f'"grpc://{HOST}:{port}"', 1)
    tokenizer = (DEMO_FLEET.parent / parsed["frontend"]["tokenizer"]).resolve()
    text = re.sub(
        r'^(\s*tokenizer\s*=\s*)"[^"]*"', lambda m: m.group(1) + json.dumps(str(tokenizer)),
        text, count=1, flags=re.M,
    )
    check = tomllib.loads(text)
    assert check["frontend"]["listen"] == f"{HOST}:{listen_port}", "listen not rewritten"
    assert check["frontend"]["tokenizer"] == str(tokenizer), "tokenizer not rewritten"
    assert [e["url"] for e in check.get("engine", [])] == [
        f"grpc://{HOST}:{p}" for p in engine_ports[: len(engines)]
    ], "engine urls not rewritten"
    return text


# -- measurement --------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Sample:
    ttft: float  # seconds to the first token (direct) / first text chunk (frontend)
    total: float  # seconds to the end of the stream
    chunks: int  # gRPC chunks (direct) or SSE text events (frontend)


class BenchError(Exception):
    """A response that is not what a correct server sends; aborts the run."""


def make_request(ids: Sequence[int], tokens: int, request_id: str) -> pb.GenerateRequest:
    """The request our SGLang dialect sends for the same completion (greedy, no stops)."""
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(original_text="", input_ids=ids),
        sampling_params=pb.SamplingParams(
            temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
            max_new_tokens=tokens, skip_special_tokens=True,
        ),
        stream=True,
    )


class DirectClient:
    """Streams Generate straight from the engine over one shared channel (as the frontend does)."""

    def __init__(self, port: int, ids: Sequence[int], tokens: int) -> None:
        self.channel = Channel(HOST, port)
        self.method: UnaryStreamMethod[pb.GenerateRequest, pb.GenerateResponse] = (
            UnaryStreamMethod(self.channel, GENERATE, pb.GenerateRequest, pb.GenerateResponse)
        )
        self.ids = list(ids)
        self.tokens = tokens
        self._ids = itertools.count()

    def close(self) -> None:
        self.channel.close()

    async def one(self) -> Sample:
        request = make_request(self.ids, self.tokens, f"bench-{os.getpid()}-{next(self._ids)}")
        ttft = 0.0
        got = chunks = 0
        complete = False
        start = time.perf_counter()
        async with self.method.open() as stream:
            await stream.send_message(request, end=True)
            async for reply in stream:
                if reply.WhichOneof("response") == "chunk":
                    if not chunks:
                        ttft = time.perf_counter() - start
                    chunks += 1
                    got += len(reply.chunk.token_ids)
                else:
                    complete = True
        total = time.perf_counter() - start
        if got != self.tokens or not complete:
            raise BenchError(f"direct: {got} tokens, complete={complete}; wanted {self.tokens}")
        return Sample(ttft, total, chunks)


class HttpConnection:
    """One keep-alive HTTP/1.1 connection with a minimal chunked + SSE reader.

    Parses only what is needed to time the stream and check it: the first
    text event, the usage event and ``[DONE]``.
    """

    def __init__(self, port: int, request: bytes, tokens: int) -> None:
        self.port = port
        self.request = request
        self.tokens = tokens
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            self.reader = self.writer = None

    async def one(self) -> Sample:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        reader, writer = self.reader, self.writer
        assert reader is not None
        start = time.perf_counter()
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        lower = head.lower()
        if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in lower:
            raise BenchError(f"frontend: unexpected response head {head!r}")
        ttft = 0.0
        chunks = 0
        done = False
        usage: dict[str, Any] | None = None
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # the empty trailer section
                break
            data = await reader.readexactly(size + 2)
            now = time.perf_counter()
            events = (pending + data[:-2]).split(b"\n\n")
            pending = events.pop()
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    done = True
                elif b'"usage":{' in payload:
                    usage = json.loads(payload)["usage"]
                elif payload.startswith(b'{"error"'):
                    raise BenchError(f"frontend: error event {payload!r}")
                elif b'"text":""' not in payload:
                    if not chunks:
                        ttft = now - start
                    chunks += 1
        total = time.perf_counter() - start
        if b"connection: close" in lower:
            await self.close()
        completion = usage.get("completion_tokens") if usage else None
        if not done or completion != self.tokens or not chunks:
            raise BenchError(
                f"frontend: done={done} completion_tokens={completion} text events={chunks}; "
                f"wanted [DONE] and {self.tokens}"
            )
        return Sample(ttft, total, chunks)


def completion_request(port: int, ids: Sequence[int], tokens: int) -> bytes:
    """The whole HTTP request, built once: the client's per-request cost stays a write."""
    body = json.dumps({
        "model": MODEL, "prompt": list(ids), "max_tokens": tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }, separators=(",", ":")).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclasses.dataclass(slots=True)
class Phase:
    """One measured run of one path: samples plus the CPU every process spent on it."""

    samples: list[Sample]
    wall: float
    client_cpu: float
    engine_cpu: float
    daemon_cpu: float
    machine_cpu: float


async def run_phase(
    workers: Sequence[Callable[[], Awaitable[Sample]]], n: int, engine: Child, daemon: Child
) -> Phase:
    """``n`` requests spread over the workers (one in flight each), with CPU read around it."""
    remaining = itertools.count()
    samples: list[Sample] = []

    async def loop(one: Callable[[], Awaitable[Sample]]) -> None:
        while next(remaining) < n:
            samples.append(await one())

    cpu = (time.process_time(), engine.cpu_seconds(), daemon.cpu_seconds(), machine_busy_seconds())
    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for one in workers:
            group.create_task(loop(one))
    wall = time.perf_counter() - start
    return Phase(
        samples, wall, time.process_time() - cpu[0], engine.cpu_seconds() - cpu[1],
        daemon.cpu_seconds() - cpu[2], machine_busy_seconds() - cpu[3],
    )


def pct(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation between ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(phase: Phase, tokens: int) -> dict[str, float]:
    """Milliseconds, req/s and per-request/per-token CPU of one phase."""
    ttft = [s.ttft * 1e3 for s in phase.samples]
    total = [s.total * 1e3 for s in phase.samples]
    n = len(phase.samples)
    return {
        "requests": n,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "total_p50_ms": pct(total, 50), "total_p99_ms": pct(total, 99),
        "req_per_s": n / phase.wall,
        "wall_s": phase.wall,
        "chunks_per_request": sum(s.chunks for s in phase.samples) / n,
        "daemon_cpu_ms_per_request": phase.daemon_cpu * 1e3 / n,
        "daemon_cpu_us_per_token": phase.daemon_cpu * 1e6 / (n * tokens),
        "daemon_cores": phase.daemon_cpu / phase.wall,
        "engine_cpu_ms_per_request": phase.engine_cpu * 1e3 / n,
        "engine_cores": phase.engine_cpu / phase.wall,
        "client_cpu_ms_per_request": phase.client_cpu * 1e3 / n,
        "client_cores": phase.client_cpu / phase.wall,
        # Everything else on the machine: a busy neighbour skews every figure above.
        "other_cores": max(0.0, phase.machine_cpu - phase.daemon_cpu - phase.engine_cpu
                           - phase.client_cpu) / phase.wall,
    }


class Profiler:
    """py-spy attached to the daemon for one phase; stopped with SIGINT so it writes its file."""

    def __init__(self, pid: int, out: pathlib.Path, rate: int) -> None:
        exe = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
        self.out = out
        self.popen = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
             "--nonblocking", "--output", str(out)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_die_with_parent,
        )

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        try:
            _, err = self.popen.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            _, err = self.popen.communicate()
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')}")


# -- profile summary ------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# Frames of ours that every sample sits on (the CLI and trio.run): not a hot spot.
_ENTRY = ("direct_frontend/cli.py", "direct_frontend/daemon.py")

Frame = tuple[str, str, str]  # function, file, line


def _short(file: str) -> str:
    """Path from the package down: ``trio/_socket.py``, ``direct_frontend/http/app.py``."""
    for marker in ("site-packages/", "/lib/python3"):
        i = file.find(marker)
        if i >= 0:
            rest = file[i + len(marker):]
            return rest if marker == "site-packages/" else rest.split("/", 1)[-1]
    i = file.find("direct_frontend/")
    return file[i:] if i >= 0 else file


def _package(file: str) -> str:
    short = _short(file)
    return short.split("/", 1)[0] if "/" in short else short.removesuffix(".py")


def _ours(file: str) -> bool:
    return "direct_frontend/" in file and not file.endswith(_ENTRY)


def _task_root(frames: Sequence[Frame]) -> str:
    """What a sample with no frame of ours was doing: the Trio task (or asyncio callback) on top
    of the run loop."""
    root = f"{frames[0][0]} ({_short(frames[0][1])})"  # a coroutine resumed from C: partial stack
    for i, (func, file, _) in enumerate(frames[:-1]):
        if func in ("unrolled_run", "Handle._run") or (func == "run" and "trio/" in file):
            nxt = frames[i + 1]
            root = f"{nxt[0]} ({_short(nxt[1])})"
    return root


def summarize_profile(path: pathlib.Path, top: int = 12) -> dict[str, Any]:
    """Where the daemon's samples went, seen from our code (py-spy ``--format raw``).

    * ``by_package``: self time by the package of the innermost frame;
    * ``ours_plus_callees``: each sample charged to the innermost ``direct_frontend``
      frame (entry points excluded), so library work our code asks for counts
      against the line asking;
    * ``ours_inclusive``: every stack a function of ours is on;
    * ``not_ours``: samples with no frame of ours, by the task or callback running.

    Percentages are of all (non-idle) samples, i.e. of the daemon's CPU time.
    """
    total = 0
    by_package: collections.Counter[str] = collections.Counter()
    deepest: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    not_ours: collections.Counter[str] = collections.Counter()
    for raw in path.read_text().splitlines():
        stack, _, count_text = raw.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames: list[Frame] = []
        for part in stack.split(";"):
            m = _FRAME.match(part.strip())
            if m:
                frames.append((m["func"], m["file"], m["line"] or ""))
        if not frames:
            continue
        count = int(count_text)
        total += count
        by_package[_package(frames[-1][1])] += count
        ours = [f for f in frames if _ours(f[1])]
        if ours:
            func, file, line = ours[-1]
            deepest[f"{func} ({_short(file)}:{line})"] += count
            for key in {f"{func} ({_short(file)})" for func, file, _ in ours}:
                inclusive[key] += count
        else:
            not_ours[_task_root(frames)] += count

    def table(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(k, 100 * v / total) for k, v in counter.most_common(top)] if total else []

    return {
        "samples": total,
        "by_package": table(by_package),
        "ours_plus_callees": table(deepest),
        "ours_inclusive": table(inclusive),
        "not_ours": table(not_ours),
    }


# -- report -------------------------------------------------------------------------------


def report_level(level: dict[str, Any]) -> str:
    """The per-level table; targets beside the figures they concern (latency at c=1, CPU under
    load)."""
    c, d, f = level["concurrency"], level["direct"], level["frontend"]
    under_load = c > 1
    lines = [
        f"concurrency {c}: {f['requests']} requests × {level['tokens']} tokens per path, "
        f"warm-up {level['warmup']}"
        + ("   [daemon profiled by py-spy]" if level["profiled"] else ""),
        f"  {'':34}{'direct':>10}{'frontend':>10}{'added':>10}   target",
    ]

    def row(name: str, key: str, fmt: str, added: bool, target: str = "") -> None:
        dv, fv = d[key], f[key]
        add = f"{fv - dv:+{fmt}}" if added else ""
        lines.append(f"  {name:34}{dv:>10{fmt}}{fv:>10{fmt}}{add:>10}   {target}".rstrip())

    row("TTFT p50 (ms)", "ttft_p50_ms", ".3f", True,
        "" if under_load else f"added <= {TARGET_ADDED_TTFT_P50_MS:g} ms")
    row("TTFT p99 (ms)", "ttft_p99_ms", ".3f", True)
    row("total p50 (ms)", "total_p50_ms", ".3f", True,
        "" if under_load else f"added <= {TARGET_ADDED_TOTAL_P50_MS:g} ms")
    row("total p99 (ms)", "total_p99_ms", ".3f", True)
    row("throughput (req/s)", "req_per_s", ".1f", False)
    lines.append(
        f"  {'frontend CPU per request (ms)':34}{'':>10}{f['daemon_cpu_ms_per_request']:>10.3f}"
        f"{'':>10}   " + (f"<= {TARGET_CPU_PER_REQUEST_MS:g} ms (under load)" if under_load else "")
    )
    lines.append(
        f"  {'frontend CPU per token (µs)':34}{'':>10}{f['daemon_cpu_us_per_token']:>10.1f}"
        f"{'':>10}   " + (f"<= {TARGET_CPU_PER_TOKEN_US:g} µs (under load)" if under_load else "")
    )
    lines.append(
        f"  {'chunks per request':34}{d['chunks_per_request']:>10.1f}"
        f"{f['chunks_per_request']:>10.1f}   (gRPC chunks / SSE text events)"
    )
    lines.append(
        f"  {'cores busy: daemon/engine/client/other':40}"
        + "   ".join(
            f"{name} {p['daemon_cores']:.2f}/{p['engine_cores']:.2f}/{p['client_cores']:.2f}/"
            f"{p['other_cores']:.2f}"
            for name, p in (("direct", d), ("frontend", f))
        )
    )
    return "\n".join(line.rstrip() for line in lines)


def report_profile(summary: dict[str, Any]) -> str:
    out = [f"py-spy profile of the daemon: {summary['samples']} samples (non-idle)"]
    for title, key in (
        ("self time by package", "by_package"),
        ("innermost direct_frontend frame (its own work + the libraries it calls)",
         "ours_plus_callees"),
        ("inclusive, direct_frontend functions", "ours_inclusive"),
        ("no direct_frontend frame on the stack, by running task/callback", "not_ours"),
    ):
        out.append(f"  {title}:")
        out.extend(f"    {share:5.1f}%  {name}" for name, share in summary[key])
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=None,
                   help="measured requests per level and path (default 200 at c=1, else 400)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up requests per level and path (default max(20, 2×c))")
    p.add_argument("--tokens", type=int, default=64, help="max_tokens / max_new_tokens")
    p.add_argument("--startup-runs", type=int, default=3,
                   help="daemon start-ups to time on the demo fleet (0: skip)")
    p.add_argument("--profile", type=pathlib.Path, default=None,
                   help="py-spy raw output file: profile the daemon during the frontend phase "
                        "of the highest level (its CPU figures then include py-spy's reads)")
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--daemon-cmd", default=None,
                   help="command that stands for `direct-frontend` when starting the daemon under "
                        "test (shell-quoted), e.g. to A/B a patched daemon")
    p.add_argument("--otlp-endpoint", default=None,
                   help="trace every request to this OTLP/HTTP collector ([frontend.tracing])")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    return p.parse_args(argv)


def code_under_test() -> str:
    """Which direct_frontend the daemon will import and which commit it is, for the record."""
    import importlib.util

    spec = importlib.util.find_spec("direct_frontend")
    where = pathlib.Path(spec.origin).parent.parent if spec and spec.origin else "?"
    try:
        rev = subprocess.run(
            ["git", "-C", str(where), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"direct_frontend from {where} ({rev or 'not a git checkout'})"


def prompt_ids() -> list[int]:
    """~16 real tokens of the demo tokenizer, so the daemon's range check sees real ids."""
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tok.encode(PROMPT_TEXT, add_special_tokens=False).ids[:PROMPT_TOKENS]
    if len(ids) < PROMPT_TOKENS:
        raise SystemExit("the demo tokenizer gave too few tokens for the prompt")
    return ids


async def time_startups(runs: int, tmp: pathlib.Path, children: list[Child]) -> list[float]:
    """Start the daemon on a free-port copy of the demo fleet ``runs`` times; seconds to ready."""
    times = []
    for i in range(runs):
        listen, *engines = free_ports(3)
        fleet = tmp / f"demo-fleet-{i}.toml"
        fleet.write_text(demo_fleet_copy(listen, engines))
        child = Child(f"demo daemon #{i}", [*cli_argv(), "run", str(fleet)], tmp / f"demo-{i}.log")
        children.append(child)
        try:
            times.append(await wait_ready(child, listen))
        finally:
            child.stop()
    return times


async def bench(
    args: argparse.Namespace, tmp: pathlib.Path, children: list[Child]
) -> dict[str, Any]:
    """Start the engine and the daemon, then measure every level on both paths."""
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    ids = prompt_ids()
    tokens = args.tokens
    results: dict[str, Any] = {
        "tokens": tokens, "prompt_tokens": len(ids), "cpus": os.cpu_count(),
        "python": sys.version.split()[0], "levels": [],
    }

    startups = await time_startups(args.startup_runs, tmp, children)
    results["startup_demo_fleet_s"] = startups

    engine_port, listen_port = free_ports(2)
    engine = Child("engine", [
        *cli_argv(), "simulate-engine", "--kind", "sglang", "--host", HOST,
        "--port", str(engine_port), "--model-dir", str(MODEL_DIR),
        "--served-model-name", MODEL, "--prefill-us-per-token", "0",
        "--decode-us-per-token", "0", "--eos-probability", "0",
        "--max-running", str(max(64, max(levels))),
    ], tmp / "engine.log")
    children.append(engine)
    await wait_for_port(engine, engine_port)

    fleet = tmp / "bench-fleet.toml"
    fleet.write_text(bench_fleet(listen_port, engine_port, args.otlp_endpoint))
    daemon_cmd = shlex.split(args.daemon_cmd) if args.daemon_cmd else cli_argv()
    daemon = Child("daemon", [*daemon_cmd, "run", str(fleet), "--log-level", "WARNING"],
                   tmp / "daemon.log")
    children.append(daemon)
    results["startup_bench_fleet_s"] = await wait_ready(daemon, listen_port)

    direct = DirectClient(engine_port, ids, tokens)
    request = completion_request(listen_port, ids, tokens)
    try:
        for c in levels:
            n = args.requests or (200 if c == 1 else 400)
            warm = args.warmup if args.warmup is not None else max(20, 2 * c)
            profiled = args.profile is not None and c == max(levels)

            direct_workers = [direct.one] * c
            if warm:
                await run_phase(direct_workers, warm, engine, daemon)
            d = await run_phase(direct_workers, n, engine, daemon)

            conns = [HttpConnection(listen_port, request, tokens) for _ in range(c)]
            try:
                workers = [conn.one for conn in conns]
                if warm:
                    await run_phase(workers, warm, engine, daemon)
                profiler = (
                    Profiler(daemon.pid, args.profile, args.profile_rate) if profiled else None
                )
                try:
                    f = await run_phase(workers, n, engine, daemon)
                finally:
                    if profiler is not None:
                        profiler.stop()
            finally:
                for conn in conns:
                    await conn.close()

            level = {
                "concurrency": c, "tokens": tokens, "warmup": warm, "profiled": profiled,
                "direct": summarize(d, tokens), "frontend": summarize(f, tokens),
            }
            level["added_ttft_p50_ms"] = (
                level["frontend"]["ttft_p50_ms"] - level["direct"]["ttft_p50_ms"]
            )
            level["added_total_p50_ms"] = (
                level["frontend"]["total_p50_ms"] - level["direct"]["total_p50_ms"]
            )
            results["levels"].append(level)
            print(report_level(level) + "\n", flush=True)
    finally:
        direct.close()
    daemon.check_alive()
    if args.profile is not None:
        results["profile"] = summarize_profile(args.profile)
    return results


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.profile is not None and shutil.which("py-spy") is None and not (
        pathlib.Path(sys.executable).parent / "py-spy"
    ).exists():
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    # SIGTERM takes the same clean-up path as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    children: list[Child] = []
    print(f"bench_overhead: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; daemon, "
          f"engine and this client share them.\n{code_under_test()}\n"
          f"Logs: {tmp} (kept on failure or with --keep-logs)\n", flush=True)
    ok = False
    try:
        results = asyncio.run(bench(args, tmp, children))
        ok = True
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        for child in reversed(children):
            child.stop()
        if not ok:
            for child in children:
                with contextlib.suppress(OSError):
                    print(f"--- {child.name} log tail ---\n{child.log_tail()}", file=sys.stderr)
        if ok and not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)

    startups = results["startup_demo_fleet_s"]
    print("daemon start-up, process start → GET /ready 200:")
    if startups:
        print(f"  demo fleet copy (2 embedded simulators), {len(startups)} runs: "
              + ", ".join(f"{s:.3f} s" for s in startups)
              + f" (median {sorted(startups)[len(startups) // 2]:.3f} s)")
    print(f"  bench fleet (1 external engine): {results['startup_bench_fleet_s']:.3f} s")
    print("\ntargets: at c=1 added TTFT p50 <= 2 ms and added total p50 <= 3 ms "
          f"({results['tokens']}-token stream); under load frontend CPU <= 50 µs/token and "
          "<= 1.5 ms/request")
    if "profile" in results:
        print()
        print(report_profile(results["profile"]))
    if args.json:
        print(json.dumps(results, separators=(",", ":")))


if __name__ == "__main__":
    main()
