#!/usr/bin/env python3
"""Measure the CPU and latency the frontend adds over calling an engine directly.

One simulated SGLang engine runs with zero engine time (no prefill or decode
delay, never EOS), so whatever the daemon spends is our cost. Each *cell* is a
kind of request and a concurrency: ``s16@32`` is a 16-token
``/v1/completions`` stream (HTTP/1.1, SSE) with 32 requests in flight,
``f16@32`` the same as one JSON body; a lean raw-socket client sends them, so
the client costs little next to the server. At concurrency 1 a pure-asyncio
grpclib client also streams ``Generate`` from the engine directly, for the
added latency.

The daemon's CPU (its process CPU clock, to the nanosecond) per request is the
figure to trust on a shared machine; latencies and throughput move with other
load (the "other load" row). So the script runs every cell in ``--rounds``
rounds and reports medians, and with ``--baseline REV`` runs a second daemon
(a ``git worktree`` checkout of ``REV``, or a directory) behind the same engine
in the same run, cell by cell in alternating order, with the ratio candidate /
baseline: compare figures within one run, not between runs. From two stream
lengths at one concurrency it fits the fixed and per-token cost per request.
``--profile FILE`` then samples the candidate daemon with py-spy (the
``bench`` extra) on one cell and summarises it by library and by our code.

``--long unique,agent,huge`` runs the long-prompt workloads instead of the cells
(scripts/bench_long_prompts.py: unique prompts of N tokens, agent conversations
growing by a tool result per turn, concurrent megabyte prompts), with
``--smg PATH`` an SMG router in front of the same engines as a third column.

Usage::

    python scripts/bench_overhead.py                          # ~1-2 min on 2 cores
    python scripts/bench_overhead.py --baseline main --rounds 3
    python scripts/bench_overhead.py --rounds 1 --profile /tmp/df.txt --profile-cell s64@32
    python scripts/bench_overhead.py --json                   # also one JSON line at the end
    python scripts/bench_overhead.py --long unique,agent,huge --baseline main \
        --smg /path/to/smg-venv/bin/smg                       # agent-sized prompts, vs SMG
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpclib.client import Channel, UnaryStreamMethod
from tokenizers import Tokenizer

from direct_frontend.protos import sglang_scheduler_pb2 as pb

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

# Targets of issue 16 (figures to print beside the measurements, not assertions).
TARGETS = (
    "targets (issue 16): CPU / request at c=32 <= 0.5 ms (stream 16) and <= 0.3 ms (full 16); "
    "<= 11 µs per streamed token; added TTFT p50 at c=1 <= 0.8 ms; req/s at c=32 2.5× today's"
)


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

    def __init__(
        self, name: str, argv: Sequence[str], log_path: pathlib.Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.started = time.perf_counter()
        self.popen = subprocess.Popen(
            list(argv), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            env=env,
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
        """The process's CPU time, ended threads included (:func:`proc_cpu_seconds`)."""
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
    """The process's CPU time, to the nanosecond: Linux's CPU clock of another process
    (``clock_gettime`` on ``(~pid << 3) | 2``), which counts threads that have ended too;
    else utime+stime (fields 14, 15 of /proc/<pid>/stat, in 10 ms ticks: at concurrency 1
    a phase's tick is about 4 % of a request's CPU)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int) -> float:
    """Resident set size of the process in MiB (``VmRSS``)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


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


def bench_fleet(listen_port: int, engine_port: int, otlp_endpoint: str | None = None,
                store: str = "") -> str:
    """One real (non-simulated) SGLang engine behind the frontend (tracing to a collector;
    ``store``: a ``[frontend.responses]`` table's lines)."""
    tracing = "" if otlp_endpoint is None else (
        f"\n[frontend.tracing]\notlp_endpoint = {json.dumps(otlp_endpoint)}\n"
    )
    if store:
        tracing += f"\n[frontend.responses]\n{store}\n"
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
    """One keep-alive HTTP/1.1 connection with a minimal chunked + SSE (or JSON body) reader.

    Parses only what is needed to time the response and check it: the first
    text event, the usage event and ``[DONE]`` of a stream; the usage of a body.
    """

    def __init__(self, port: int, request: bytes, tokens: int, stream: bool = True) -> None:
        self.port = port
        self.request = request
        self.tokens = tokens
        self.stream = stream
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
        if not head.startswith(b"HTTP/1.1 200"):
            raise BenchError(f"frontend: unexpected response head {head!r}")
        if self.stream:
            sample = await self._events(reader, lower, start)
        else:
            sample = await self._body(reader, lower, start)
        if b"connection: close" in lower:
            await self.close()
        return sample

    async def _body(self, reader: asyncio.StreamReader, lower: bytes, start: float) -> Sample:
        found = re.search(rb"content-length: *(\d+)", lower)
        if found is None:
            raise BenchError(f"frontend: no content-length in {lower!r}")
        body = json.loads(await reader.readexactly(int(found[1])))
        total = time.perf_counter() - start
        usage = body.get("usage") or {}
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if completion != self.tokens:
            raise BenchError(f"frontend: completion_tokens={completion}; wanted {self.tokens}")
        return Sample(total, total, 1)

    async def _events(self, reader: asyncio.StreamReader, lower: bytes, start: float) -> Sample:
        if b"transfer-encoding: chunked" not in lower:
            raise BenchError(f"frontend: a stream that is not chunked: {lower!r}")
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
                elif _has_text(payload):
                    if not chunks:
                        ttft = now - start
                    chunks += 1
        total = time.perf_counter() - start
        completion = usage.get("completion_tokens") if usage else None
        if not done or completion != self.tokens or not chunks:
            raise BenchError(
                f"frontend: done={done} completion_tokens={completion} text events={chunks}; "
                f"wanted [DONE] and {self.tokens}"
            )
        return Sample(ttft, total, chunks)


def _has_text(payload: bytes) -> bool:
    """Whether an SSE event (completions or chat) carries output text."""
    return (b'"text":"' in payload and b'"text":""' not in payload) or (
        b'"content":"' in payload and b'"content":""' not in payload
    )


#: a short chat: the system prompt and one question, rendered with the demo model's template
CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": PROMPT_TEXT},
]


def completion_request(
    port: int, ids: Sequence[int], tokens: int, stream: bool = True, chat: bool = False,
    responses: bool = False,
) -> bytes:
    """The whole HTTP request, built once: the client's per-request cost stays a write."""
    fields: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "temperature": 0,
                              "stream": stream}
    if responses:  # stored (the API's default): its commit is part of what is measured
        fields = {"model": MODEL, "input": PROMPT_TEXT, "max_output_tokens": tokens,
                  "temperature": 0}
    elif chat:
        fields["messages"] = CHAT_MESSAGES
    else:
        fields["prompt"] = list(ids)
    if stream:
        fields["stream_options"] = {"include_usage": True}
    body = json.dumps(fields, separators=(",", ":")).encode()
    path = ("/v1/responses" if responses else "/v1/chat/completions" if chat
            else "/v1/completions")
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
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


class SyscallCounter:
    """``strace -c -f`` attached to the daemon for one phase: system calls by name."""

    def __init__(self, pid: int) -> None:
        exe = shutil.which("strace")
        if exe is None:
            raise SystemExit("--syscalls needs strace")
        self.popen = subprocess.Popen(
            [exe, "-c", "-f", "-p", str(pid)], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        time.sleep(0.5)  # attached to every thread before the phase starts

    def stop(self) -> dict[str, int]:
        self.popen.send_signal(signal.SIGINT)
        _, err = self.popen.communicate(timeout=30)
        counts: dict[str, int] = {}
        for line in err.decode(errors="replace").splitlines():
            parts = line.split()
            # % time, seconds, usecs/call, calls, [errors,] syscall
            if len(parts) >= 5 and parts[3].isdigit() and parts[-1].isidentifier():
                counts[parts[-1]] = int(parts[3])
        return counts


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


#: libraries, by the first part of the innermost frame's path (anything else: "other")
LIBRARY_GROUPS = {
    "hypercorn/h11 (HTTP server)": ("hypercorn", "h11"),
    "trio (+trio-asyncio, outcome)": ("trio", "trio_asyncio", "outcome", "sniffio"),
    "asyncio (grpclib's loop)": ("asyncio",),
    "grpclib/h2/hpack/hyperframe (gRPC client)": ("grpclib", "h2", "hpack", "hyperframe",
                                                  "multidict"),
    "direct_frontend (ours)": ("direct_frontend",),
    "protobuf (+generated protos)": ("protos", "google"),
    "msgspec": ("msgspec",),
    "tokenizers/jinja2 (prompt)": ("tokenizers", "jinja2"),
    "prometheus_client (metrics)": ("prometheus_client",),
    "opentelemetry": ("opentelemetry",),
    # "<string>": the __init__ dataclasses generate
    "stdlib: contextlib, dataclasses, typing, enum, functools": (
        "contextlib", "dataclasses", "typing", "enum", "functools", "<string>"),
    "stdlib: selectors, socket, ssl": ("selectors", "socket", "ssl"),
    "stdlib: threading, queue (worker threads)": ("threading", "queue"),
    "stdlib: logging": ("logging",),
}
LIBRARIES = {package: group for group, packages in LIBRARY_GROUPS.items()
             for package in packages}


def _library(file: str) -> str:
    return LIBRARIES.get(_package(file), "other")


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

    * ``by_library``: self time by library (:data:`LIBRARIES`), innermost frame;
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
    by_library: collections.Counter[str] = collections.Counter()
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
        by_library[_library(frames[-1][1])] += count
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
        "by_library": table(by_library),
        "by_package": table(by_package),
        "ours_plus_callees": table(deepest),
        "ours_inclusive": table(inclusive),
        "not_ours": table(not_ours),
    }


# -- report -------------------------------------------------------------------------------


def report_profile(summary: dict[str, Any]) -> str:
    out = [f"py-spy profile of the daemon: {summary['samples']} samples (non-idle)"]
    for title, key in (
        ("self time by library", "by_library"),
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


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    """One measured configuration: streamed or not, ``max_tokens``, concurrency, chat or not."""

    stream: bool
    tokens: int
    concurrency: int
    chat: bool = False
    responses: bool = False  # a non-streamed, stored /v1/responses answer

    @property
    def name(self) -> str:
        kind = ("responses" if self.responses else "chat" if self.chat
                else "stream" if self.stream else "full")
        return f"{kind} {self.tokens}, c={self.concurrency}"

    @classmethod
    def parse(cls, text: str) -> Cell:
        """``s16@32``: a 16-token completions stream (token-id prompt) at concurrency 32;
        ``f16@32``: the same as one JSON body; ``c16@32``: a chat stream (rendered and
        tokenized by the daemon); ``r16@32``: a Responses answer, stored (``--store``)."""
        m = re.fullmatch(r"([sfcr])(\d+)@(\d+)", text.strip())
        if m is None:
            raise argparse.ArgumentTypeError(f"a cell is [sfcr]<tokens>@<c>: {text!r}")
        return cls(m[1] in "sc", int(m[2]), int(m[3]), m[1] == "c", m[1] == "r")


DEFAULT_CELLS = "s16@1,s16@8,s16@32,s64@32,f16@32,c16@32"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default=DEFAULT_CELLS,
                   help="comma-separated s<tokens>@<c> (stream), f<tokens>@<c> (one JSON body), "
                        "c<tokens>@<c> (chat stream), r<tokens>@<c> (a stored Responses "
                        "answer, kept per --store); "
                        f"default {DEFAULT_CELLS}")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds over every cell; figures are the medians of the rounds")
    p.add_argument("--requests", type=int, default=None,
                   help="measured requests per cell, daemon and round (default 150 at c=1, "
                        "else 400)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up requests per cell and daemon (default max(20, 2×c))")
    p.add_argument("--baseline", default=None, metavar="REV_OR_DIR",
                   help="also run a baseline daemon in the same run, cell by cell in alternating "
                        "order: a directory holding a direct_frontend package, or a git revision "
                        "(checked out once with `git worktree add` under /tmp)")
    p.add_argument("--startup-runs", type=int, default=0,
                   help="daemon start-ups to time on the demo fleet")
    p.add_argument("--profile", type=pathlib.Path, default=None,
                   help="after the rounds, profile the candidate daemon with py-spy on one cell "
                        "(--profile-cell) and write its raw output here")
    p.add_argument("--profile-cell", type=Cell.parse, default=Cell(True, 16, 32))
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--profile-requests", type=int, default=2000)
    p.add_argument("--syscalls", action="store_true",
                   help="after the rounds, count each daemon's system calls per request on the "
                        "profile cell with `strace -c` (exact counts; strace slows the daemon)")
    p.add_argument("--daemon-cmd", default=None,
                   help="command that stands for `direct-frontend` when starting the daemon under "
                        "test (shell-quoted)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="trace every request to this OTLP/HTTP collector ([frontend.tracing])")
    p.add_argument("--store", choices=("sqlite", "postgres", "memory"), default="sqlite",
                   help="where a Responses cell's stored response is kept (postgres: a server "
                        "started as the tests start one, unless --store-dsn names one)")
    p.add_argument("--store-dsn", default=None, help="with --store postgres: its database")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    import bench_long_prompts  # the --long mode (it imports this module back)

    bench_long_prompts.add_arguments(p)
    args = p.parse_args(argv)
    args.cells = [Cell.parse(c) for c in args.cells.split(",") if c.strip()]
    return args


def store_lines(args: argparse.Namespace, directory: pathlib.Path) -> str:
    """``[frontend.responses]`` for ``--store``: a Responses cell's response is kept there
    (none without a Responses cell, so a baseline older than the keys still starts)."""
    if not any(cell.responses for cell in args.cells):
        return ""
    if args.store == "memory":
        return 'backend = "memory"'
    if args.store == "postgres":
        return f'backend = "postgres"\ndsn = {json.dumps(args.store_dsn)}'
    directory.mkdir(parents=True, exist_ok=True)
    return f'backend = "sqlite"\npath = {json.dumps(str(directory / "responses.db"))}'


def baseline_source(spec: str) -> pathlib.Path:
    """A directory with a ``direct_frontend`` package: ``spec`` itself, or a checkout of it."""
    given = pathlib.Path(spec)
    if (given / "direct_frontend").is_dir():
        return given.resolve()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{spec}^{{commit}}"],
        capture_output=True, text=True, check=False,
    )
    if rev.returncode != 0:
        raise SystemExit(f"--baseline {spec!r}: neither a checkout nor a git revision")
    sha = rev.stdout.strip()
    where = pathlib.Path(tempfile.gettempdir()) / f"bench-baseline-{sha[:12]}"
    if not (where / "direct_frontend").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), sha],
                       check=True, capture_output=True)
    return where


def daemon_env(source: pathlib.Path) -> dict[str, str]:
    """This environment, importing ``direct_frontend`` from ``source``."""
    return dict(os.environ, PYTHONPATH=str(source))


def code_under_test(where: pathlib.Path | None = None) -> str:
    """Which direct_frontend a daemon imports and which commit it is, for the record."""
    if where is None:
        import importlib.util

        spec = importlib.util.find_spec("direct_frontend")
        where = pathlib.Path(spec.origin).parent.parent if spec and spec.origin else ROOT
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


@dataclasses.dataclass
class Side:
    """One daemon under test (the candidate, or the baseline) and its phases, by cell."""

    name: str
    source: pathlib.Path | None  # None: whatever this process imports
    daemon: Child | None = None
    port: int = 0
    phases: dict[Cell, list[dict[str, float]]] = dataclasses.field(default_factory=dict)


async def start_side(
    side: Side, engine_port: int, args: argparse.Namespace, tmp: pathlib.Path,
    children: list[Child],
) -> None:
    (side.port,) = free_ports(1)
    fleet = tmp / f"bench-fleet-{side.name}.toml"
    fleet.write_text(bench_fleet(side.port, engine_port, args.otlp_endpoint,
                                 store_lines(args, tmp / f"store-{side.name}")))
    cmd = shlex.split(args.daemon_cmd) if args.daemon_cmd and side.name == "candidate" else (
        cli_argv()
    )
    env = dict(os.environ) if side.source is None else daemon_env(side.source)
    state = tmp / f"state-{side.name}"  # a store of its own: schemas differ between revisions
    state.mkdir(parents=True, exist_ok=True)
    env["STATE_DIRECTORY"] = str(state)
    side.daemon = Child(f"daemon ({side.name})", [*cmd, "run", str(fleet), "--log-level",
                                                  "WARNING"], tmp / f"daemon-{side.name}.log", env)
    children.append(side.daemon)
    await wait_ready(side.daemon, side.port)


async def measure_cell(
    side: Side, cell: Cell, ids: Sequence[int], args: argparse.Namespace, engine: Child,
    profile: pathlib.Path | None = None, syscalls: dict[str, int] | None = None,
) -> dict[str, float]:
    """Warm up, then one measured phase of ``cell`` against ``side``'s daemon (profiled, or
    its system calls counted into ``syscalls``, if asked)."""
    assert side.daemon is not None
    n = args.requests or (150 if cell.concurrency == 1 else 400)
    if profile is not None or syscalls is not None:
        n = args.profile_requests
    warm = args.warmup if args.warmup is not None else max(20, 2 * cell.concurrency)
    request = completion_request(side.port, ids, cell.tokens, cell.stream, cell.chat,
                                 cell.responses)
    conns = [HttpConnection(side.port, request, cell.tokens, cell.stream)
             for _ in range(cell.concurrency)]
    try:
        workers = [conn.one for conn in conns]
        if warm:
            await run_phase(workers, warm, engine, side.daemon)
        profiler = None if profile is None else Profiler(side.daemon.pid, profile,
                                                         args.profile_rate)
        counter = None if syscalls is None else SyscallCounter(side.daemon.pid)
        try:
            phase = await run_phase(workers, n, engine, side.daemon)
        finally:
            if profiler is not None:
                profiler.stop()
            if counter is not None and syscalls is not None:
                syscalls.update({k: v / n for k, v in counter.stop().items()})
    finally:
        for conn in conns:
            await conn.close()
    return {**summarize(phase, cell.tokens), "daemon_rss_mb": rss_mb(side.daemon.pid)}


async def bench(
    args: argparse.Namespace, sides: list[Side], tmp: pathlib.Path, children: list[Child],
) -> dict[str, Any]:
    """Start the engine and the daemons, then measure every cell, round after round."""
    cells: list[Cell] = args.cells
    ids = prompt_ids()
    results: dict[str, Any] = {
        "prompt_tokens": len(ids), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "rounds": args.rounds, "cells": [c.name for c in cells],
    }
    results["startup_demo_fleet_s"] = await time_startups(args.startup_runs, tmp, children)

    (engine_port,) = free_ports(1)
    engine = Child("engine", [
        *cli_argv(), "simulate-engine", "--kind", "sglang", "--host", HOST,
        "--port", str(engine_port), "--model-dir", str(MODEL_DIR),
        "--served-model-name", MODEL, "--prefill-us-per-token", "0",
        "--decode-us-per-token", "0", "--eos-probability", "0",
        "--max-running", str(max(64, *(c.concurrency for c in cells))),
    ], tmp / "engine.log")
    children.append(engine)
    await wait_for_port(engine, engine_port)
    for side in sides:
        await start_side(side, engine_port, args, tmp, children)

    direct_cells = [c for c in cells if c.concurrency == 1 and c.stream and not c.chat]
    direct: dict[Cell, list[dict[str, float]]] = {c: [] for c in direct_cells}
    for round_no in range(args.rounds):
        order = sides if round_no % 2 == 0 else sides[::-1]
        for cell in cells:
            if cell in direct:  # the engine alone, for the added latency
                client = DirectClient(engine_port, ids, cell.tokens)
                try:
                    await run_phase([client.one], 20, engine, engine)
                    d = await run_phase([client.one], args.requests or 150, engine, engine)
                finally:
                    client.close()
                direct[cell].append(summarize(d, cell.tokens))
            for side in order:
                side.phases.setdefault(cell, []).append(
                    await measure_cell(side, cell, ids, args, engine)
                )
        rss = ", ".join(f"{side.name} {rss_mb(side.daemon.pid):.1f} MiB" for side in sides
                        if side.daemon is not None)
        print(f"round {round_no + 1}/{args.rounds} done; daemon RSS: {rss}", flush=True)
    for side in sides:
        assert side.daemon is not None
        side.daemon.check_alive()
    results["sides"] = {
        side.name: figures(side, cells, direct) for side in sides
    }
    if args.syscalls:
        results["syscalls"] = {}
        for side in sides:
            counts: dict[str, int] = {}
            await measure_cell(side, args.profile_cell, ids, args, engine, syscalls=counts)
            results["syscalls"][side.name] = counts
        results["profile_cell"] = args.profile_cell.name
    if args.profile is not None:
        await measure_cell(sides[0], args.profile_cell, ids, args, engine, args.profile)
        results["profile"] = summarize_profile(args.profile)
        results["profile_cell"] = args.profile_cell.name
    return results


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def figures(
    side: Side, cells: Sequence[Cell], direct: dict[Cell, list[dict[str, float]]]
) -> dict[str, Any]:
    """The medians over rounds per cell, the added latency at c=1, and the fixed/per-token fit."""
    out: dict[str, Any] = {"cells": {}}
    for cell in cells:
        runs = side.phases[cell]
        row = {key: _median([r[key] for r in runs]) for key in (
            "daemon_cpu_ms_per_request", "daemon_cpu_us_per_token", "req_per_s",
            "ttft_p50_ms", "total_p50_ms", "chunks_per_request", "other_cores",
        )}
        row["daemon_rss_mb"] = runs[-1]["daemon_rss_mb"]  # where it is after the last round
        if cell in direct:
            row["added_ttft_p50_ms"] = _median([
                r["ttft_p50_ms"] - d["ttft_p50_ms"] for r, d in zip(runs, direct[cell],
                                                                     strict=True)
            ])
            row["added_total_p50_ms"] = _median([
                r["total_p50_ms"] - d["total_p50_ms"] for r, d in zip(runs, direct[cell],
                                                                       strict=True)
            ])
        out["cells"][cell.name] = row
    # Fixed + per-token cost: two stream cells of one concurrency, different lengths.
    by_c: dict[int, list[Cell]] = {}
    for cell in cells:
        if cell.stream and not cell.chat:
            by_c.setdefault(cell.concurrency, []).append(cell)
    for c, group in sorted(by_c.items(), reverse=True):
        if len({g.tokens for g in group}) >= 2:
            short, long = min(group, key=lambda g: g.tokens), max(group, key=lambda g: g.tokens)
            cpu_short = out["cells"][short.name]["daemon_cpu_ms_per_request"]
            cpu_long = out["cells"][long.name]["daemon_cpu_ms_per_request"]
            per_token_ms = (cpu_long - cpu_short) / (long.tokens - short.tokens)
            out["fit"] = {
                "concurrency": c, "tokens": [short.tokens, long.tokens],
                "per_token_us": per_token_ms * 1e3,
                "fixed_ms": cpu_short - short.tokens * per_token_ms,
            }
            break
    return out


#: the figures of the report: key, label, format, whether lower is better
ROWS = (
    ("daemon_cpu_ms_per_request", "daemon CPU / request (ms)", ".3f"),
    ("daemon_cpu_us_per_token", "daemon CPU / token (µs)", ".1f"),
    ("req_per_s", "throughput (req/s)", ".1f"),
    ("ttft_p50_ms", "TTFT p50 (ms)", ".3f"),
    ("added_ttft_p50_ms", "added TTFT p50 (ms)", ".3f"),
    ("added_total_p50_ms", "added total p50 (ms)", ".3f"),
    ("chunks_per_request", "SSE text events / request", ".1f"),
    ("other_cores", "other load (cores)", ".2f"),
    ("daemon_rss_mb", "daemon RSS after (MiB)", ".1f"),
)


#: figures that mean nothing for a response sent as one body
PER_STREAM = ("daemon_cpu_us_per_token", "chunks_per_request", "ttft_p50_ms")


def report(results: dict[str, Any]) -> str:
    """One table: per cell and figure, each side's median (and candidate/baseline)."""
    sides = results["sides"]
    names = list(sides)
    both = len(names) == 2
    head = f"  {'cell':<20}{'figure':<28}" + "".join(f"{n:>12}" for n in names)
    head += f"{'ratio':>8}" if both else ""
    lines = [f"medians of {results['rounds']} rounds (one engine, zero engine time)", head,
             "  " + "-" * (len(head) - 2)]
    for cell in results["cells"]:
        for key, label, fmt in ROWS:
            values = [sides[n]["cells"][cell].get(key) for n in names]
            if values[0] is None or (cell.startswith("full") and key in PER_STREAM):
                continue
            row = f"  {cell:<20}{label:<28}" + "".join(f"{v:>12{fmt}}" for v in values)
            if both and key not in ("added_ttft_p50_ms", "added_total_p50_ms", "other_cores",
                                     "daemon_rss_mb"):
                row += f"{values[0] / values[1]:>8.2f}" if values[1] else ""
            lines.append(row)
    for n in names:
        fit = sides[n].get("fit")
        if fit:
            lines.append(
                f"  fit ({n}, c={fit['concurrency']}, {fit['tokens'][0]} and {fit['tokens'][1]} "
                f"tokens): {fit['fixed_ms']:.3f} ms fixed + {fit['per_token_us']:.1f} µs / token"
            )
    if both:
        lines.append("  ratio: candidate / baseline (throughput: above 1 is better; "
                     "the rest: below 1 is better)")
    return "\n".join(lines)


def id_costs() -> dict[str, float]:
    """What each request spends on ids, in µs: every request draws a request id, a Responses
    request a response id too; both from the OS's CSPRNG (``secrets``). The seeded Mersenne
    Twister they replace (whose outputs predicted the access ids) is timed beside them."""
    import random
    import timeit

    from direct_frontend.observability.logging import new_request_id
    from direct_frontend.openai.response_store import new_response_id

    twister = random.Random(os.urandom(16))
    timed = {"request_id_us": new_request_id,
             "response_id_us": lambda: new_response_id("0a1b2c3d"),
             "seeded_twister_id_us": lambda: f"{twister.getrandbits(64):016x}"}
    return {name: min(timeit.repeat(call, number=20_000, repeat=5)) / 20_000 * 1e6
            for name, call in timed.items()}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> None:
    import bench_long_prompts  # the --long mode (it imports this module back)

    args = parse_args(argv)
    if args.profile is not None and shutil.which("py-spy") is None and not (
        pathlib.Path(sys.executable).parent / "py-spy"
    ).exists():
        raise SystemExit("--profile needs py-spy (pip install -e '.[bench]')")
    sides = [Side("candidate", None)]
    if args.baseline is not None:
        sides.append(Side("baseline", baseline_source(args.baseline)))
    # SIGTERM takes the same clean-up path as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    children: list[Child] = []
    print(f"bench_overhead: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; daemons, "
          "engine and this client share them.")
    for side in sides:
        print(f"  {side.name}: {code_under_test(side.source)}")
    print(f"Logs: {tmp} (kept on failure or with --keep-logs)\n", flush=True)
    ok = False
    try:
        with contextlib.ExitStack() as servers:
            if args.store == "postgres" and args.store_dsn is None:
                sys.path.insert(0, str(ROOT))  # the tests' way of starting Debian's server
                from tests.support.postgres import running_postgres

                args.store_dsn = servers.enter_context(running_postgres()).new_url()
            if args.long:
                results = asyncio.run(bench_long_prompts.run(args, sides, tmp, children))
            else:
                results = asyncio.run(bench(args, sides, tmp, children))
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

    print()
    if args.long:
        print(bench_long_prompts.report(results))
        if args.json:
            print(json.dumps(results, default=lambda o: dataclasses.asdict(o),
                             separators=(",", ":")))
        return
    print(report(results))
    print(TARGETS)
    results["ids"] = ids = id_costs()
    print(f"ids per request (in-process): request id {ids['request_id_us']:.2f} µs, response "
          f"id {ids['response_id_us']:.2f} µs, both from secrets (a seeded Mersenne Twister's "
          f"id: {ids['seeded_twister_id_us']:.2f} µs)")
    startups = results["startup_demo_fleet_s"]
    if startups:
        print(f"\ndaemon start-up on the demo fleet (process start → GET /ready 200), "
              f"{len(startups)} runs: " + ", ".join(f"{s:.3f} s" for s in startups))
    if "syscalls" in results:
        print(f"\nsystem calls per request ({results['profile_cell']}, strace -c):")
        names = sorted({k for counts in results["syscalls"].values() for k in counts},
                       key=lambda k: -results["syscalls"]["candidate"].get(k, 0))
        print(f"  {'':20}" + "".join(f"{side:>12}" for side in results["syscalls"]))
        for name in names:
            print(f"  {name:20}" + "".join(
                f"{counts.get(name, 0):>12.2f}" for counts in results["syscalls"].values()))
    if "profile" in results:
        print(f"\n[{results['profile_cell']}, candidate] ", end="")
        print(report_profile(results["profile"]))
    if args.json:
        print(json.dumps(results, separators=(",", ":")))


if __name__ == "__main__":
    main()
