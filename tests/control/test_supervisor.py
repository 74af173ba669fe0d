"""The supervisor on its own (no HTTP): what the data plane may wait on, and why engines wait.

A real :class:`Supervisor` under Trio with a trio-asyncio loop, engines
simulated on loopback and started or stopped by the test at the moment it
needs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio_asyncio

from direct_frontend.control.supervisor import Supervisor
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.load import parse_fleet
from direct_frontend.fleet.schema import FleetConfig
from direct_frontend.simulator import EngineConfig, SimEngine
from tests.support.daemon import fleet_text, free_port
from tests.support.sim import EOS, HOST, VOCAB, run_trio, until_trio


def fleet_of(model_dir: Path, tmp_path: Path, port: int, probe: str = "") -> FleetConfig:
    engine = {"name": "e", "url": f"grpc://{HOST}:{port}", "kind": "sglang"}
    return parse_fleet(fleet_text(model_dir, [engine], probe=probe), tmp_path / "fleet.toml")


def supervised(fleet: FleetConfig, body: Callable[[Supervisor], Awaitable[None]],
               on_load_change: Callable[[], None] | None = None) -> None:
    """Run ``body`` beside a started supervisor of ``fleet``; everything stops afterwards."""

    async def main() -> None:
        supervisor = Supervisor(fleet, on_load_change=on_load_change)
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            await body(supervisor)
            nursery.cancel_scope.cancel()

    run_trio(main, timeout=30)


async def start_engine(port: int, served_model_name: str = "demo") -> SimEngine:
    engine = SimEngine(EngineConfig("sglang", served_model_name, VOCAB, EOS))
    await trio_asyncio.aio_as_trio(engine.start)(HOST, port)
    return engine


async def stop_engine(engine: SimEngine) -> None:
    engine.close()
    await trio_asyncio.aio_as_trio(engine.wait_closed)()


def test_the_data_plane_can_wait_for_an_engine_and_for_the_next_catalog(
    model_dir: Path, tmp_path: Path,
) -> None:
    port = free_port()

    async def body(supervisor: Supervisor) -> None:
        empty = supervisor.catalog
        assert empty.engines == ()
        with trio.move_on_after(0.2) as waited:
            await supervisor.wait_for_serving()
        assert waited.cancelled_caught  # nothing serves: it waits (the caller bounds it)
        engine = await start_engine(port)
        try:
            with trio.fail_after(5):  # default probes: joins within a retry of its start
                catalog = await supervisor.wait_for_serving()
            assert [e.name for e in catalog.engines] == ["e"]
            assert catalog.version > empty.version
            assert await supervisor.wait_for_serving() is catalog  # at once while one serves
            assert await supervisor.wait_for_catalog(empty.version) is catalog  # already newer
            handle = catalog.engines[0]
            with trio.move_on_after(0.2) as waited:
                await supervisor.wait_for_catalog(catalog.version)
            assert waited.cancelled_caught  # no change, no wake-up
            handle.load.begin(10)
            handle.load.end(10)
            assert len(load_changes) == 2  # the replica link hears each change of its load

            async def fault_soon() -> None:  # runs once the wait below has begun
                supervisor.report_fault(handle, EngineError(ErrorKind.UNAVAILABLE, "gone"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fault_soon)
                with trio.fail_after(5):
                    after = await supervisor.wait_for_catalog(catalog.version)
            assert after.engines == () and after.version == catalog.version + 1
            with trio.fail_after(5):  # it still answers: probed fast, back on the first answer
                back = await supervisor.wait_for_serving()
            assert [e.incarnation for e in back.engines] == [handle.incarnation]
        finally:
            await stop_engine(engine)

    load_changes: list[None] = []
    supervised(fleet_of(model_dir, tmp_path, port), body, lambda: load_changes.append(None))


def test_while_no_engine_serves_one_that_is_out_is_tried_without_backoff(
    model_dir: Path, tmp_path: Path,
) -> None:
    port = free_port()

    async def body(supervisor: Supervisor) -> None:
        engine = await start_engine(port)
        with trio.fail_after(5):
            catalog = await supervisor.wait_for_serving()
        child = supervisor.children["e"]
        assert not child.hurry
        await stop_engine(engine)
        supervisor.report_fault(catalog.engines[0], EngineError(ErrorKind.UNAVAILABLE, "gone"))
        assert supervisor.catalog.engines == () and child.hurry
        probes: list[float] = []

        def probed(count: int) -> bool:
            if child.last_probe is not None and child.last_probe.at not in probes:
                probes.append(child.last_probe.at)
            return len(probes) >= count

        await until_trio(lambda: probed(1), what="the first probe")
        started = trio.current_time()
        await until_trio(lambda: probed(9), what="eight more probes")
        # 8 × 50 ms; backing off (0.1, 0.2, 0.4, then 0.5 s) they would take over 2.5 s
        assert trio.current_time() - started < 1.5
        engine = await start_engine(port)
        try:
            with trio.fail_after(5):
                await supervisor.wait_for_serving()
            assert not child.hurry
        finally:
            await stop_engine(engine)

    supervised(fleet_of(model_dir, tmp_path, port), body)


def test_an_engine_that_does_not_join_says_why_once_and_again_when_the_reason_changes(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    caplog.set_level(logging.WARNING, logger="direct_frontend.engine")

    def reasons() -> list[str]:
        return [r.getMessage() for r in caplog.records if "has not joined" in r.getMessage()]

    async def body(supervisor: Supervisor) -> None:
        child = supervisor.children["e"]
        await until_trio(lambda: child.join_failures >= 4, what="a few failed tries")
        (refused,) = reasons()  # nothing listens: said once, not once a try
        assert refused.startswith("engine e has not joined: unavailable: transport:")
        assert "Connect" in refused
        other = await start_engine(port, served_model_name="another-model")
        try:
            await until_trio(lambda: child.state.value == "refused", what="e to be refused")
            tries = child.join_failures
            await until_trio(lambda: child.join_failures >= tries + 3, what="more tries")
            assert reasons() == [
                refused,
                "engine e has not joined: serves model 'another-model', the fleet serves 'demo'",
            ]
        finally:
            await stop_engine(other)
        await until_trio(lambda: len(reasons()) == 3, what="the next change of reason")
        assert reasons()[2].startswith("engine e has not joined: unavailable: transport:")
        assert child.state.value == "joining"

    supervised(fleet_of(model_dir, tmp_path, port, "interval_s = 0.05\ntimeout_s = 1.0"), body)


def test_an_engine_of_another_kind_is_named_as_the_likely_cause(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A vLLM engine in an [[engine]] of kind sglang answers "Method not found!" to discovery.

    ``last_error`` is what /fleet shows for the engine; the log line says it too.
    """
    port = free_port()
    caplog.set_level(logging.WARNING, logger="direct_frontend.engine")

    async def body(supervisor: Supervisor) -> None:
        child = supervisor.children["e"]
        engine = SimEngine(EngineConfig("vllm", "demo", VOCAB, EOS))
        await trio_asyncio.aio_as_trio(engine.start)(HOST, port)
        try:
            await until_trio(lambda: "UNIMPLEMENTED" in child.last_error,
                             what="discovery to be refused")
        finally:
            await stop_engine(engine)
        assert child.last_error.endswith(
            "(is this engine a sglang? check the [[engine]] kind (sglang, vllm, trtllm))")
        assert child.state.value == "joining"
        logged = [r.getMessage() for r in caplog.records if "has not joined" in r.getMessage()]
        assert any("is this engine a sglang?" in line for line in logged)

    supervised(fleet_of(model_dir, tmp_path, port, "interval_s = 0.05\ntimeout_s = 1.0"), body)
