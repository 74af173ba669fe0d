"""The control plane's root: engine incarnations under supervision, and the catalog they feed.

Reads top-down: :meth:`Supervisor.run` starts one task per engine
incarnation and then waits for reloads; :meth:`Supervisor.apply` (called with
a validated, diffed fleet) starts added and changed engines and sends removed
and changed ones on their way out, without awaiting anything, so one slow
engine never delays a reload. Every state change republishes the catalog, an
immutable snapshot the data plane reads without locks (and may wait on:
:meth:`Supervisor.wait_for_catalog`, :meth:`Supervisor.wait_for_serving`).

An incarnation (:class:`EngineChild`, one numbered life of an engine id) runs
``joining → serving ⇄ unhealthy`` under crash-restart with backoff. An edit
makes before it breaks: an incarnation on its way out keeps serving until
the engines that take over have joined (:func:`may_leave`, at most
``join_timeout_s``); then it retires: its probes stop (``draining``: out of
the catalog), it waits for its in-flight requests or the drain timeout,
closes its channel and ends (``gone``). Callbacks and faults are matched by
incarnation, so a late one from a retired incarnation never touches its
successor on the same URL.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import trio

from direct_frontend.control.child import EngineChild
from direct_frontend.control.embedded import SimulatorPool
from direct_frontend.control.kv_plane import KvPlane
from direct_frontend.control.lifecycle import EngineState, may_leave
from direct_frontend.errors import EngineError
from direct_frontend.fleet.schema import EngineConfig, FleetConfig
from direct_frontend.routing.catalog import Catalog, EngineHandle

log = logging.getLogger("direct_frontend.supervisor")

RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)
#: How often a drain looks at the in-flight count. Idle must be seen twice in a row, so a
#: request that picked the engine from the previous catalog has started before we close.
DRAIN_POLL_S = 0.05

Listener = Callable[[EngineChild, EngineState], None]
FaultListener = Callable[[EngineHandle, EngineError], None]


class _Pulse:
    """Wakes everyone waiting when something changed (no value: waiters look for themselves).

    Check, then :meth:`wait`, with no checkpoint between: a change can never
    fall in the gap, since Trio switches tasks only at checkpoints.
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclasses.dataclass(eq=False)
class _Exit:
    """How one incarnation leaves: sent on its way by an edit, then retired."""

    leaving: trio.Event = dataclasses.field(default_factory=trio.Event)
    retired: trio.Event = dataclasses.field(default_factory=trio.Event)
    reason: str = ""
    awaits: tuple[str, ...] = ()  # the engines (by name) that must join before it leaves
    deadline: float = math.inf  # trio time: it leaves by then whatever they do


class Supervisor:
    """Owns the engine incarnations and publishes the catalog.

    ``children`` holds the current incarnation of each engine in the fleet
    file (by name); ``incarnations`` holds every incarnation still alive,
    outgoing ones included (by incarnation, which is never reused).
    """

    def __init__(self, fleet: FleetConfig, *, kv: KvPlane | None = None,
                 on_load_change: Callable[[], None] | None = None) -> None:
        self.fleet = fleet
        self.kv = kv
        self.children: dict[str, EngineChild] = {}
        self.incarnations: dict[int, EngineChild] = {}
        self.catalog = Catalog()
        self.listeners: list[Listener] = []
        #: told of every transport fault a request of ours saw (the replica link shares them)
        self.fault_listeners: list[FaultListener] = []
        #: told whenever a serving engine's in-flight count changes (the replica link)
        self.on_load_change = on_load_change
        self._incarnation_numbers = itertools.count(1)
        self._exits: dict[int, _Exit] = {}
        self._changed = _Pulse()  # any engine state or the catalog changed
        self._settling = False
        self._nothing_serves = True
        self._nursery: trio.Nursery | None = None
        self._sims = SimulatorPool(lambda: self.fleet)

    # -- data-plane hooks -------------------------------------------------------------

    def report_fault(self, engine: EngineHandle, error: EngineError) -> None:
        """A request saw ``engine`` fail; only the same incarnation is marked down."""
        child = self.incarnations.get(engine.incarnation)
        if child is not None and child.name == engine.name:
            child.report_fault(error)
            for listener in self.fault_listeners:
                listener(engine, error)

    def report_peer_fault(self, name: str, url: str, error: EngineError) -> bool:
        """A sibling replica saw engine ``name`` at ``url`` fail: act as if we had.

        Matched by name and URL (incarnation numbers are per replica); the
        engine comes back through its probes as after a fault of our own.
        Returns whether a serving engine was taken out.
        """
        child = self.children.get(name)
        if child is None or child.cfg.url != url or child.state is not EngineState.SERVING:
            return False
        child.report_fault(error)
        return child.state is not EngineState.SERVING

    @property
    def serving_count(self) -> int:
        """Engines (by name) the catalog offers, outgoing ones still serving included."""
        return len({engine.name for engine in self.catalog.engines})

    async def wait_for_catalog(self, newer_than: int) -> Catalog:
        """The catalog, once its version is past ``newer_than`` (at once if it already is).

        For a request that found no engine it could use in catalog
        ``newer_than``: the caller bounds the wait (``faults.wait_for_engine_s``).
        """
        while self.catalog.version <= newer_than:
            await self._changed.wait()
        return self.catalog

    async def wait_for_serving(self) -> Catalog:
        """The catalog, once at least one engine serves (at once if one does)."""
        while not self.catalog.engines:
            await self._changed.wait()
        return self.catalog

    @property
    def simulators(self) -> dict[str, Any]:
        """The embedded simulated engines of the current incarnations, by engine name."""
        return {
            name: sim
            for name, child in self.children.items()
            if (sim := self._sims.engine_of(child.incarnation)) is not None
        }

    def draining(self) -> list[EngineChild]:
        """Incarnations no longer in the fleet file that still run (serving on, or draining).

        One an edit sent away serves until the engines taking over have joined.
        """
        return [c for c in self.incarnations.values() if self.children.get(c.name) is not c]

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
        """Switch to ``fleet`` (already validated): start the new, send the old away; never blocks.

        A changed engine's old incarnation waits for its successor, a removed
        one for the engines the edit added (make before break, see
        :meth:`_settle_exits`). Engines not named are left alone: same
        incarnation, channel and probe state.
        """
        assert self._nursery is not None, "apply() before run() started"
        old_probe = self.fleet.frontend.probe
        self.fleet = fleet
        by_name = {cfg.name: cfg for cfg in fleet.engines}
        changed, added = tuple(changed), tuple(added)
        deadline = trio.current_time() + fleet.frontend.probe.join_timeout_s
        for name in removed:
            self._send_away(name, "removed from the fleet file", added, deadline)
        for name in changed:
            self._send_away(name, "replaced: its settings changed", (name,), deadline)
        if fleet.frontend.probe != old_probe:
            for child in self.children.values():
                child.retune(fleet.frontend)
        for name in (*changed, *added):
            self._nursery.start_soon(self._incarnation, self._new_child(by_name[name]), False)
        self._settle_exits()
        self._publish()

    def _new_child(self, cfg: EngineConfig) -> EngineChild:
        child = EngineChild(
            cfg, self.fleet.frontend, next(self._incarnation_numbers), self._on_change,
            lambda: self.fleet.models, self.on_load_change,
        )
        child.hurry_up(self._nothing_serves)
        self.children[cfg.name] = child
        self.incarnations[child.incarnation] = child
        self._exits[child.incarnation] = _Exit()
        return child

    def _send_away(self, name: str, reason: str, awaits: tuple[str, ...], deadline: float) -> None:
        """Take ``name``'s incarnation out of the fleet file; it serves on until it may leave."""
        child = self.children.pop(name, None)
        if child is None:
            return
        exit_ = self._exits[child.incarnation]
        exit_.reason, exit_.awaits, exit_.deadline = reason, awaits, deadline
        exit_.leaving.set()

    def _settle_exits(self) -> None:
        """Retire every outgoing incarnation that :func:`may_leave` lets go (on every change).

        One at a time, each seeing the ones before it gone from the catalog,
        so outgoing engines never all leave at once while others are coming.
        A retirement is itself a change: the guard keeps this to one pass.
        """
        if self._settling:
            return
        self._settling = True
        try:
            self._settle_exits_once()
        finally:
            self._settling = False

    def _settle_exits_once(self) -> None:
        for child in list(self.incarnations.values()):
            exit_ = self._exits.get(child.incarnation)
            if exit_ is None or not exit_.leaving.is_set() or exit_.retired.is_set():
                continue
            successors = [
                self.children[name].state for name in exit_.awaits if name in self.children
            ]
            waiting_for_port = [c for c in self.children.values()
                                if self._sims.blocks(child, c)]
            if may_leave(
                successors,
                serving=child.state is EngineState.SERVING,
                port_wanted=bool(waiting_for_port),
                others_serving=any(
                    e.incarnation != child.incarnation for e in self.catalog.engines
                ),
                others_coming=any(
                    c.state is EngineState.JOINING and c not in waiting_for_port
                    for c in self.children.values()
                ),
            ):
                self._retire(child, exit_.reason)

    def _retire(self, child: EngineChild, reason: str) -> None:
        """No new requests from now on: its task stops probing, drains, and ends."""
        exit_ = self._exits[child.incarnation]
        if not exit_.retired.is_set():
            exit_.retired.set()
            child.retire(reason)  # publishes (via _on_change)

    async def _incarnation(
        self, child: EngineChild, fail_fast: bool,
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One incarnation from start to gone; every exit path closes and forgets it.

        With ``fail_fast`` (start-up) an embedded simulator that cannot listen
        fails the daemon; later, it is tried again with backoff.
        """
        assert self._nursery is not None
        exit_ = self._exits[child.incarnation]
        try:
            simulator_started = False
            if child.cfg.simulate and fail_fast:
                await self._sims.acquire(self._nursery, child)
                simulator_started = True
            task_status.started()
            child.open_channel()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._live, child, child.cfg.simulate and not simulator_started)
                if self.kv is not None:
                    nursery.start_soon(self.kv.run_for, child)
                await exit_.leaving.wait()
                with trio.move_on_at(exit_.deadline):
                    await exit_.retired.wait()
                if not exit_.retired.is_set():
                    log.warning(
                        "engine %s: what replaces it has not joined in %.1fs; leaving anyway",
                        child.name, self.fleet.frontend.probe.join_timeout_s,
                        extra={"engine": child.name, "incarnation": child.incarnation},
                    )
                    self._retire(child, exit_.reason)
                nursery.cancel_scope.cancel()
            await self._drain(child)
        finally:
            self._forget(child)

    async def _live(self, child: EngineChild, start_simulator: bool) -> None:
        """The incarnation at work: its simulator listening (if it has one), then its child."""
        if start_simulator:
            await self._start_simulator(child)
        await self._supervise(child)

    async def _start_simulator(self, child: EngineChild) -> None:
        """Start the embedded simulator, again and again with backoff until it listens.

        Why it does not is logged once, and again whenever the reason changes.
        """
        assert self._nursery is not None
        logged = ""
        for attempt in itertools.count():
            try:
                await self._sims.acquire(self._nursery, child)
                return
            except Exception as exc:
                delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                child.last_error = f"the embedded simulator did not start: {exc}"
                if child.last_error != logged:
                    logged = child.last_error
                    log.warning(
                        "engine %s: %s; trying again in %.1fs, then with backoff",
                        child.name, logged, delay,
                        extra={"engine": child.name, "incarnation": child.incarnation},
                    )
                await trio.sleep(delay)

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
        self._exits.pop(child.incarnation, None)
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
        self._settle_exits()
        self._changed.fire()

    def _publish(self) -> None:
        """A new catalog when the serving incarnations changed (outgoing ones included)."""
        serving = tuple(
            child.handle
            for child in self.incarnations.values()
            if child.state is EngineState.SERVING and child.handle is not None
        )
        if serving != self.catalog.engines:
            self.catalog = Catalog(self.catalog.version + 1, serving)
            self._changed.fire()
        if self._nothing_serves != (not serving):
            self._nothing_serves = not serving
            for child in self.incarnations.values():
                child.hurry_up(self._nothing_serves)
