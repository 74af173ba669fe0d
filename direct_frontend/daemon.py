"""The daemon's top level: one Trio run holding the asyncio bridge, the control plane and HTTP.

Shape (every task has a parent)::

    trio.run
      └─ trio_asyncio loop          grpclib channels and embedded simulators live here
          └─ root nursery
              ├─ supervisor         engine incarnations, catalog
              ├─ HTTP server        hypercorn, the data plane's entry (and /fleet)
              ├─ file watcher       fleet file changed → reload
              ├─ signal watcher     SIGHUP → reload; SIGINT/SIGTERM → graceful shutdown
              └─ systemd watchdog   WATCHDOG=1 from the event loop itself

Shutdown stops accepting, lets in-flight requests finish within the grace
period (hypercorn's graceful timeout), then cancels the rest: every task
ends inside its nursery, so nothing outlives ``serve_fleet``.
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # before grpclib, see cli.py

# isort: split
import dataclasses
import hashlib
import logging
import signal
import time
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from direct_frontend.engines.child import EngineChild
from direct_frontend.engines.lifecycle import EngineState
from direct_frontend.fleet.describe import JsonValue, to_jsonable
from direct_frontend.fleet.diff import FleetDiff, ReloadResult, diff_fleets
from direct_frontend.fleet.load import parse_fleet_bytes
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import FleetConfig, FrontendConfig
from direct_frontend.fleet.watch import POLL_INTERVAL_S, FileStamp, stamp_of, watch_file
from direct_frontend.http import coalesce
from direct_frontend.http.admin import EventHub, engine_status
from direct_frontend.http.app import App
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.plane import KvPlane
from direct_frontend.observability.metrics import Metrics
from direct_frontend.observability.sdnotify import Notifier
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.routing.factory import make_policy
from direct_frontend.routing.kv_aware import KvKnobs
from direct_frontend.routing.policies import Policy
from direct_frontend.supervisor import Supervisor
from direct_frontend.text.model_dir import TextModel

log = logging.getLogger("direct_frontend")

SHUTDOWN_GRACE_S = 10.0


def hypercorn_config(fleet: FleetConfig, grace_s: float = SHUTDOWN_GRACE_S) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [fleet.frontend.listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = grace_s
    config.keep_alive_timeout = 75
    return config


def file_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]


def keep_restart_fields(new: FrontendConfig, running: FrontendConfig) -> FrontendConfig:
    """``new`` with the settings that need a restart (``RESTART_FIELDS``) kept as running."""
    return dataclasses.replace(
        new,
        listen_host=running.listen_host,
        listen_port=running.listen_port,
        tokenizer=running.tokenizer,
        served_model_name=running.served_model_name,
        log_json=running.log_json,
    )


class ControlPlane:
    """Reloads and the fleet view: what ``/fleet``, ``/fleet/events`` and SIGHUP reach.

    Reloads are serialised. Each one reads and validates the whole file
    first; a bad file changes nothing. A good one is diffed against the
    running fleet and applied without awaiting any engine.
    """

    def __init__(
        self,
        fleet: FleetConfig,
        supervisor: Supervisor,
        app: App,
        dispatcher: Dispatcher,
        metrics: Metrics,
        notifier: Notifier,
        digest: str = "",
    ) -> None:
        self.running = fleet
        self.supervisor = supervisor
        self.app = app
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.notifier = notifier
        self.hub = EventHub()
        self.version = 1
        self.digest = digest
        self.loaded_at = time.time()
        self.last_reload: ReloadResult | None = None
        self._lock = trio.Lock()
        supervisor.listeners.append(self._on_engine)

    # -- the view ---------------------------------------------------------------------

    def _children(self) -> list[EngineChild]:
        """Current incarnations in fleet-file order, then the draining ones."""
        order = {cfg.name: i for i, cfg in enumerate(self.running.engines)}
        active = sorted(self.supervisor.children.values(), key=lambda c: order.get(c.name, 0))
        return active + self.supervisor.draining()

    def status(self) -> dict[str, JsonValue]:
        """``GET /fleet``: engines, the running config and the last reload (secrets redacted)."""
        engines: list[JsonValue] = [engine_status(child) for child in self._children()]
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
            "fleet": to_jsonable(self.running),
            "events": {"subscribers": len(self.hub.subscribers),
                       "dropped": self.hub.dropped_total},
        }

    def loads(self) -> dict[str, JsonValue]:
        return {f"{c.name}#{c.generation}": c.in_flight for c in self._children()}

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
            policy = self._policy_for(new)
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
        self._apply(effective, diff, policy)
        self.digest = digest
        return ReloadResult(True, trigger, time.time(), self.version, digest, diff=diff)

    def _policy_for(self, new: FleetConfig) -> Policy | None:
        """A new policy object if routing changed (built first: it may refuse the file)."""
        if new.frontend.routing == self.running.frontend.routing:
            return None
        kv = self.supervisor.kv
        try:
            block = kv_block_size(new)
            if kv is not None and block != kv.index.block_size:
                raise ValueError(
                    f"the KV block size ({kv.index.block_size}) can only change with a restart"
                )
            return make_policy(new.frontend.routing, kv.index if kv else None,
                               kv.live if kv else ())
        except ValueError as exc:
            raise FleetError([FleetProblem(str(new.source), None, "frontend.routing.policy",
                                           str(exc))]) from None

    def _apply(self, fleet: FleetConfig, diff: FleetDiff, policy: Policy | None) -> None:
        for name in diff.restart:
            log.warning("frontend.%s changed: needs a restart; the running value is kept", name)
        applies = diff.added or diff.removed or diff.changed or diff.live
        if not applies:
            log.info("fleet file reloaded: no changes to apply")
            self.running = fleet
            return
        self.version += 1
        self.loaded_at = time.time()
        self.running = fleet
        if policy is not None:
            self.dispatcher.policy = policy
        self.app.apply_frontend(fleet.frontend)
        self.dispatcher.disagg.stall_timeout_s = fleet.frontend.faults.stall_timeout_s
        self.supervisor.apply(fleet, removed=diff.removed, changed=diff.changed_names,
                              added=diff.added)
        log.info("fleet reloaded (config v%d): %s", self.version, "; ".join(diff.lines()))


def kv_block_size(fleet: FleetConfig) -> int:
    """The KV index's block size: the kv_aware knob (or its default)."""
    knobs = fleet.frontend.routing.knobs if fleet.frontend.routing.policy == "kv_aware" else {}
    return KvKnobs.from_mapping(knobs).block_size


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        problem = FleetProblem(str(path), None, "", f"cannot read the file: {exc.strerror or exc}")
        raise FleetError([problem]) from None


async def serve_fleet(
    fleet: FleetConfig,
    *,
    shutdown: trio.Event | None = None,
    handle_signals: bool = True,
    watch_interval_s: float | None = POLL_INTERVAL_S,
    shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    notifier: Notifier | None = None,
    task_status: trio.TaskStatus[App] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the whole daemon until ``shutdown`` is set (or SIGINT/SIGTERM).

    ``watch_interval_s=None`` turns the file watcher off (reloads then come
    from SIGHUP or ``POST /fleet/reload`` only).
    """
    started = time.perf_counter()
    shutdown = trio.Event() if shutdown is None else shutdown
    notifier = Notifier() if notifier is None else notifier
    stamp = stamp_of(fleet.source)
    digest = file_digest(await trio.to_thread.run_sync(_read_or_empty, fleet.source))
    async with trio_asyncio.open_loop():
        text_model = await trio.to_thread.run_sync(TextModel.load, fleet.frontend.tokenizer)
        metrics = Metrics()
        kv = KvPlane(KvIndex(kv_block_size(fleet)), metrics)
        supervisor = Supervisor(fleet, kv=kv)
        policy = make_policy(fleet.frontend.routing, kv.index, kv.live)
        dispatcher = Dispatcher(supervisor, policy)
        dispatcher.disagg.stall_timeout_s = fleet.frontend.faults.stall_timeout_s
        app = App(fleet.frontend, text_model, supervisor, dispatcher, metrics)
        control = ControlPlane(fleet, supervisor, app, dispatcher, metrics, notifier, digest)
        app.control = control
        async with trio.open_nursery() as nursery:
            if handle_signals:  # only the main thread may install signal handlers
                nursery.start_soon(_watch_signals, shutdown, control, nursery.cancel_scope)
            await nursery.start(supervisor.run)
            config = hypercorn_config(fleet, shutdown_grace_s)
            app.bound_urls = await nursery.start(_serve_http, app, config, shutdown)
            log.info(
                "listening on %s (started in %.2fs)",
                " ".join(app.bound_urls), time.perf_counter() - started,
            )
            if watch_interval_s is not None:
                nursery.start_soon(_watch_fleet_file, fleet.source, control, watch_interval_s,
                                   stamp)
            notifier.ready(control.status_line())
            nursery.start_soon(notifier.watchdog_loop)
            task_status.started(app)
            await shutdown.wait()
            notifier.stopping()
            control.hub.close()  # event viewers leave, so HTTP shutdown does not wait for them
            # hypercorn finishes in-flight requests within its graceful timeout
            with trio.move_on_after(shutdown_grace_s + 1):
                await app.http_stopped.wait()
            nursery.cancel_scope.cancel()
    notifier.close()


def _read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


async def _watch_fleet_file(
    path: Path, control: ControlPlane, interval_s: float, stamp: FileStamp | None
) -> None:
    async def reload() -> None:
        await control.reload("file")

    await watch_file(path, reload, interval_s=interval_s, initial=stamp)


async def _serve_http(
    app: App, config: HypercornConfig, shutdown: trio.Event,
    *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    coalesce.install()  # response head and first body bytes in one write (http/coalesce.py)
    try:
        await serve(app, config,  # type: ignore[arg-type]
                    shutdown_trigger=shutdown.wait, task_status=task_status)
    finally:
        app.http_stopped.set()


async def _watch_signals(
    shutdown: trio.Event, control: ControlPlane, root: trio.CancelScope
) -> None:
    """SIGHUP reloads; the first SIGINT/SIGTERM shuts down gracefully, a second one at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                log.info("received SIGHUP: reloading %s", control.running.source)
                await control.reload("signal")
            elif not shutdown.is_set():
                log.info("received %s: shutting down (in-flight requests may finish)", name)
                shutdown.set()
            else:
                log.warning("received %s again: stopping now", name)
                root.cancel()


def run_daemon(fleet: FleetConfig, *, watch: bool = True) -> int:
    """Blocking entry point for ``direct-frontend run``; returns the exit code."""
    trio.run(partial(serve_fleet, fleet, watch_interval_s=POLL_INTERVAL_S if watch else None))
    return 0
