"""The control plane's root: engine children under supervision, and the catalog they feed.

Reads top-down: :meth:`Supervisor.run` starts the embedded simulators (for
``simulate = true`` engines), then one supervised child per engine. Every
child state change republishes the catalog, an immutable snapshot the data
plane reads without locks. A child that crashes is logged and restarted with
backoff; it never takes down the daemon or another engine.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import trio

from direct_frontend.engines.child import EngineChild
from direct_frontend.engines.lifecycle import EngineState
from direct_frontend.errors import EngineError
from direct_frontend.fleet.schema import EngineConfig, FleetConfig
from direct_frontend.routing.catalog import Catalog, EngineHandle

log = logging.getLogger("direct_frontend.supervisor")

RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)


class Supervisor:
    """Owns the engine children and publishes the catalog."""

    def __init__(self, fleet: FleetConfig) -> None:
        self.fleet = fleet
        self.children: dict[str, EngineChild] = {}
        self.catalog = Catalog()
        self.listeners: list[Callable[[EngineChild], None]] = []
        self._generations = itertools.count(1)
        self._scopes: dict[str, trio.CancelScope] = {}
        self.simulators: dict[str, Any] = {}  # embedded simulated engines, by engine name

    # -- data-plane hooks -------------------------------------------------------------

    def report_fault(self, engine: EngineHandle, error: EngineError) -> None:
        """A request saw ``engine`` fail; only the same incarnation is marked down."""
        child = self.children.get(engine.name)
        if child is not None and child.generation == engine.generation:
            child.report_fault(error)

    @property
    def serving_count(self) -> int:
        return len(self.catalog.engines)

    # -- control plane ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for cfg in self.fleet.engines:
                if cfg.simulate:
                    self.simulators[cfg.name] = await nursery.start(
                        run_embedded_simulator, self.fleet, cfg
                    )
            for cfg in self.fleet.engines:
                self._start_child(nursery, cfg)
            task_status.started()

    def _start_child(self, nursery: trio.Nursery, cfg: EngineConfig) -> None:
        child = EngineChild(cfg, self.fleet.frontend, next(self._generations), self._on_change)
        self.children[cfg.name] = child
        scope = trio.CancelScope()
        self._scopes[cfg.name] = scope
        nursery.start_soon(self._supervise, child, scope)

    async def _supervise(self, child: EngineChild, scope: trio.CancelScope) -> None:
        with scope:
            for attempt in itertools.count():
                try:
                    await child.run()
                    return
                except Exception:
                    child.restarts += 1
                    delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                    log.exception(
                        "engine %s child crashed; restarting in %.1fs", child.name, delay,
                        extra={"engine": child.name, "generation": child.generation},
                    )
                    child.state = EngineState.JOINING
                    child.handle = None
                    self._publish()
                    await trio.sleep(delay)

    def _on_change(self, child: EngineChild) -> None:
        if self.children.get(child.name) is not child:
            return  # a late callback from an older incarnation
        self._publish()
        for listener in self.listeners:
            listener(child)

    def _publish(self) -> None:
        serving = tuple(
            child.handle
            for child in self.children.values()
            if child.state is EngineState.SERVING and child.handle is not None
        )
        self.catalog = Catalog(self.catalog.version + 1, serving)


async def run_embedded_simulator(
    fleet: FleetConfig, cfg: EngineConfig, *, task_status: trio.TaskStatus[Any]
) -> None:
    """Serve a simulated engine on the engine's own URL, over real gRPC on loopback."""
    import trio_asyncio

    from direct_frontend.engines.child import host_port
    from direct_frontend.simulator.engine import SimEngine
    from direct_frontend.simulator.model import TimingModel

    host, port = host_port(cfg.url)
    sim = cfg.simulator
    engine = SimEngine.from_model_dir(
        cfg.kind,
        fleet.frontend.tokenizer,
        served_model_name=sim.served_model_name or fleet.frontend.served_model_name,
        context_length=sim.context_length,
        role=cfg.role.value,
        vocab_size=sim.vocab_size,
        timing=TimingModel(sim.prefill_us_per_token, sim.decode_us_per_token, sim.max_running),
        eos_probability=sim.eos_probability,
    )
    await trio_asyncio.aio_as_trio(engine.start)(host, port)
    log.info("simulated %s engine listening on %s:%d", cfg.kind, host, port)
    task_status.started(engine)
    try:
        await trio.sleep_forever()
    finally:
        engine.close()
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            await trio_asyncio.aio_as_trio(engine.wait_closed)()
