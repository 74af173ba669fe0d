"""Reloads and the fleet view: what ``/fleet``, ``/fleet/events`` and SIGHUP reach.

A reload reads and validates the whole file first (a bad file changes
nothing), diffs it against the running fleet and applies it without awaiting
any engine: the supervisor gets the engine changes, and the data plane a new
:class:`~direct_frontend.pipeline.settings.Settings` snapshot, published whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from direct_frontend.control.child import EngineChild
from direct_frontend.control.events import EventHub, Subscriber
from direct_frontend.control.lifecycle import EngineState
from direct_frontend.control.model_builder import ModelBuilder
from direct_frontend.control.pods import PodDiscovery
from direct_frontend.control.supervisor import Supervisor
from direct_frontend.fleet.describe import JsonValue, to_jsonable
from direct_frontend.fleet.diff import (
    RESTART_FIELDS,
    FleetDiff,
    ReloadResult,
    diff_engines,
    diff_fleets,
)
from direct_frontend.fleet.load import parse_fleet_bytes
from direct_frontend.fleet.pools import merge_pool_engines
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import EngineConfig, FleetConfig, FrontendConfig
from direct_frontend.observability.metrics import Metrics
from direct_frontend.observability.sdnotify import Notifier
from direct_frontend.pipeline.models import ModelTable, ServedModel
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.peers import PlacementShare

if TYPE_CHECKING:
    from direct_frontend.control.replicas import ReplicaLink

log = logging.getLogger("direct_frontend")


def engine_status(child: EngineChild) -> dict[str, JsonValue]:
    """One incarnation for ``/fleet`` and the events stream (no secrets here)."""
    probe = child.last_probe
    handle = child.handle
    channel = child.channel
    return {
        "name": child.name,
        "id": child.id,
        "url": child.cfg.url,
        "kind": child.cfg.kind,
        "role": (handle.role if handle is not None else child.cfg.role).value,
        "state": child.state.value,
        "incarnation": child.incarnation,
        "model": child.info.served_model_name if child.info is not None else None,
        "kv_capacity_tokens": child.info.kv_capacity_tokens if child.info is not None else None,
        # "embeddings": an embedding model's engine (it serves /v1/embeddings, not generation)
        "serves": None if child.info is None else (
            "generation" if child.info.generates else "embeddings"),
        "load": child.in_flight,
        # KV-aware routing pins requests to these data-parallel ranks ([]: the engine balances):
        # ours pinned there, and the others' there as of the engine's last load report
        "dp_ranks": [] if handle is None else [
            {"rank": rank, "load": child.load.rank_in_flight.get(rank, 0),
             "foreign_load": child.load.rank_others.get(rank, 0)}
            for rank in handle.dp_ranks],
        "foreign_load": child.load.foreign_in_flight,
        "requests": child.load.requests_total,
        "last_probe": None if probe is None else {
            "ok": probe.ok, "message": probe.message, "at": probe.at,
        },
        "last_error": child.last_error or None,
        "since": child.since,
        "restarts": child.restarts,
        "connections_opened": channel.connections_opened if channel is not None else 0,
        "simulated": child.cfg.simulate,
        "pool": child.cfg.pool,
        "pod_uid": child.cfg.pod_uid,
    }



def file_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]


#: ``RESTART_FIELDS`` names as the fleet file spells them, where the schema splits one
_SCHEMA_FIELDS = {"listen": ("listen_host", "listen_port")}


def keep_restart_fields(new: FrontendConfig, running: FrontendConfig) -> FrontendConfig:
    """``new`` with the settings that need a restart (``RESTART_FIELDS``) kept as running."""
    names = [field for name in RESTART_FIELDS for field in _SCHEMA_FIELDS.get(name, (name,))]
    return dataclasses.replace(new, **{name: getattr(running, name) for name in names})


class ControlPlane:
    """Reloads and the fleet view: what ``/fleet``, ``/fleet/events`` and SIGHUP reach.

    Reloads are serialised. Each one reads and validates the whole file
    first; a bad file changes nothing. A good one is diffed against the
    running fleet and applied without awaiting any engine. ``settings`` is
    the snapshot new requests run under; a reload replaces it, never edits it.
    """

    def __init__(
        self,
        fleet: FleetConfig,
        supervisor: Supervisor,
        builder: ModelBuilder,
        metrics: Metrics,
        notifier: Notifier,
        digest: str = "",
        *,
        placements: PlacementShare | None = None,
        link: ReplicaLink | None = None,
        adapt: Callable[[FleetConfig], FleetConfig] | None = None,
    ) -> None:
        self.running = fleet
        #: the fleet file as this process runs it (a worker's: control/workers.py worker_fleet)
        self.adapt = adapt
        self.supervisor = supervisor
        self.builder = builder
        #: the models served, each with its settings snapshot (replaced whole on reload)
        self.models: ModelTable = builder.build(fleet, fleet.frontend)
        self.metrics = metrics
        self.notifier = notifier
        self.hub = EventHub()
        self.version = 1
        self.digest = digest
        self.loaded_at = time.time()
        self.last_reload: ReloadResult | None = None
        self._lock = trio.Lock()
        self.placements = placements  # a new kv_aware policy shares its placements here
        self.link = link  # to the sibling replicas ([frontend.replicas]), for /fleet and gauges
        #: the [[pool]] watches, once the daemon runs them (their engines join ``running``)
        self.pods = PodDiscovery(fleet, metrics, self.apply_membership)
        #: pool engines left out, each with the engine that has its address (or name)
        self.pool_clashes: dict[str, str] = {}
        supervisor.listeners.append(self._on_engine)

    @property
    def settings(self) -> Settings:
        """The first model's snapshot: ``[frontend]`` as every request reads it on arrival."""
        return self.models.models[0].settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        """Publish ``settings`` as the first model's snapshot (a fleet of one: its only one)."""
        first = self.models.models[0]
        self.models = self.models.replaced(dataclasses.replace(first, settings=settings))

    # -- the view ---------------------------------------------------------------------

    def _children(self) -> list[EngineChild]:
        """Current incarnations in fleet-file order, then the draining ones."""
        order = {cfg.name: i for i, cfg in enumerate(self.running.engines)}
        active = sorted(self.supervisor.children.values(), key=lambda c: order.get(c.name, 0))
        return active + self.supervisor.draining()

    def status(self) -> dict[str, JsonValue]:
        """``GET /fleet``: engines, the running config and the last reload (secrets redacted)."""
        kv = self.supervisor.kv
        engines: list[JsonValue] = []
        for child in self._children():
            status = engine_status(child)
            if kv is not None:
                status["kv_routing"] = kv.routing_of(child.incarnation)
            engines.append(status)
        return {
            "config": {
                "version": self.version,
                "digest": self.digest,
                "source": str(self.running.source),
                "loaded_at": self.loaded_at,
            },
            "last_reload": None if self.last_reload is None else self.last_reload.to_json(),
            "catalog_version": self.supervisor.catalog.version,
            "serving": self.supervisor.serving_count,
            "total": len(self.supervisor.children),
            "engines": engines,
            "models": self._models_status(),
            "pools": self.pods.status(),
            "waiting_for_pools": list(self.waiting_for_pools()),
            "pool_clashes": dict(self.pool_clashes),
            "fleet": to_jsonable(self.running),
            "events": {"subscribers": len(self.hub.subscribers),
                       "dropped": self.hub.dropped_total},
            "replicas": None if self.link is None else self.link.status(),
        }

    def _models_status(self) -> list[JsonValue]:
        out: list[JsonValue] = []
        for model in self.models.models:
            engines: list[JsonValue] = [*sorted({e.name for e in model.catalog.engines})]
            adapters: list[JsonValue] = [a.name for a in model.config.adapters]
            aliases: list[JsonValue] = list(model.config.aliases)
            out.append({
                "name": model.name, "aliases": aliases, "adapters": adapters,
                "serving": _serving(model), "engines": engines,
                "policy": model.settings.policy.name,
                "in_flight": model.settings.admission.in_flight,
            })
        return out

    def loads(self) -> dict[str, JsonValue]:
        return {f"{c.name}#{c.incarnation}": c.in_flight for c in self._children()}

    def request_counts(self) -> dict[str, JsonValue]:
        return {f"{c.name}#{c.incarnation}": c.load.requests_total for c in self._children()}

    def ready(self) -> tuple[int, int]:
        """(engines serving, engines in the fleet file): what ``/ready`` reports."""
        return self.supervisor.serving_count, len(self.supervisor.children)

    def waiting_for_pools(self) -> list[str]:
        """Pools ``wait_for_pods`` still holds ``/ready`` for (start-up only)."""
        return self.pods.pending({
            child.cfg.pool for child in self.supervisor.incarnations.values()
            if child.cfg.pool is not None and child.state is EngineState.SERVING
        })

    def subscribe(self) -> contextlib.AbstractContextManager[Subscriber]:
        return self.hub.subscribe()

    def collect_metrics(self) -> None:
        """Bring the engine gauges up to date before a scrape of ``/metrics``."""
        for name, child in self.supervisor.children.items():
            self.metrics.set_engine_state(name, child.state.value)  # type: ignore[arg-type]
            load = child.handle.load.in_flight if child.handle is not None else 0
            self.metrics.set_engine_in_flight(name, load)
        for model in self.models.models:  # the engines serving it, its queue by tenant
            series = self.metrics.model_series(model.name)
            series.engines_serving(_serving(model))
            series.queue_depth(model.settings.admission.waiting)
            series.tenant_queue_depths(model.settings.admission.waiting_by())
        if self.supervisor.kv is not None:
            self.supervisor.kv.export()
        if self.link is not None:
            self.metrics.replica_degraded.set(1 if self.link.degraded else 0)
            self.metrics.replica_peers.set(len(self.link.peers))

    def status_line(self) -> str:
        line = (f"{self.supervisor.serving_count}/{len(self.supervisor.children)} engines serving;"
                f" config v{self.version}")
        if self.last_reload is not None and not self.last_reload.ok:
            line += "; last reload rejected (see logs)"
        return line

    def _on_engine(self, child: EngineChild, previous: EngineState) -> None:
        self.hub.publish({
            "type": "engine", "previous": previous.value, "engine": engine_status(child),
        })
        if child.state is EngineState.GONE and child.name not in self.supervisor.children:
            self.metrics.forget_engine(child.name)
        self.notifier.status(self.status_line())

    # -- reloads ----------------------------------------------------------------------

    async def reload(self, trigger: str) -> dict[str, JsonValue]:
        """Reload the fleet file; the result as JSON (also logged and broadcast)."""
        async with self._lock:
            self.notifier.reloading()
            try:
                result = await self._reload(trigger)
            finally:
                self.notifier.ready(self.status_line())
        self.last_reload = result
        self.notifier.status(self.status_line())
        event = result.to_json()
        self.hub.publish({"type": "reload", "reload": event})
        return event

    async def _reload(self, trigger: str) -> ReloadResult:
        path = self.running.source
        digest = ""
        try:
            raw = await trio.to_thread.run_sync(_read, path)
            digest = file_digest(raw)
            new = parse_fleet_bytes(raw, path)
            if self.adapt is not None:
                new = self.adapt(new)
            self._check_kv_block_size(new)
            await self.builder.load(new)  # new tokenizers, in a worker thread
            # the pools' engines as last seen (a changed pool keeps its own until relisted)
            new, clashes = merge_pool_engines(new, self.pods.members())
            self._note_clashes(clashes)
        except FleetError as exc:
            for problem in exc.problems:
                log.error("fleet reload rejected, keeping the running fleet: %s", problem,
                          extra={"trigger": trigger})
            errors = tuple(str(p) for p in exc.problems)
            return ReloadResult(False, trigger, time.time(), self.version, digest, errors)
        diff = diff_fleets(self.running, new)
        effective = dataclasses.replace(
            new, frontend=keep_restart_fields(new.frontend, self.running.frontend)
        )
        self._apply(effective, diff)
        await self.pods.reconcile(effective)
        self.digest = digest
        return ReloadResult(True, trigger, time.time(), self.version, digest, diff=diff)

    def _check_kv_block_size(self, new: FleetConfig) -> None:
        """The KV index's block size is set at start: a reload may not change it."""
        kv = self.supervisor.kv
        if kv is None or kv_block_size(new) == kv.index.block_size:
            return
        message = f"the KV block size ({kv.index.block_size}) can only change with a restart"
        raise FleetError([FleetProblem(str(new.source), None, "frontend.routing.policy",
                                       message)])

    def apply_membership(self, members: Mapping[str, tuple[EngineConfig, ...]]) -> None:
        """The pools' engines changed: the same adds and removes a fleet-file edit makes.

        Same drain, migration and KV fencing as a reload (the supervisor's
        :meth:`~Supervisor.apply`); the config version stays, the file did not change.
        """
        fleet, clashes = merge_pool_engines(self.running, members)
        self._note_clashes(clashes)
        diff = diff_engines(self.running, fleet)
        if not (diff.added or diff.removed or diff.changed):
            return
        self.running = fleet
        self.supervisor.apply(fleet, removed=diff.removed, changed=diff.changed_names,
                              added=diff.added)
        lines = [line for line in diff.lines() if not line.startswith("=")]
        log.info("pool membership changed: %s", "; ".join(lines[:20])
                 + (f"; … {len(lines) - 20} more" if len(lines) > 20 else ""))
        self.hub.publish({"type": "membership", "diff": diff.to_json()})
        self.notifier.status(self.status_line())

    def _note_clashes(self, clashes: dict[str, str]) -> None:
        """Pool engines left out for an address (or name) already taken: warned of once each.

        Two pools selecting one pod, or a pod at a file engine's address, would
        otherwise collapse into one engine without a word; ``/fleet`` lists them.
        """
        for name, reason in clashes.items():
            if self.pool_clashes.get(name) != reason:
                log.warning("%s", reason, extra={"engine": name})
        self.pool_clashes = clashes

    def _apply(self, fleet: FleetConfig, diff: FleetDiff) -> None:
        for name in diff.restart:
            log.warning("frontend.%s changed: needs a restart; the running value is kept", name)
        applies = diff.added or diff.removed or diff.changed or diff.live or diff.models_differ
        if not applies:
            log.info("fleet file reloaded: no changes to apply")
            self.running = fleet
            return
        self.version += 1
        self.loaded_at = time.time()
        self.running = fleet
        self.models = self.builder.build(fleet, fleet.frontend, self.models)
        self.supervisor.apply(fleet, removed=diff.removed, changed=diff.changed_names,
                              added=diff.added)
        log.info("fleet reloaded (config v%d): %s", self.version, "; ".join(diff.lines()))


def kv_block_size(fleet: FleetConfig) -> int:
    """The KV index's block size: the kv_aware knob of the models routed by it (one value)."""
    for model in fleet.models:
        if model.routing.policy == "kv_aware":
            return model.routing.kv_aware.block_size
    return fleet.frontend.routing.kv_aware.block_size


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        problem = FleetProblem(str(path), None, "", f"cannot read the file: {exc.strerror or exc}")
        raise FleetError([problem]) from None


def _serving(model: ServedModel) -> int:
    """Engines serving ``model`` (an engine's incarnations count once)."""
    return len({e.name for e in model.catalog.engines})
