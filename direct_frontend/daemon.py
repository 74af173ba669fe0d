"""The daemon's top level: one Trio run holding the asyncio bridge, the control plane and HTTP.

Shape (every task has a parent)::

    trio.run
      └─ trio_asyncio loop          grpclib channels and embedded simulators live here
          └─ root nursery
              ├─ replica link       [frontend.replicas]: load, faults, KV snapshots over NATS
              ├─ supervisor         engine incarnations, catalog
              ├─ pod discovery      [[pool]] list/watch → the supervisor's adds/removes
              ├─ background         Responses run with background: true (http/background.py)
              ├─ batches            the Batch API's batches, a line at a time (http/batch_runner.py)
              ├─ retention          the durable store's sweeps (state/backends.py)
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
import gc
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from direct_frontend.control.kv_plane import KvPlane
from direct_frontend.control.model_builder import ModelBuilder
from direct_frontend.control.rate_share import RateShare
from direct_frontend.control.reload import ControlPlane, file_digest, kv_block_size
from direct_frontend.control.replicas import LinkNews, ReplicaLink
from direct_frontend.control.supervisor import Supervisor
from direct_frontend.control.workers import (
    WorkerRole,
    mark_ready,
    merged_metrics,
    share_metrics,
    watch_parent,
    worker_fleet,
    worker_replicas,
)
from direct_frontend.fleet.preflight import TextModelKey
from direct_frontend.fleet.schema import FleetConfig, ReplicasConfig, TracingConfig
from direct_frontend.fleet.watch import POLL_INTERVAL_S, FileStamp, stamp_of, watch_file
from direct_frontend.http import coalesce, keepalive
from direct_frontend.http.app import App
from direct_frontend.kv.index import KvIndex
from direct_frontend.observability import descriptors, shims
from direct_frontend.observability.metrics import Metrics
from direct_frontend.observability.redact import redact_url
from direct_frontend.observability.sdnotify import Notifier
from direct_frontend.observability.tracing import Tracing
from direct_frontend.openai.response_store import ResponseStore
from direct_frontend.pipeline.ratelimit import RateLimiter
from direct_frontend.routing.factory import make_policy
from direct_frontend.routing.peers import PlacementShare
from direct_frontend.state.backends import open_durable, sweep_forever
from direct_frontend.state.shell import Durable
from direct_frontend.text.model_dir import TextModel

log = logging.getLogger("direct_frontend")

SHUTDOWN_GRACE_S = 10.0


def hypercorn_config(
    fleet: FleetConfig, grace_s: float = SHUTDOWN_GRACE_S, worker: WorkerRole | None = None
) -> HypercornConfig:
    config = keepalive.ServerConfig()
    config.header_timeout_s = fleet.frontend.header_timeout_s
    config.bind = [fleet.frontend.listen]
    if worker is not None:  # one of N on the parent's port: SO_REUSEPORT (hypercorn's rule)
        host = f"[{worker.host}]" if ":" in worker.host else worker.host
        config.bind = [f"{host}:{worker.port}"]
        config.workers = worker.count  # what makes hypercorn set SO_REUSEPORT; the warning
        # that serve() would print about it says nothing true of this use: filtered
        warnings.filterwarnings("ignore", message="The config `workers` has no affect")
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = grace_s
    # Longer than the 60 s idle timeout of common load balancers and proxies, so they close
    # first; idle connections are capped, and closed once the peer closes (http/keepalive.py).
    config.keep_alive_timeout = 75
    return config


async def serve_fleet(
    fleet: FleetConfig,
    *,
    shutdown: trio.Event | None = None,
    handle_signals: bool = True,
    watch_interval_s: float | None = POLL_INTERVAL_S,
    shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    notifier: Notifier | None = None,
    text_models: Mapping[TextModelKey, TextModel] | None = None,
    worker: WorkerRole | None = None,
    freeze_startup_heap: bool = False,
    task_status: trio.TaskStatus[App] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the whole daemon until ``shutdown`` is set (or SIGINT/SIGTERM).

    ``watch_interval_s=None`` turns the file watcher off (reloads then come
    from SIGHUP or ``POST /fleet/reload`` only). ``text_models`` are the fleet's
    tokenizers when the caller has loaded them already (``run`` checks them first).
    ``worker``: this is one of ``run --workers N`` (control/workers.py).
    """
    started = time.perf_counter()
    if worker is not None:
        fleet = worker_fleet(fleet, worker)
    descriptors.raise_soft_limit()  # every connection is a descriptor; 1,024 is not many
    shutdown = trio.Event() if shutdown is None else shutdown
    notifier = Notifier() if notifier is None else notifier
    stamp = stamp_of(fleet.source)
    digest = file_digest(await trio.to_thread.run_sync(_read_or_empty, fleet.source))
    async with trio_asyncio.open_loop():
        parts = await _assemble(fleet, notifier, digest, text_models, worker)
        async with trio.open_nursery() as nursery:
            if handle_signals:  # only the main thread may install signal handlers
                nursery.start_soon(_watch_signals, shutdown, parts.control, nursery.cancel_scope)
            await _start_control(nursery, parts, fleet)
            config = hypercorn_config(fleet, shutdown_grace_s, worker)
            parts.app.bound_urls = await nursery.start(_serve_http, parts.app, config, shutdown)
            log.info(
                "listening on %s (started in %.2fs)",
                " ".join(parts.app.bound_urls), time.perf_counter() - started,
            )
            if freeze_startup_heap:
                _freeze_startup_heap()
            if watch_interval_s is not None:
                nursery.start_soon(_watch_fleet_file, fleet.source, parts.control,
                                   watch_interval_s, stamp)
            notifier.ready(parts.control.status_line())
            if worker is not None:
                mark_ready(worker)
                nursery.start_soon(watch_parent, worker, shutdown)
                nursery.start_soon(share_metrics, worker,
                                   partial(_rendered, parts.control, parts.metrics))
            nursery.start_soon(notifier.watchdog_loop)
            task_status.started(parts.app)
            await shutdown.wait()
            notifier.stopping()
            await _drain(parts, shutdown_grace_s)
            nursery.cancel_scope.cancel()
        await _close(parts)
    notifier.close()


@dataclasses.dataclass(frozen=True, slots=True)
class _Parts:
    """The daemon's long-lived objects, built before any of its tasks starts."""

    metrics: Metrics
    supervisor: Supervisor
    link: ReplicaLink | None  # [frontend.replicas]
    share: RateShare | None  # the tenants' rate limits, shared over the link
    control: ControlPlane
    app: App
    durable: Durable | None
    tracing: Tracing | None


async def _assemble(
    fleet: FleetConfig, notifier: Notifier, digest: str,
    text_models: Mapping[TextModelKey, TextModel] | None, worker: WorkerRole | None,
) -> _Parts:
    """Every long-lived object, wired; the tokenizers loaded and the durable store open."""
    metrics = Metrics()
    kv = KvPlane(KvIndex(kv_block_size(fleet)), metrics)
    replicas = _replicas(fleet, worker)
    news = None if replicas is None else LinkNews()  # what wakes the link, built before it
    supervisor = Supervisor(fleet, kv=kv,
                            on_load_change=None if news is None else news.load_changed)
    # placements go to sibling replicas only: without them none is queued (each would hold
    # its prompt's every block hash until the outbox's bound let go of it)
    placements = None if news is None else PlacementShare(notify=news.urgent)
    builder = ModelBuilder(
        supervisor, metrics,
        lambda routing, exact: make_policy(
            routing, kv.index if exact else None, kv.live, placements, kv.diverged
        ),
        text_models,
        kv.diverged,
    )
    await builder.load(fleet)
    responses, durable = await _open_responses(fleet, metrics)
    link = None if replicas is None or news is None or placements is None else ReplicaLink(
        replicas, supervisor, placements, news, kv=kv,
        replica_id=None if worker is None else f"worker{worker.index}-{os.getpid()}",
        responses=responses,
    )
    limiter = RateLimiter(fleet.frontend.tenants)  # the tenants' rate limits
    # made before the link runs: it subscribes to the subject the share speaks on
    share = None if link is None else RateShare(
        limiter, link, lambda: control.settings.frontend.tenants)
    control = ControlPlane(fleet, supervisor, builder, metrics, notifier, digest,
                           placements=placements,
                           link=link,
                           adapt=None if worker is None else partial(worker_fleet, role=worker))
    tracing = _open_tracing(fleet.frontend.tracing)
    app = App(control, metrics, tracing, responses, durable, limiter,
              metrics_view=None if worker is None else partial(merged_metrics, worker))
    if responses is not None:  # built after the store, each holding it
        responses.connect(app.background, None if link is None else link.stored)
    return _Parts(metrics, supervisor, link, share, control, app, durable, tracing)


def _replicas(fleet: FleetConfig, worker: WorkerRole | None) -> ReplicasConfig | None:
    """What the link to the sibling replicas (a worker's: to its siblings) is; None: none."""
    replicas = fleet.frontend.replicas
    if worker is not None:
        replicas = worker_replicas(replicas, worker)
    return None if replicas.nats is None else replicas


async def _start_control(nursery: trio.Nursery, parts: _Parts, fleet: FleetConfig) -> None:
    """The control plane's tasks, in the order each needs the one before it."""
    if parts.link is not None:  # first: a sibling's KV index is in before engines start
        await nursery.start(parts.link.run)
    if parts.share is not None:
        nursery.start_soon(parts.share.run)
    await nursery.start(parts.supervisor.run)
    await nursery.start(parts.control.pods.run)
    app = parts.app
    if app.background is not None:
        await nursery.start(app.background.run)
    if app.batch_runner is not None:
        await nursery.start(app.batch_runner.run)
    if parts.durable is not None:
        nursery.start_soon(sweep_forever, parts.durable, fleet.frontend.responses.sweep_interval_s)


async def _drain(parts: _Parts, grace_s: float) -> None:
    """Shutdown: what is in flight finishes within the grace period."""
    parts.control.hub.close()  # event viewers leave, so HTTP shutdown does not wait for them
    # hypercorn finishes in-flight requests within its graceful timeout, and
    # background responses get the same grace
    with trio.move_on_after(grace_s + 1):
        if parts.app.background is not None:
            await parts.app.background.drain()
        await parts.app.http_stopped.wait()


async def _close(parts: _Parts) -> None:
    if parts.durable is not None:
        await parts.durable.close()
    if parts.tracing is not None:  # what is still buffered goes out (a crash: at exit)
        await trio.to_thread.run_sync(parts.tracing.shutdown)


def _rendered(control: ControlPlane, metrics: Metrics) -> bytes:
    control.collect_metrics()
    return metrics.render()[0]


def _open_tracing(config: TracingConfig) -> Tracing | None:
    """The daemon's tracer if ``[frontend.tracing]`` configures one (read once, at start)."""
    if config.otlp_endpoint is None:
        return None
    log.info("tracing: spans go to %s", redact_url(config.otlp_endpoint))
    return Tracing(config.otlp_endpoint, config.service_name, config.sample_ratio)


async def _open_responses(fleet: FleetConfig,
                          metrics: Metrics) -> tuple[ResponseStore | None, Durable | None]:
    """The stored Responses of ``[frontend.responses]`` (read once, at start), exported, and
    the durable store of responses (unless the backend is ``memory``) and conversations."""
    config = fleet.frontend.responses
    if not config.store:
        return None, None
    durable = await open_durable(config, fleet.source)
    store = ResponseStore(config.max_bytes, config.ttl_s,
                          max_bytes_per_owner=config.max_bytes_per_owner,
                          on_evict=metrics.response_evicted,
                          durable=None if config.backend == "memory" else durable,
                          conversations=durable)
    metrics.watch_responses(lambda: len(store), lambda: store.bytes)
    return store, durable


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
    keepalive.install()  # close connections the peer closed at once (http/keepalive.py)
    shims.log_report(log)  # which hot-path shims are in use, and if not, why (ADR 0002)
    try:
        await serve(app, config,  # type: ignore[arg-type]
                    shutdown_trigger=shutdown.wait, task_status=task_status,
                    mode="asgi")  # its __call__ is a plain function returning the coroutine
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


#: container allocations (net of frees) between collections of the youngest generation;
#: CPython's 700 runs one every few requests here, each walking every live object of the
#: requests in flight
YOUNG_COLLECTION_THRESHOLD = 10_000


def _freeze_startup_heap() -> None:
    """Take what startup built (modules, tokenizers, templates, the fleet's objects) out of
    the cyclic collector's walks.

    The collector's oldest generation is walked whole now and then; with the startup heap
    in it, each walk costs tens of milliseconds of CPU in the middle of some request.
    Frozen objects are still freed by reference counting when let go (a model a reload
    unloads); only cycles among them stay, so what can stay is bounded by the startup heap.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


#: how long a thread holding the GIL keeps it while another waits for it (CPython's default
#: is 5 ms). The event loop shares the GIL with worker threads preparing large prompts
#: (rendering and bounding hold it), and takes it back after every system call: at 5 ms a
#: ``GET /health`` that makes three of them could wait 15 ms behind one such thread.
GIL_SWITCH_INTERVAL_S = 0.001


def run_daemon(
    fleet: FleetConfig, *, watch: bool = True,
    text_models: Mapping[TextModelKey, TextModel] | None = None,
    worker: WorkerRole | None = None,
) -> int:
    """Blocking entry point for ``direct-frontend run``; returns the exit code."""
    interval = POLL_INTERVAL_S if watch else None
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    trio.run(partial(serve_fleet, fleet, watch_interval_s=interval, text_models=text_models,
                     worker=worker, freeze_startup_heap=True))
    return 0
