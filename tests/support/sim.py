"""Simulated engines for tests: started on 127.0.0.1 (a free port), always closed afterwards.

Four arrangements, as the engines are used: on plain asyncio (:func:`run`,
:func:`serving`, :func:`connected`, :func:`started`); from Trio with a
trio-asyncio loop, as the daemon embeds them (:func:`run_trio`,
:func:`started_from_trio`); on an asyncio loop of its own beside a daemon
(:class:`EngineThread`); and as a standalone process (:func:`start_cli`).
Every wait polls a condition with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import trio
import trio_asyncio
from grpclib.client import Channel

from direct_frontend.simulator import EngineConfig, EngineKind, FaultPlan, SimEngine

HOST = "127.0.0.1"
#: the tests' small model: vocabulary size, EOS and the special ids the model never samples
VOCAB = 500
EOS = 2
SPECIAL = frozenset({0, 1, 3})

T = TypeVar("T")


# -- running a test body ---------------------------------------------------------------


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run one test body on a fresh asyncio loop (pytest-asyncio is not used)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Poll until ``predicate`` holds (engine bookkeeping settles asynchronously)."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def run_trio(body: Callable[[], Awaitable[T]], timeout: float = 60.0,
             clock: trio.abc.Clock | None = None) -> T:
    """One test body under Trio with a trio-asyncio loop (the daemon's arrangement), on
    ``clock`` if given (the asyncio loop's timers follow Trio's clock)."""

    async def main() -> T:
        with trio.fail_after(timeout):
            async with trio_asyncio.open_loop():
                return await body()

    return trio.run(main, clock=clock)


async def until_trio(predicate: Callable[[], bool], within: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` from Trio until it holds."""
    deadline = trio.current_time() + within
    while not predicate():
        if trio.current_time() > deadline:
            raise AssertionError(f"not reached in {within}s: {what or predicate}")
        await trio.sleep(0.002)


# -- engines in this process ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def started(engine: SimEngine) -> AsyncIterator[SimEngine]:
    """``engine`` listening on a free port of the running asyncio loop; closed afterwards."""
    await engine.start(HOST, 0)
    try:
        yield engine
    finally:
        engine.close()
        await engine.wait_closed()


@contextlib.asynccontextmanager
async def connected(engine: SimEngine) -> AsyncIterator[tuple[SimEngine, Channel]]:
    """``engine`` started, and a grpclib channel to it; both closed afterwards."""
    async with started(engine), Channel(HOST, engine.port) as channel:
        yield engine, channel


def serving(
    kind: EngineKind, *, faults: FaultPlan | None = None, **options: Any
) -> contextlib.AbstractAsyncContextManager[tuple[SimEngine, Channel]]:
    """An engine of the tests' small model (``options`` may change any of it) and a channel."""
    model: dict[str, Any] = {
        "served_model_name": "sim-model",
        "vocab_size": VOCAB,
        "eos_token_id": EOS,
        "special_ids": SPECIAL,
    }
    return connected(SimEngine(EngineConfig(kind, **{**model, **options}), faults=faults))


@contextlib.asynccontextmanager
async def started_from_trio(engine: SimEngine) -> AsyncIterator[SimEngine]:
    """:func:`started`, from Trio code running a trio-asyncio loop."""
    await trio_asyncio.aio_as_trio(engine.start)(HOST, 0)
    try:
        yield engine
    finally:
        engine.close()
        await trio_asyncio.aio_as_trio(engine.wait_closed)()


class EngineThread:
    """``engine`` on an asyncio loop and thread of its own, outside any daemon.

    Like a separate process to a daemon in the same test: it can be stopped,
    restarted and started again on the same ports (gRPC and KV events).
    """

    def __init__(self, engine: SimEngine, host: str = HOST, port: int = 0) -> None:
        self.engine = engine
        self.host, self.port = host, port
        self.loop = asyncio.SelectorEventLoop()  # a plain one, whatever policy trio-asyncio set
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine", daemon=True)

    def __enter__(self) -> EngineThread:
        self._thread.start()
        self.call(self.engine.start, self.host, self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine's loop and wait for it."""

        async def call() -> T:
            return await fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)

    def stop(self) -> None:
        """Stop like a killed process: connections dropped, ports free (idempotent)."""

        async def stop() -> None:
            self.engine.close()
            await self.engine.wait_closed()

        self.call(stop)

    def start(self) -> None:
        """Start again on the same ports, as a relaunched process (empty cache, seq 0)."""
        self.call(self.engine.start, self.host, self.engine.port)

    def restart(self) -> None:
        """Stop and start again at once (:meth:`SimEngine.restart`)."""
        self.call(self.engine.restart)


# -- a standalone engine process ----------------------------------------------------------


def cli_command(kind: EngineKind, *flags: str, vocab_size: int = VOCAB) -> list[str]:
    """The command line of a standalone simulated engine on a free port, plus ``flags``."""
    return [
        sys.executable,
        "-m",
        "direct_frontend.simulator.cli",
        kind,
        "--port",
        "0",
        "--vocab-size",
        str(vocab_size),
        "--eos-token-id",
        str(EOS),
        *flags,
    ]


def start_cli(kind: EngineKind, *flags: str) -> tuple[subprocess.Popen[str], list[int]]:
    """A standalone engine, once listening, and the ports it printed (engine, then control)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = cli_command(kind, *flags)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    ports = []
    try:
        for _ in range(2 if "--control-port" in flags else 1):
            line = process.stdout.readline()
            assert "listening on 127.0.0.1:" in line, line
            ports.append(int(line.rsplit(":", 1)[1]))
    except BaseException:
        process.kill()
        process.wait()
        process.stdout.close()
        raise
    return process, ports


def stop_cli(process: subprocess.Popen[str]) -> None:
    """SIGTERM, then the clean exit (status 0) a standalone engine owes it."""
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
