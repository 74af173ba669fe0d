#!/usr/bin/env python3
"""Measure the message codec on the relay's hot path, to choose one on numbers.

Every streamed token costs one ``GenerateResponse`` decode plus the handful of
field reads the relay does (which oneof is set, the delta's token ids and its
counts); every request costs one ``GenerateRequest`` build and encode. This
script times exactly that, for:

* ``protobuf`` (upb) through our generated modules in ``protos/`` (in-process);
* ``betterproto2`` and ``betterproto`` 2.0.0b7 (with and without
  ``betterproto-rust-codec``), each in its own throwaway venv so nothing leaks
  into the project's venv. Their classes are generated afresh from
  ``protos/src/*.proto`` on every run and timed in a subprocess.

All rows are measured in the same run on the same bytes, so the ratios are
comparable even though absolute figures drift between machines. A missing
venv gives a "not installed" row, not a failure.

Usage::

    python scripts/bench_codec.py --setup   # once: create the throwaway venvs (needs PyPI)
    python scripts/bench_codec.py           # measure; about 20 s

This file is also the subprocess worker (``--worker``), so it imports only the
standard library at module level: the other venvs do not have our packages.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_SRC = ROOT / "protos" / "src"
PROTO_FILES: list[str] = tomllib.loads((ROOT / "protos" / "contract.toml").read_text())["files"]
VENV_ROOT = pathlib.Path(tempfile.gettempdir()) / "direct-frontend-codec-bench"

# What --setup installs; pinned so reruns compare like with like.
VENVS: dict[str, tuple[str, ...]] = {
    "betterproto2": (
        "betterproto2==0.10.0",
        "betterproto2-compiler==0.10.1",
        "grpcio-tools>=1.85,<1.86",
    ),
    "betterproto": (
        "betterproto[compiler]==2.0.0b7",
        "betterproto-rust-codec==0.1.1",
        "grpcio-tools>=1.85,<1.86",
    ),
}

# ---------------------------------------------------------------------------
# The workload, as plain data so every codec builds and checks the same thing.
# ---------------------------------------------------------------------------

REQUEST_ID = "chatcmpl-4f1c9e07a2b84d6e9c3a"  # 30 chars, the shape our ids have
PROMPT_LEN = 1000
VOCAB = 151_936  # Qwen-sized vocabulary: most ids take a 3-byte varint


def workload() -> dict[str, Any]:
    """The request and the two stream chunks, deterministic across processes."""
    rng = random.Random(20261129)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    return {
        "request": {
            "request_id": REQUEST_ID,
            "input_ids": prompt,
            "sampling": {
                "temperature": 0.7,
                "top_p": 0.95,
                "top_k": 50,
                "min_p": 0.05,
                "frequency_penalty": 0.1,
                "presence_penalty": 0.2,
                "repetition_penalty": 1.05,
                "max_new_tokens": 512,
                "stop_token_ids": [151643, 151645],
                "skip_special_tokens": True,
                "n": 1,
                "min_new_tokens": 1,
            },
            "stream": True,
        },
        "chunks": {
            "1 tok": {
                "token_ids": [88135],
                "prompt_tokens": 1000,
                "completion_tokens": 37,
                "cached_tokens": 768,
            },
            "4 tok": {
                "token_ids": [88135, 11, 151_000, 2049],
                "prompt_tokens": 1000,
                "completion_tokens": 40,
                "cached_tokens": 768,
            },
        },
    }


# ---------------------------------------------------------------------------
# Timing (shared by the parent and the workers).
# ---------------------------------------------------------------------------


def per_op_us(fn: Callable[[], object], seconds: float, repeats: int = 7) -> float:
    """Best µs per call over ``repeats`` runs of about ``seconds`` each.

    The best run is the one least disturbed by the rest of the machine (timeit's
    reasoning). GC stays enabled, since allocation-heavy codecs pay for it in
    production too, but each run starts clean.
    """
    n, elapsed = 1, 0.0
    while elapsed < 0.02:  # calibrate on ~20 ms
        n *= 2
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - start
    loops = max(1, int(n * seconds / elapsed))
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - start) / loops * 1e6)
    return min(samples)


def measure(ops: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    return {name: per_op_us(fn, seconds) for name, fn in ops.items()}


def check_delta(got: tuple[str, tuple[int, ...], int, int, int], want: dict[str, Any]) -> None:
    """Fail loudly if a codec's hot-path read is wrong: a fast wrong codec is no result."""
    expected = (
        "chunk",
        tuple(want["token_ids"]),
        want["prompt_tokens"],
        want["completion_tokens"],
        want["cached_tokens"],
    )
    if got != expected:
        raise AssertionError(f"decoded {got!r}, expected {expected!r}")


# ---------------------------------------------------------------------------
# The codecs. Each gives a decode (bytes -> what the relay reads) and an encode.
# ---------------------------------------------------------------------------

Delta = tuple[str, tuple[int, ...], int, int, int]
Ops = dict[str, Callable[[], object]]


def assemble(
    work: dict[str, Any],
    payloads: dict[str, bytes],
    decode: Callable[[bytes], Delta],
    encode: Callable[[], bytes],
) -> tuple[Ops, bytes]:
    """Check the decode on every payload, then name the timed operations."""
    ops: Ops = {}
    for name, data in payloads.items():
        check_delta(decode(data), work["chunks"][name])
        ops[f"decode {name}"] = functools.partial(decode, data)
    ops["encode"] = encode
    return ops, encode()


def protobuf_ops(work: dict[str, Any], payloads: dict[str, bytes]) -> tuple[Ops, bytes]:
    sys.path.insert(0, str(ROOT))
    from direct_frontend.protos import sglang_scheduler_pb2 as pb

    response_cls = pb.GenerateResponse
    req, sampling = work["request"], work["request"]["sampling"]

    def decode(data: bytes) -> Delta:
        msg = response_cls.FromString(data)
        kind = msg.WhichOneof("response")
        if kind == "chunk":
            c = msg.chunk
            return kind, tuple(c.token_ids), c.prompt_tokens, c.completion_tokens, c.cached_tokens
        raise AssertionError(kind)

    def encode() -> bytes:
        # Sub-messages as dicts: passing a built TokenizedInput copies it (1000 ids
        # again, about +16 µs here), so the dialects should build this way too.
        return pb.GenerateRequest(
            request_id=req["request_id"],
            tokenized={"input_ids": req["input_ids"]},
            sampling_params=sampling,
            stream=req["stream"],
        ).SerializeToString()

    return assemble(work, payloads, decode, encode)


def betterproto2_ops(
    work: dict[str, Any], payloads: dict[str, bytes], package: str
) -> tuple[Ops, bytes]:
    pb = importlib.import_module(f"{package}.sglang.grpc.scheduler")
    response_cls = pb.GenerateResponse
    req, sampling = work["request"], work["request"]["sampling"]

    def decode(data: bytes) -> Delta:
        msg = response_cls.parse(data)
        c = msg.chunk  # oneof members are ``X | None`` in betterproto2: the cheapest test
        if c is not None:
            return (
                "chunk",
                tuple(c.token_ids),
                c.prompt_tokens,
                c.completion_tokens,
                c.cached_tokens,
            )
        raise AssertionError("no chunk")

    def encode() -> bytes:
        return bytes(
            pb.GenerateRequest(
                request_id=req["request_id"],
                tokenized=pb.TokenizedInput(input_ids=list(req["input_ids"])),
                sampling_params=pb.SamplingParams(**sampling),
                stream=req["stream"],
            )
        )

    return assemble(work, payloads, decode, encode)


def betterproto_ops(
    work: dict[str, Any], payloads: dict[str, bytes], package: str
) -> tuple[Ops, bytes]:
    which_one_of = importlib.import_module("betterproto").which_one_of
    pb = importlib.import_module(f"{package}.sglang.grpc.scheduler")
    response_cls = pb.GenerateResponse
    req, sampling = work["request"], work["request"]["sampling"]

    def decode(data: bytes) -> Delta:
        msg = response_cls().parse(data)
        # An unset oneof message reads as a default instance in 2.0.0b7, so ask the group.
        kind, c = which_one_of(msg, "response")
        if kind == "chunk":
            return kind, tuple(c.token_ids), c.prompt_tokens, c.completion_tokens, c.cached_tokens
        raise AssertionError(kind)

    def encode() -> bytes:
        return bytes(
            pb.GenerateRequest(
                request_id=req["request_id"],
                tokenized=pb.TokenizedInput(input_ids=list(req["input_ids"])),
                sampling_params=pb.SamplingParams(**sampling),
                stream=req["stream"],
            )
        )

    return assemble(work, payloads, decode, encode)


# ---------------------------------------------------------------------------
# Worker side: runs inside a throwaway venv.
# ---------------------------------------------------------------------------


def worker(kind: str, gen_parent: str) -> int:
    """Read the job from stdin, time one codec, print one JSON line."""
    job = json.loads(sys.stdin.read())
    if kind == "betterproto-pure":
        sys.modules["betterproto_rust_codec"] = None  # type: ignore[assignment]  # import now fails
    sys.path.insert(0, gen_parent)
    payloads = {k: bytes.fromhex(v) for k, v in job["payloads"].items()}
    from importlib.metadata import version

    if kind == "betterproto2":
        ops, encoded = betterproto2_ops(job["work"], payloads, job["package"])
        label = f"betterproto2 {version('betterproto2')}"
    else:
        ops, encoded = betterproto_ops(job["work"], payloads, job["package"])
        label = f"betterproto {version('betterproto')}"
        if kind == "betterproto-rust":
            message_cls = importlib.import_module("betterproto").Message
            if message_cls.parse.__name__ != "__parse_patch":
                raise SystemExit("betterproto-rust-codec did not patch betterproto.Message")
            label += f" + rust codec {version('betterproto-rust-codec')}"
        else:
            label += ", pure Python"
    print(
        json.dumps({"label": label, "us": measure(ops, job["seconds"]), "encoded": encoded.hex()})
    )
    return 0


# ---------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------


def venv_python(name: str) -> pathlib.Path:
    return VENV_ROOT / name / "bin" / "python"


def setup() -> None:
    """Create the throwaway venvs under the temp dir; never touches the project venv."""
    base = getattr(sys, "_base_executable", sys.executable)
    for name, requirements in VENVS.items():
        target = VENV_ROOT / name
        if not venv_python(name).exists():
            subprocess.run([base, "-m", "venv", str(target)], check=True)
        subprocess.run(
            [str(venv_python(name)), "-m", "pip", "install", "--quiet", *requirements], check=True
        )
        print(f"ready: {target}")


def generate(python: pathlib.Path, plugin: str, out_parent: pathlib.Path) -> str:
    """Generate ``plugin`` classes for our vendored protos; return the package name."""
    package = "codecgen"
    out = out_parent / package
    out.mkdir(parents=True)
    well_known = subprocess.run(
        [str(python), "-c", "import grpc_tools, os; print(os.path.dirname(grpc_tools.__file__))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    env = dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    subprocess.run(
        [
            str(python),
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_SRC}",
            f"-I{well_known}/_proto",
            f"--{plugin}_out={out}",
            *PROTO_FILES,
        ],
        check=True,
        capture_output=True,
        env=env,
        cwd=PROTO_SRC,
        timeout=60,
    )
    return package


def run_alternative(kind: str, venv: str, plugin: str, job: dict[str, Any]) -> dict[str, Any] | str:
    """Time one alternative in its venv; a string result says why there is no number."""
    python = venv_python(venv)
    if not python.exists():
        return "not installed (see --setup)"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            job = dict(job, package=generate(python, plugin, pathlib.Path(tmp)))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            stderr = exc.stderr or b""
            text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
            last = (text.strip().splitlines() or ["?"])[-1]
            return f"not installed (codegen failed: {last[:60]})"
        proc = subprocess.run(
            [str(python), __file__, "--worker", kind, "--gen-parent", tmp],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=120,
        )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if "ModuleNotFoundError" in tail or "did not patch" in tail:
            return f"not installed ({tail[:80]})"
        return f"failed ({tail[:100]})"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="create the throwaway venvs and exit")
    parser.add_argument("--seconds", type=float, default=0.1, help="time per repeat (7 repeats)")
    parser.add_argument(
        "--worker",
        choices=["betterproto2", "betterproto-rust", "betterproto-pure"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--gen-parent", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.gen_parent)
    if args.setup:
        setup()
        return 0

    started = time.perf_counter()
    work = workload()
    sys.path.insert(0, str(ROOT))
    import google.protobuf
    from google.protobuf.internal import api_implementation

    from direct_frontend.protos import sglang_scheduler_pb2 as pb

    payloads = {
        name: pb.GenerateResponse(
            request_id=REQUEST_ID, chunk=pb.GenerateStreamChunk(**c)
        ).SerializeToString()
        for name, c in work["chunks"].items()
    }
    ops, reference = protobuf_ops(work, payloads)
    rows: list[tuple[str, dict[str, float] | str]] = [
        (
            f"protobuf {google.protobuf.__version__} ({api_implementation.Type()})",
            measure(ops, args.seconds),
        ),
    ]
    want = pb.GenerateRequest.FromString(reference)
    job = {
        "work": work,
        "payloads": {k: v.hex() for k, v in payloads.items()},
        "seconds": args.seconds,
    }
    for kind, venv, plugin, label in (
        ("betterproto2", "betterproto2", "python_betterproto2", "betterproto2"),
        (
            "betterproto-rust",
            "betterproto",
            "python_betterproto",
            "betterproto 2.0.0b7 + rust codec",
        ),
        (
            "betterproto-pure",
            "betterproto",
            "python_betterproto",
            "betterproto 2.0.0b7, pure Python",
        ),
    ):
        result = run_alternative(kind, venv, plugin, job)
        if isinstance(result, str):
            rows.append((label, result))
            continue
        got = pb.GenerateRequest.FromString(bytes.fromhex(result["encoded"]))
        if got != want:  # the encode must mean the same request, whatever its byte order
            rows.append((result["label"], "failed (encoded request differs from protobuf's)"))
            continue
        rows.append((result["label"], result["us"]))

    print_table(rows, [f"decode {name}" for name in work["chunks"]] + ["encode"])
    sizes = ", ".join(f"{k}: {len(v)} B" for k, v in payloads.items())
    print(
        "\ndecode = parse GenerateResponse(chunk), test the oneof, read token_ids and the"
        f" prompt/completion/cached counts ({sizes}); encode = build and serialize a"
        f" GenerateRequest ({PROMPT_LEN}-token prompt, sampling params; {len(reference)} B)."
        f" Best of 7 runs. Took {time.perf_counter() - started:.0f} s."
    )
    return 0


def print_table(rows: list[tuple[str, dict[str, float] | str]], columns: list[str]) -> None:
    """One row per codec; a row without figures shows why, spanning the figure columns."""
    base = rows[0][1]
    assert isinstance(base, dict)
    header = ["codec", *(f"{c} µs (×pb)" for c in columns)]
    lines: list[list[str]] = [header]
    for label, result in rows:
        if isinstance(result, str):
            lines.append([label, result])
        else:
            lines.append(
                [label, *(f"{result[c]:8.2f} ({result[c] / base[c]:5.1f}×)" for c in columns)]
            )
    widths = [len(h) for h in header]
    for line in lines:
        widths[0] = max(widths[0], len(line[0]))
        if len(line) == len(header):
            widths[1:] = [max(w, len(cell)) for w, cell in zip(widths[1:], line[1:], strict=True)]
    for n, line in enumerate(lines):
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)).rstrip())
        if n == 0:
            print("-+-".join("-" * w for w in widths))


if __name__ == "__main__":
    sys.exit(main())
