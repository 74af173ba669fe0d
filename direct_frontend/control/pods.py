"""The pod watch: each ``[[pool]]``'s pods, listed then watched, as engines for the supervisor.

One task per pool lists the pods its selector matches (in pages), then
watches from the list's ``resourceVersion`` with bookmarks; a watch the
server ends (``timeoutSeconds``) resumes from the last version seen, a 410
Gone relists, and a full relist runs every ``relist_interval_s`` whatever
happens, so a missed delete lives no longer than that. A watch that brings
no byte for ``watch_silence_s`` is a dead connection (a healthy one brings a
bookmark sooner: :func:`~direct_frontend.fleet.pools.watch_seconds`). A failed
list or watch reconnects with jittered backoff and *keeps the last
membership*: an API server that goes away marks the pool stale (``/fleet``, a
metric) and never empties the fleet. The engines each pool's pods make go through
:meth:`ControlPlane.apply_membership`, the same adds and removes a fleet
file edit makes. Which pod is which engine is decided in
:mod:`direct_frontend.fleet.pools`; this module only moves bytes and time.

The HTTP client is httpx (on Trio, through anyio) built by lightkube from a
kubeconfig or the pod's service account (docs/decisions/0003-pod-watch-client.md).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx2 as httpx
import trio
from lightkube.config.client_adapter import AsyncClient, ConnectionParams
from lightkube.config.kubeconfig import SERVICE_ACCOUNT, KubeConfig
from lightkube.core.exceptions import ConfigError

from direct_frontend.control.kube_exec import ExecAuth
from direct_frontend.fleet.describe import JsonValue
from direct_frontend.fleet.pools import (
    Backoff,
    PoolMembership,
    list_params,
    parse_event,
    pods_path,
    watch_params,
    watch_seconds,
)
from direct_frontend.fleet.schema import EngineConfig, FleetConfig, KubernetesConfig, PoolConfig
from direct_frontend.observability.metrics import Metrics

log = logging.getLogger("direct_frontend.pods")

#: pods per page of a list (the API server's ``limit``; ``continue`` fetches the next)
LIST_PAGE = 500
#: a watch that ends sooner than this without an event is retried with backoff
QUICK_WATCH_S = 0.5
#: membership changes this close together reach the supervisor as one edit
COALESCE_S = 0.02
#: how long a reload that restarts every watch waits for them to end before closing their client
WATCHES_END_S = 5.0

ClientFactory = Callable[[KubernetesConfig], httpx.AsyncClient]


class ApiFailure(Exception):
    """The API server answered, but not with what a list or watch needs."""


class Gone(Exception):
    """410 Gone: the resourceVersion is too old to watch from; relist."""


def kube_client(
    settings: KubernetesConfig, source: Path, service_account: Path = Path(SERVICE_ACCOUNT)
) -> httpx.AsyncClient:
    """An HTTP client for the API server: the kubeconfig given, else in-cluster, else ~/.kube.

    In the cluster: the pod's service account (``service_account``: its token,
    re-read when the server says 401 as the kubelet rotates it, its CA and
    namespace) and the ``KUBERNETES_SERVICE_HOST``/``_PORT`` the kubelet sets.
    A kubeconfig user with an ``exec`` plugin gets its tokens from
    :class:`~direct_frontend.control.kube_exec.ExecAuth`. Reads files: call it
    from a worker thread.
    """
    if settings.kubeconfig is not None:
        config = KubeConfig.from_file(source.parent / settings.kubeconfig)
    else:
        config = KubeConfig.from_env(service_account=service_account)
    single = config.get(context_name=settings.context)
    if single is None:
        raise ApiFailure(f"no kubeconfig context {settings.context!r}")
    # a read that waits watch_silence_s for a byte ends the watch: a healthy one sends a
    # bookmark or ends sooner (watch_seconds)
    timeout = httpx.Timeout(10.0, read=settings.watch_silence_s)
    client: httpx.AsyncClient = AsyncClient(single, ConnectionParams(timeout=timeout))
    if single.user is not None and single.user.exec is not None:
        client.auth = ExecAuth(single.user.exec)  # lightkube's needs an asyncio loop
    return client


class PoolWatch:
    """One pool's list-then-watch loop and the membership it keeps.

    Until its first list, a watch started by a reload offers the engines the
    pool had before (``inherited``), so a changed selector reconciles the pool
    without emptying it first. ``backoff_jitter`` draws the jitter of its
    reconnect delays (:class:`~direct_frontend.fleet.pools.Backoff`).
    """

    def __init__(
        self, pool: PoolConfig, settings: KubernetesConfig, metrics: Metrics,
        on_change: Callable[[], None], inherited: tuple[EngineConfig, ...] = (),
        backoff_jitter: random.Random | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.on_change = on_change
        self.membership = PoolMembership(pool)
        self.inherited = inherited
        self.listed = False
        self.stale = False
        self.last_error = ""
        self.stale_since: float | None = None
        self.relists = 0
        self.watches = 0
        self.events = 0
        self.backoff = Backoff(settings.max_backoff_s, backoff_jitter or random.Random())
        self.scope = trio.CancelScope()
        #: set when its task has ended (so the client it used can be closed)
        self.finished = trio.Event()

    @property
    def engines(self) -> tuple[EngineConfig, ...]:
        return self.membership.engines if self.listed else self.inherited

    def status(self) -> dict[str, JsonValue]:
        waiting: dict[str, JsonValue] = dict(self.membership.waiting)
        return {
            "name": self.pool.name,
            "namespace": self.pool.namespace,
            "selector": self.pool.selector,
            "listed": self.listed,
            "stale": self.stale or not self.listed,
            "stale_since": self.stale_since,
            "last_error": self.last_error or None,
            "resource_version": self.membership.resource_version,
            "engines": [engine.name for engine in self.engines],
            "pods_not_serving": waiting,
            "relists": self.relists,
            "watches": self.watches,
            "events": self.events,
        }

    def _changed(self) -> None:
        self.metrics.pool_status(self.pool.name, stale=self.stale or not self.listed,
                                 engines=len(self.engines))
        self.on_change()

    async def run(self, client_of: Callable[[], Awaitable[httpx.AsyncClient]]) -> None:
        """List, watch, relist, for ever; a failure keeps the membership and backs off.

        A configuration that cannot be read fails like an unreachable server:
        the pool is stale and tries again, the daemon runs on. A list that
        succeeds does not end the backoff (:class:`~direct_frontend.fleet.pools.Backoff`):
        a watch reset at once after every list would relist without pause.
        """
        reason = "start"
        with self.scope:
            while True:
                client: httpx.AsyncClient | None = None
                try:
                    client = await client_of()
                    await self._list(client, reason)
                    reason = await self._watch_until_relist(client)
                except RuntimeError:
                    if client is None or not client.is_closed:
                        raise
                    reason = "reconnect"  # closed under us by a reload: the next client
                except (httpx.HTTPError, OSError, ApiFailure, ValueError, ConfigError) as exc:
                    self._failed(exc)
                    await trio.sleep(self.backoff.delay(trio.current_time()))
                    reason = "reconnect"

    def _failed(self, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.metrics.pool_watch_errors_total.labels(self.pool.name).inc()
        if not self.stale or message != self.last_error:
            log.warning("pool %s: the API server failed (%s); keeping its %d engines and"
                        " reconnecting", self.pool.name, message, len(self.engines),
                        extra={"pool": self.pool.name})
        if not self.stale:
            self.stale_since = time.time()
        self.stale, self.last_error = True, message
        self._changed()

    async def _list(self, client: httpx.AsyncClient, reason: str) -> None:
        pods: list[Mapping[str, Any]] = []
        cont: str | None = None
        version = ""
        while True:
            params = list_params(self.pool, LIST_PAGE, cont)
            response = await client.get(pods_path(self.pool), params=params)
            if response.status_code == 410:  # a continue token expired: start over
                cont, pods = None, []
                continue
            body = _json_of(response)
            pods.extend(body.get("items") or [])
            metadata = body.get("metadata") or {}
            version = str(metadata.get("resourceVersion") or version)
            cont = metadata.get("continue") or None
            if cont is None:
                break
        self.membership.relist(pods, version)
        self.relists += 1
        self.metrics.pool_relists_total.labels(self.pool.name, reason).inc()
        if self.stale:
            log.info("pool %s: the API server answers again; membership relisted",
                     self.pool.name, extra={"pool": self.pool.name})
        self.listed, self.stale, self.stale_since, self.last_error = True, False, None, ""
        self.inherited = ()
        self._changed()

    async def _watch_until_relist(self, client: httpx.AsyncClient) -> str:
        """Watch, resuming from the last version, until a relist is due (or a 410 asks for one)."""
        with trio.move_on_after(self.settings.relist_interval_s):
            try:
                while True:
                    if not await self._watch_once(client):
                        # ended at once with nothing: a server that does so would spin us
                        await trio.sleep(self.backoff.delay(trio.current_time()))
            except Gone:
                return "gone"
        return "periodic"

    async def _watch_once(self, client: httpx.AsyncClient) -> bool:
        """One watch request, until the server ends it; 410 raises :class:`Gone`.

        False when it ended at once without an event.
        """
        version = self.membership.resource_version or ""
        params = watch_params(self.pool, version, watch_seconds(self.settings))
        started = trio.current_time()
        seen = 0
        self.watches += 1
        async with client.stream("GET", pods_path(self.pool), params=params) as response:
            if response.status_code == 410:
                raise Gone
            if response.status_code != 200:
                await response.aread()
                raise ApiFailure(f"watch answered HTTP {response.status_code}")
            lines = response.aiter_lines()
            try:
                async for line in lines:
                    event = parse_event(line)
                    if event is None:
                        continue
                    if event.gone:
                        raise Gone
                    if event.type == "ERROR":
                        raise ApiFailure(f"watch error: {event.object.get('message', '')}")
                    seen += 1
                    self.events += 1
                    self.membership.event(event.type, event.object)
                    if event.type != "BOOKMARK":
                        self._changed()
            except httpx.ReadTimeout:  # the client's read timeout is the silence deadline
                silence = self.settings.watch_silence_s
                raise ApiFailure(f"the watch brought nothing for {silence:g} s"
                                 " (a dead connection)") from None
            finally:
                with trio.CancelScope(shield=True):  # closed here, not by the garbage collector
                    await lines.aclose()  # type: ignore[attr-defined]
        return bool(seen) or trio.current_time() - started >= QUICK_WATCH_S


def _json_of(response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        raise ApiFailure(f"list answered HTTP {response.status_code}: {response.text[:200]}")
    body = response.json()
    if not isinstance(body, dict):
        raise ApiFailure("list answered something other than a PodList")
    return body


class PodDiscovery:
    """Every pool's watch, and the one membership they feed the control plane.

    Watch events mark the membership changed; one applier task hands it to
    ``apply`` (the control plane), so a burst of events is one fleet edit.
    """

    def __init__(
        self, fleet: FleetConfig, metrics: Metrics,
        apply: Callable[[Mapping[str, tuple[EngineConfig, ...]]], None],
        client_factory: Callable[[KubernetesConfig, Path], httpx.AsyncClient] = kube_client,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.apply = apply
        self.client_factory = client_factory
        self.watches: dict[str, PoolWatch] = {}
        self._dirty = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._client: httpx.AsyncClient | None = None
        self._client_settings: KubernetesConfig | None = None
        self._client_lock = trio.Lock()
        self.wait_for_pods = fleet.frontend.kubernetes.wait_for_pods
        self._had_engine: set[str] = set()

    def members(self) -> dict[str, tuple[EngineConfig, ...]]:
        return {name: watch.engines for name, watch in self.watches.items()}

    def status(self) -> list[JsonValue]:
        return [watch.status() for watch in self.watches.values()]

    def pending(self, serving_pools: set[str]) -> list[str]:
        """Pools still without a first serving engine, while ``wait_for_pods`` holds /ready.

        ``serving_pools``: the pools with an engine serving now.
        """
        if not self.wait_for_pods:
            return []
        self._had_engine |= serving_pools
        waiting = [pool for pool in self.watches if pool not in self._had_engine]
        if not waiting:
            self.wait_for_pods = False  # start-up only: a pool emptied later holds nothing
        return waiting

    def _mark(self) -> None:
        self._dirty.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._applier)
            await self.reconcile(self.fleet)
            task_status.started()
            await trio.sleep_forever()

    async def _applier(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            self.apply(self.members())
            await trio.sleep(COALESCE_S)  # a burst of events is one edit

    async def reconcile(self, fleet: FleetConfig) -> None:
        """Watch ``fleet``'s pools: new ones start, removed ones stop, changed ones relist.

        A changed pool's new watch offers its old engines until its first list.
        Before :meth:`run`, ``fleet`` is only kept: the watches start from it.
        """
        self.fleet = fleet
        if self._nursery is None:
            return
        settings = fleet.frontend.kubernetes
        wanted = {pool.name: pool for pool in fleet.pools}
        # wait_for_pods is read once, at start: changing it restarts no watch
        restart_all = self._client_settings is None or dataclasses.replace(
            settings, wait_for_pods=False
        ) != dataclasses.replace(self._client_settings, wait_for_pods=False)
        if restart_all and self._client is not None:
            # the watches end first: one that had its last answer in hand when cancelled
            # runs on to its next request before the cancel reaches it, and a request on
            # a closed client is an error that ends the daemon
            for watch in self.watches.values():
                watch.scope.cancel()
            with trio.move_on_after(WATCHES_END_S):
                for watch in self.watches.values():
                    await watch.finished.wait()
            client, self._client = self._client, None
            await client.aclose()
        for name, watch in list(self.watches.items()):
            if restart_all or wanted.get(name) != watch.pool:
                watch.scope.cancel()
                del self.watches[name]
                if name not in wanted:
                    self.metrics.forget_pool(name)
                    self._had_engine.discard(name)
                else:
                    self._start(wanted[name], settings, watch.engines)
        self._client_settings = settings
        for name, pool in wanted.items():
            if name not in self.watches:
                self._start(pool, settings, ())
        self._mark()

    def _start(self, pool: PoolConfig, settings: KubernetesConfig,
               inherited: tuple[EngineConfig, ...]) -> None:
        assert self._nursery is not None
        watch = PoolWatch(pool, settings, self.metrics, self._mark, inherited)
        self.watches[pool.name] = watch
        self._nursery.start_soon(self._run_watch, watch)

    async def _client_of(self) -> httpx.AsyncClient:
        """The API server's client, made on first use (from files, in a worker thread)."""
        async with self._client_lock:
            if self._client is None:
                settings, source = self.fleet.frontend.kubernetes, self.fleet.source
                self._client = await trio.to_thread.run_sync(
                    self.client_factory, settings, source
                )
            return self._client

    async def _run_watch(self, watch: PoolWatch) -> None:
        try:
            await watch.run(self._client_of)
        finally:
            watch.finished.set()

