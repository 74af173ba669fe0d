"""Run one simulated engine as a standalone process.

This is the only place the simulator owns an event loop: the daemon embeds
:class:`SimEngine` on its own (trio-asyncio) loop instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import Any, TypedDict, Unpack, get_args

from direct_frontend.simulator.control import serve_control
from direct_frontend.simulator.engine import SimEngine
from direct_frontend.simulator.faults import FaultPlan, parse_status
from direct_frontend.simulator.model import TimingModel
from direct_frontend.simulator.settings import EngineConfig, EngineKind, SimRole


class FaultFlags(TypedDict, total=False):
    """The ``--fault-*`` flags: a :class:`FaultPlan` in a command line's units (unset: none)."""

    fault_die_after: int | None
    fault_hang_after: int | None
    fault_status: str | None  # a gRPC status name or number
    fault_status_after: int
    fault_token_delay_ms: float
    fault_only_request: int | None


def fault_plan(**flags: Unpack[FaultFlags]) -> FaultPlan | None:
    """The plan the flags describe, or None when they describe none."""
    status = flags.get("fault_status")
    only_request = flags.get("fault_only_request")
    plan = FaultPlan(
        die_after_tokens=flags.get("fault_die_after"),
        hang_after_tokens=flags.get("fault_hang_after"),
        status=parse_status(status) if status else None,
        status_after_tokens=flags.get("fault_status_after", 0),
        token_delay_s=flags.get("fault_token_delay_ms", 0.0) / 1000,
        only_request=only_request,
    )
    return None if plan == FaultPlan(only_request=only_request) else plan


async def _serve(engine: SimEngine, host: str, port: int, control_port: int | None) -> None:
    control = await serve_control(engine, host, control_port) if control_port is not None else None

    def ready() -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signal.SIGTERM, engine.close)
        # A parent process (tests, the demo fleet) waits for this line.
        print(f"sim {engine.kind} engine listening on {engine.address}", flush=True)
        if control is not None:  # second, so parents reading one line still get the engine's
            bound = control.sockets[0].getsockname()[1]
            print(f"sim control listening on {host}:{bound}", flush=True)

    try:
        await engine.serve_forever(host, port, ready=ready)
    finally:
        if control is not None:
            control.close()


def run(
    config: EngineConfig,
    host: str,
    port: int,
    *,
    faults: FaultPlan | None = None,
    control_port: int | None = None,
) -> None:
    """Serve one simulated engine until SIGINT/SIGTERM; only for a standalone process.

    ``faults`` is the engine's initial :class:`FaultPlan`; ``control_port``
    (0 picks one) serves the JSON-lines control channel of
    :mod:`direct_frontend.simulator.control` on the same host.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run() owns its event loop; embed SimEngine on a running loop instead")
    engine = SimEngine(config, faults=faults)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(engine, host, port, control_port))  # ok: standalone simulator process


def _config(args: argparse.Namespace) -> EngineConfig:
    """The engine the parsed command line describes."""
    settings: dict[str, Any] = {
        "context_length": args.context_length, "role": args.role,
        "eos_probability": args.eos_probability, "seed": args.seed,
        "embedding_dim": args.embedding_dim,
        "timing": TimingModel(args.prefill_us_per_token, args.decode_us_per_token,
                              args.max_running),
    }
    if args.model_dir is not None:
        return EngineConfig.from_model_dir(
            args.kind, args.model_dir, served_model_name=args.served_model_name, **settings
        )
    return EngineConfig(args.kind, args.served_model_name or "sim", args.vocab_size,
                        args.eos_token_id, **settings)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: ``python -m direct_frontend.simulator.cli KIND --port N ...``."""
    parser = argparse.ArgumentParser(description="Serve a simulated inference engine over gRPC.")
    parser.add_argument("kind", choices=get_args(EngineKind))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir")
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--eos-token-id", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--role", choices=get_args(SimRole), default="both")
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0)
    parser.add_argument("--decode-us-per-token", type=float, default=0.0)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--eos-probability", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--embedding-dim",
        type=int,
        default=0,
        metavar="N",
        help="serve an embedding model of N dimensions (Embed answers, Generate is refused)",
    )
    faults = parser.add_argument_group("fault injection (see direct_frontend.simulator.faults)")
    faults.add_argument(
        "--fault-die-after", type=int, metavar="N", help="drop the connection after N tokens"
    )
    faults.add_argument(
        "--fault-hang-after", type=int, metavar="N", help="stop sending after N tokens"
    )
    faults.add_argument(
        "--fault-status", metavar="NAME", help="fail Generate/Embed with this gRPC status"
    )
    faults.add_argument("--fault-status-after", type=int, default=0, metavar="N")
    faults.add_argument("--fault-token-delay-ms", type=float, default=0.0, metavar="MS")
    faults.add_argument("--fault-only-request", type=int, metavar="N", help="only the Nth call")
    parser.add_argument("--control-port", type=int, help="JSON-lines control channel (0: any)")
    args = parser.parse_args(argv)
    if args.model_dir is None and (args.vocab_size is None or args.eos_token_id is None):
        parser.error("give --model-dir, or both --vocab-size and --eos-token-id")
    if args.embedding_dim < 0:
        parser.error("--embedding-dim must not be negative")
    if args.kind == "trtllm" and args.embedding_dim:
        parser.error("the TRT-LLM contract serves no embeddings")
    if args.fault_status:
        try:
            parse_status(args.fault_status)
        except ValueError as exc:
            parser.error(str(exc))
    plan = fault_plan(
        fault_die_after=args.fault_die_after, fault_hang_after=args.fault_hang_after,
        fault_status=args.fault_status, fault_status_after=args.fault_status_after,
        fault_token_delay_ms=args.fault_token_delay_ms, fault_only_request=args.fault_only_request,
    )
    run(_config(args), args.host, args.port, faults=plan, control_port=args.control_port)


if __name__ == "__main__":
    main(sys.argv[1:])
