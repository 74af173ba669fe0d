"""A tiny control channel for simulator processes: JSON lines over TCP.

In-process tests flip ``SimEngine.faults`` directly; a simulator running as
its own process (``simulate-engine --control-port N``) takes the same
commands over a socket instead, one JSON object per line, one reply each::

    {"op": "set_faults", "faults": {"die_after_tokens": 5, "status": "UNAVAILABLE"}}
    {"op": "get"}  {"op": "stop_listening"}  {"op": "resume_listening"}
    {"op": "restart"}  {"op": "set_healthy", "healthy": false}

Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``; every
reply carries the current state (as ``get`` returns it). No HTTP, no auth:
bind it to loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from direct_frontend.simulator.faults import FaultPlan, parse_status

if TYPE_CHECKING:
    from direct_frontend.simulator.engine import SimEngine

_FIELDS = frozenset(field.name for field in dataclasses.fields(FaultPlan))


def plan_from_json(value: Mapping[str, Any]) -> FaultPlan:
    """A :class:`FaultPlan` from its JSON form (``status`` by name or number)."""
    unknown = set(value) - _FIELDS
    if unknown:
        raise ValueError(f"unknown fault field(s): {', '.join(sorted(unknown))}")
    options = dict(value)
    status = options.get("status")
    if status is not None:
        options["status"] = parse_status(str(status))
    return FaultPlan(**options)


def plan_to_json(plan: FaultPlan) -> dict[str, Any]:
    """The JSON form of ``plan``, ``status`` by name."""
    value = dataclasses.asdict(plan)
    value["status"] = plan.status.name if plan.status is not None else None
    return value


def state_of(engine: SimEngine) -> dict[str, Any]:
    """What ``get`` reports: faults, what they hit, and the engine's own counters."""
    stats = engine.stats
    return {
        "faults": plan_to_json(engine.faults),
        "fault_stats": dataclasses.asdict(engine.fault_stats),
        "listening": engine.listening,
        "healthy": engine.healthy,
        "port": engine.port,
        "running": stats.running,
        "waiting": stats.waiting,
        "requests": stats.requests,
        "completed": stats.completed,
        "embeds": stats.embeds,
    }


async def apply(engine: SimEngine, command: Mapping[str, Any]) -> dict[str, Any]:
    """Run one control command against ``engine`` and build its reply."""
    op = command.get("op")
    if op == "set_faults":
        faults = command.get("faults", {})
        if not isinstance(faults, Mapping):
            raise ValueError("faults must be an object")
        engine.faults = plan_from_json(faults)
    elif op == "stop_listening":
        await engine.stop_listening()
    elif op == "resume_listening":
        await engine.resume_listening()
    elif op == "restart":
        await engine.restart()
    elif op == "set_healthy":
        engine.healthy = bool(command.get("healthy", True))
    elif op != "get":
        raise ValueError(f"unknown op {op!r}")
    return {"ok": True, **state_of(engine)}


async def serve_control(engine: SimEngine, host: str, port: int) -> asyncio.Server:
    """Listen for control connections on ``host:port`` (0 picks a port)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    command = json.loads(line)
                    if not isinstance(command, dict):
                        raise ValueError("a command is a JSON object")
                    reply = await apply(engine, command)
                except (ValueError, TypeError, RuntimeError) as exc:
                    reply = {"ok": False, "error": str(exc)}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except ConnectionError:
            pass  # the controller went away
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port)


def control_request(
    host: str, port: int, command: Mapping[str, Any], *, timeout: float = 10.0
) -> dict[str, Any]:
    """Send one command and return the reply (blocking: for tests and scripts)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(json.dumps(command).encode() + b"\n")
        with sock.makefile("rb") as replies:
            reply = json.loads(replies.readline())
    if not isinstance(reply, dict):
        raise ValueError(f"unexpected control reply {reply!r}")
    return reply
