"""The daemon's top level: one Trio run holding the asyncio bridge, the control plane and HTTP.

Shape (every task has a parent)::

    trio.run
      └─ trio_asyncio loop          grpclib channels and embedded simulators live here
          └─ root nursery
              ├─ supervisor         engine children, catalog
              ├─ HTTP server        hypercorn, the data plane's entry
              └─ signal watcher     SIGINT/SIGTERM → graceful shutdown
"""

from __future__ import annotations

import trio_asyncio  # noqa: I001  (before grpclib, see cli.py)

import logging
import signal
import time

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from direct_frontend.fleet.schema import FleetConfig
from direct_frontend.http.app import App
from direct_frontend.observability.metrics import Metrics
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.routing.policies import make_policy
from direct_frontend.supervisor import Supervisor
from direct_frontend.text.model_dir import TextModel

log = logging.getLogger("direct_frontend")

SHUTDOWN_GRACE_S = 10.0


def hypercorn_config(fleet: FleetConfig) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [fleet.frontend.listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = SHUTDOWN_GRACE_S
    config.keep_alive_timeout = 75
    return config


async def serve_fleet(
    fleet: FleetConfig,
    *,
    shutdown: trio.Event | None = None,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[App] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the whole daemon until ``shutdown`` is set (or SIGINT/SIGTERM)."""
    started = time.perf_counter()
    shutdown = trio.Event() if shutdown is None else shutdown
    async with trio_asyncio.open_loop():
        text_model = await trio.to_thread.run_sync(TextModel.load, fleet.frontend.tokenizer)
        supervisor = Supervisor(fleet)
        metrics = Metrics()
        dispatcher = Dispatcher(supervisor, make_policy(fleet.frontend.routing.policy))
        app = App(fleet.frontend, text_model, supervisor, dispatcher, metrics)
        async with trio.open_nursery() as nursery:
            if handle_signals:  # only the main thread may install signal handlers
                nursery.start_soon(_watch_signals, shutdown)
            await nursery.start(supervisor.run)
            config = hypercorn_config(fleet)
            app.bound_urls = await nursery.start(_serve_http, app, config, shutdown)
            log.info(
                "listening on %s (started in %.2fs)",
                " ".join(app.bound_urls), time.perf_counter() - started,
            )
            task_status.started(app)
            await shutdown.wait()
            # hypercorn finishes in-flight requests within its graceful timeout
            with trio.move_on_after(SHUTDOWN_GRACE_S + 1):
                await app.http_stopped.wait()
            nursery.cancel_scope.cancel()


async def _serve_http(
    app: App, config: HypercornConfig, shutdown: trio.Event,
    *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await serve(app, config,  # type: ignore[arg-type]
                    shutdown_trigger=shutdown.wait, task_status=task_status)
    finally:
        app.http_stopped.set()


async def _watch_signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            shutdown.set()
            return


def run_daemon(fleet: FleetConfig) -> int:
    """Blocking entry point for ``direct-frontend run``; returns the exit code."""
    trio.run(serve_fleet, fleet)
    return 0
