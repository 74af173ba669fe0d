"""The control plane's root: engine incarnations under supervision, and the catalog they feed.

Reads top-down: :meth:`Supervisor.run` starts one task per engine
incarnation and then waits for reloads; :meth:`Supervisor.apply` (called with
a validated, diffed fleet) retires removed and changed engines and starts
added and changed ones, without awaiting anything, so one slow engine never
delays a reload. Every state change republishes the catalog, an immutable
snapshot the data plane reads without locks.

An incarnation (:class:`EngineChild`, one *generation* of an engine id) runs
``joining → serving ⇄ unhealthy`` under crash-restart with backoff; retiring
it cancels its probes at once (``draining``: out of the catalog), waits for
its in-flight requests or the drain timeout, closes its channel and ends
(``gone``). Callbacks and faults are matched by generation, so a late one
from a retired incarnation never touches its successor on the same URL.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import trio

from direct_frontend.engines.child import EngineChild, host_port
from direct_frontend.engines.lifecycle import EngineState
from direct_frontend.errors import EngineError
from direct_frontend.fleet.schema import EngineConfig, FleetConfig, FrontendConfig
from direct_frontend.kv.plane import KvPlane
from direct_frontend.routing.catalog import Catalog, EngineHandle

log = logging.getLogger("direct_frontend.supervisor")

RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)
#: How often a drain looks at the in-flight count. Idle must be seen twice in a row, so a
#: request that picked the engine from the previous catalog has started before we close.
DRAIN_POLL_S = 0.05

Listener = Callable[[EngineChild, EngineState], None]


class Supervisor:
    """Owns the engine incarnations and publishes the catalog.

    ``children`` holds the current incarnation of each engine in the fleet
    file (by name); ``incarnations`` holds every incarnation still alive,
    draining ones included (by generation, which is never reused).
    """

    def __init__(self, fleet: FleetConfig, *, kv: KvPlane | None = None) -> None:
        self.fleet = fleet
        self.kv = kv
        self.children: dict[str, EngineChild] = {}
        self.incarnations: dict[int, EngineChild] = {}
        self.catalog = Catalog()
        self.listeners: list[Listener] = []
        self._generations = itertools.count(1)
        self._retire: dict[int, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._sims = SimulatorPool(lambda: self.fleet.frontend)

    # -- data-plane hooks -------------------------------------------------------------

    def report_fault(self, engine: EngineHandle, error: EngineError) -> None:
        """A request saw ``engine`` fail; only the same incarnation is marked down."""
        child = self.incarnations.get(engine.generation)
        if child is not None and child.name == engine.name:
            child.report_fault(error)

    @property
    def serving_count(self) -> int:
        return len(self.catalog.engines)

    @property
    def simulators(self) -> dict[str, Any]:
        """The embedded simulated engines of the current incarnations, by engine name."""
        return {
            name: sim
            for name, child in self.children.items()
            if (sim := self._sims.engine_of(child.generation)) is not None
        }

    def draining(self) -> list[EngineChild]:
        return [c for c in self.incarnations.values() if c.state is EngineState.DRAINING]

    # -- control plane ----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the fleet's engines (their simulators listening), then serve reloads."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for cfg in self.fleet.engines:
                # At start-up a simulator that cannot listen fails the daemon: fail fast.
                await nursery.start(self._incarnation, self._new_child(cfg), True)
            self._publish()
            task_status.started()
            await trio.sleep_forever()  # reloads add incarnations to this nursery

    def apply(self, fleet: FleetConfig, *, removed: Iterable[str], changed: Iterable[str],
              added: Iterable[str]) -> None:
        """Switch to ``fleet`` (already validated): retire, then start; never blocks.

        Engines not named are left alone: same incarnation, channel and probe state.
        """
        assert self._nursery is not None, "apply() before run() started"
        old_probe = self.fleet.frontend.probe
        self.fleet = fleet
        by_name = {cfg.name: cfg for cfg in fleet.engines}
        changed = tuple(changed)
        for name in removed:
            self._retire_child(name, "removed from the fleet file")
        for name in changed:
            self._retire_child(name, "replaced: its settings changed")
        if fleet.frontend.probe != old_probe:
            for child in self.children.values():
                child.retune(fleet.frontend)
        for name in (*changed, *added):
            self._nursery.start_soon(self._incarnation, self._new_child(by_name[name]), False)
        self._publish()

    def _new_child(self, cfg: EngineConfig) -> EngineChild:
        child = EngineChild(cfg, self.fleet.frontend, next(self._generations), self._on_change)
        self.children[cfg.name] = child
        self.incarnations[child.generation] = child
        self._retire[child.generation] = trio.Event()
        return child

    def _retire_child(self, name: str, reason: str) -> None:
        child = self.children.pop(name, None)
        if child is None:
            return
        child.retire(reason)
        self._retire[child.generation].set()

    async def _incarnation(
        self, child: EngineChild, fail_fast: bool,
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One incarnation from start to gone; every exit path closes and forgets it."""
        retire = self._retire[child.generation]
        try:
            if child.cfg.simulate:
                await self._start_simulator(child, fail_fast)
            task_status.started()
            child.open_channel()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._supervise, child)
                if self.kv is not None:
                    nursery.start_soon(self.kv.run_for, child)
                await retire.wait()
                nursery.cancel_scope.cancel()
            await self._drain(child)
        finally:
            self._forget(child)

    async def _start_simulator(self, child: EngineChild, fail_fast: bool) -> None:
        assert self._nursery is not None
        try:
            await self._sims.acquire(self._nursery, child)
        except Exception as exc:
            if fail_fast:
                raise
            child.last_error = f"the embedded simulator did not start: {exc}"
            log.exception("engine %s: %s", child.name, child.last_error,
                          extra={"engine": child.name, "generation": child.generation})

    async def _supervise(self, child: EngineChild) -> None:
        for attempt in itertools.count():
            try:
                await child.run()
                return
            except Exception as exc:
                delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                log.exception(
                    "engine %s child crashed; restarting in %.1fs", child.name, delay,
                    extra={"engine": child.name, "generation": child.generation},
                )
                child.crashed(exc)
                await trio.sleep(delay)

    async def _drain(self, child: EngineChild) -> None:
        """Wait for the retired incarnation's requests, at most ``drain_timeout_s``."""
        timeout = self.fleet.frontend.drain_timeout_s
        migrate_after = self.fleet.frontend.faults.drain_migrate_after_s
        move_at = trio.current_time() + migrate_after if migrate_after > 0 else math.inf
        with trio.move_on_after(timeout) as scope:
            idle_polls = 0
            while idle_polls < 2:
                idle_polls = idle_polls + 1 if child.in_flight == 0 else 0
                if child.in_flight and trio.current_time() >= move_at:
                    move_at = math.inf  # once: streams that cannot move finish here
                    moved = child.load.move_all()
                    log.info(
                        "engine %s still has %d streams after %.1fs of draining: "
                        "migrating %d to other engines", child.name, child.in_flight,
                        migrate_after, moved,
                        extra={"engine": child.name, "generation": child.generation},
                    )
                await trio.sleep(DRAIN_POLL_S)
        if scope.cancelled_caught:
            log.warning(
                "engine %s drain timed out after %.1fs with %d requests in flight",
                child.name, timeout, child.in_flight,
                extra={"engine": child.name, "generation": child.generation},
            )

    def _forget(self, child: EngineChild) -> None:
        """The incarnation ended (drained, or cancelled at shutdown): close and forget it.

        Synchronous, so it also runs in a cancelled task's ``finally``.
        """
        child.close_channel()
        reason = "drained" if child.state is EngineState.DRAINING else "stopped"
        child.gone(reason)  # listeners see ``gone`` while it is still registered
        self.incarnations.pop(child.generation, None)
        self._retire.pop(child.generation, None)
        if self.children.get(child.name) is child:
            del self.children[child.name]
        self._sims.release(child)
        self._publish()

    def _on_change(self, child: EngineChild, previous: EngineState) -> None:
        if self.incarnations.get(child.generation) is not child:
            return  # a late callback from an incarnation already forgotten
        if self.kv is not None:
            if child.state is EngineState.UNHEALTHY:
                self.kv.fence(child, "the engine is unhealthy")
            elif child.state is EngineState.SERVING:
                self.kv.note_serving(child)
        self._publish()
        for listener in self.listeners:
            listener(child, previous)

    def _publish(self) -> None:
        serving = tuple(
            child.handle
            for child in self.children.values()
            if child.state is EngineState.SERVING and child.handle is not None
        )
        if serving != self.catalog.engines:
            self.catalog = Catalog(self.catalog.version + 1, serving)


# -- embedded simulators ------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _SimSlot:
    """One simulator listening on one port, shared by the incarnations that fit it."""

    key: Hashable
    users: set[int] = dataclasses.field(default_factory=set)  # generations
    engine: Any = None
    stop: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    stopped: trio.Event = dataclasses.field(default_factory=trio.Event)


class SimulatorPool:
    """Embedded simulators (``simulate = true``), one per port, reference-counted.

    A replaced engine whose simulator settings did not change keeps the same
    simulator (its requests in flight survive); one whose settings changed
    gets a new simulator once the old incarnation has drained off the port.
    """

    def __init__(self, frontend: Callable[[], FrontendConfig]) -> None:
        self._frontend = frontend
        self._slots: dict[int, _SimSlot] = {}
        self._locks: dict[int, trio.Lock] = {}
        self._by_generation: dict[int, _SimSlot] = {}

    def engine_of(self, generation: int) -> Any:
        slot = self._by_generation.get(generation)
        return None if slot is None else slot.engine

    def _key(self, cfg: EngineConfig) -> Hashable:
        frontend = self._frontend()
        return (cfg.kind, cfg.role, cfg.simulator, str(frontend.tokenizer),
                frontend.served_model_name)

    async def acquire(self, nursery: trio.Nursery, child: EngineChild) -> None:
        port = host_port(child.cfg.url)[1]
        key = self._key(child.cfg)
        async with self._locks.setdefault(port, trio.Lock()):
            while (slot := self._slots.get(port)) is not None and slot.key != key:
                await slot.stopped.wait()  # the previous incarnation is still draining
            if slot is None:
                slot = _SimSlot(key)
                self._slots[port] = slot
                try:
                    await nursery.start(self._serve, port, child.cfg, slot)
                except BaseException:
                    self._slots.pop(port, None)
                    raise
            slot.users.add(child.generation)
            self._by_generation[child.generation] = slot

    def release(self, child: EngineChild) -> None:
        slot = self._by_generation.pop(child.generation, None)
        if slot is None:
            return
        slot.users.discard(child.generation)
        if not slot.users:
            slot.stop.cancel()

    async def _serve(
        self, port: int, cfg: EngineConfig, slot: _SimSlot,
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            with slot.stop:
                slot.engine = await start_embedded_simulator(self._frontend(), cfg)
                try:
                    task_status.started()
                    await trio.sleep_forever()
                finally:
                    await stop_embedded_simulator(slot.engine)
        finally:
            if self._slots.get(port) is slot:
                del self._slots[port]
            slot.stopped.set()


async def start_embedded_simulator(frontend: FrontendConfig, cfg: EngineConfig) -> Any:
    """Serve a simulated engine on the engine's own URL, over real gRPC on loopback."""
    import trio_asyncio

    from direct_frontend.simulator.engine import SimEngine
    from direct_frontend.simulator.model import TimingModel

    host, port = host_port(cfg.url)
    sim = cfg.simulator
    engine = SimEngine.from_model_dir(
        cfg.kind,
        frontend.tokenizer,
        served_model_name=sim.served_model_name or frontend.served_model_name,
        context_length=sim.context_length,
        role=cfg.role.value,
        vocab_size=sim.vocab_size,
        timing=TimingModel(sim.prefill_us_per_token, sim.decode_us_per_token, sim.max_running),
        eos_probability=sim.eos_probability,
        block_size=cfg.block_size or 16,
        page_size=cfg.block_size or 16,
        # publish KV events where the fleet file says the engine publishes them (rank 0)
        kv_events_port=_port_of(cfg.kv_events[0]) if cfg.kv_events else None,
        kv_replay_port=_port_of(cfg.kv_replay[0]) if cfg.kv_replay else None,
    )
    await trio_asyncio.aio_as_trio(engine.start)(host, port)
    log.info("simulated %s engine listening on %s:%d", cfg.kind, host, port)
    return engine


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


async def stop_embedded_simulator(engine: Any) -> None:
    """Close like a dying process; bounded, and done even when we are being cancelled."""
    import trio_asyncio

    engine.close()
    with trio.CancelScope(shield=True), trio.move_on_after(2):
        await trio_asyncio.aio_as_trio(engine.wait_closed)()
