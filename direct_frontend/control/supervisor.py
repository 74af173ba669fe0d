"""The control plane's root: engine incarnations under supervision, and the catalog they feed.

Reads top-down: :meth:`Supervisor.run` starts one task per engine
incarnation and then waits for reloads; :meth:`Supervisor.apply` (called with
a validated, diffed fleet) retires removed and changed engines and starts
added and changed ones, without awaiting anything, so one slow engine never
delays a reload. Every state change republishes the catalog, an immutable
snapshot the data plane reads without locks.

An incarnation (:class:`EngineChild`, one numbered life of an engine id) runs
``joining → serving ⇄ unhealthy`` under crash-restart with backoff; retiring
it cancels its probes at once (``draining``: out of the catalog), waits for
its in-flight requests or the drain timeout, closes its channel and ends
(``gone``). Callbacks and faults are matched by incarnation, so a late one
from a retired incarnation never touches its successor on the same URL.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import trio

from direct_frontend.control.child import EngineChild
from direct_frontend.control.embedded import SimulatorPool
from direct_frontend.control.kv_plane import KvPlane
from direct_frontend.control.lifecycle import EngineState
from direct_frontend.errors import EngineError
from direct_frontend.fleet.schema import EngineConfig, FleetConfig
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
    draining ones included (by incarnation, which is never reused).
    """

    def __init__(self, fleet: FleetConfig, *, kv: KvPlane | None = None) -> None:
        self.fleet = fleet
        self.kv = kv
        self.children: dict[str, EngineChild] = {}
        self.incarnations: dict[int, EngineChild] = {}
        self.catalog = Catalog()
        self.listeners: list[Listener] = []
        self._incarnation_numbers = itertools.count(1)
        self._retire: dict[int, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._sims = SimulatorPool(lambda: self.fleet.frontend)

    # -- data-plane hooks -------------------------------------------------------------

    def report_fault(self, engine: EngineHandle, error: EngineError) -> None:
        """A request saw ``engine`` fail; only the same incarnation is marked down."""
        child = self.incarnations.get(engine.incarnation)
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
            if (sim := self._sims.engine_of(child.incarnation)) is not None
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
        child = EngineChild(
            cfg, self.fleet.frontend, next(self._incarnation_numbers), self._on_change
        )
        self.children[cfg.name] = child
        self.incarnations[child.incarnation] = child
        self._retire[child.incarnation] = trio.Event()
        return child

    def _retire_child(self, name: str, reason: str) -> None:
        child = self.children.pop(name, None)
        if child is None:
            return
        child.retire(reason)
        self._retire[child.incarnation].set()

    async def _incarnation(
        self, child: EngineChild, fail_fast: bool,
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One incarnation from start to gone; every exit path closes and forgets it."""
        retire = self._retire[child.incarnation]
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
                          extra={"engine": child.name, "incarnation": child.incarnation})

    async def _supervise(self, child: EngineChild) -> None:
        for attempt in itertools.count():
            try:
                await child.run()
                return
            except Exception as exc:
                delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                log.exception(
                    "engine %s child crashed; restarting in %.1fs", child.name, delay,
                    extra={"engine": child.name, "incarnation": child.incarnation},
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
                        extra={"engine": child.name, "incarnation": child.incarnation},
                    )
                await trio.sleep(DRAIN_POLL_S)
        if scope.cancelled_caught:
            log.warning(
                "engine %s drain timed out after %.1fs with %d requests in flight",
                child.name, timeout, child.in_flight,
                extra={"engine": child.name, "incarnation": child.incarnation},
            )

    def _forget(self, child: EngineChild) -> None:
        """The incarnation ended (drained, or cancelled at shutdown): close and forget it.

        Synchronous, so it also runs in a cancelled task's ``finally``.
        """
        child.close_channel()
        reason = "drained" if child.state is EngineState.DRAINING else "stopped"
        child.gone(reason)  # listeners see ``gone`` while it is still registered
        self.incarnations.pop(child.incarnation, None)
        self._retire.pop(child.incarnation, None)
        if self.children.get(child.name) is child:
            del self.children[child.name]
        self._sims.release(child)
        self._publish()

    def _on_change(self, child: EngineChild, previous: EngineState) -> None:
        if self.incarnations.get(child.incarnation) is not child:
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
