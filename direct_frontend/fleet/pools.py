"""``[[pool]]`` tables and what a pod watch makes of them (sans-IO).

A pool names engines by a Kubernetes label selector instead of listing them.
This module holds the pool checks of the fleet file (:class:`PoolTables`),
the rule that turns one pod into one engine (:func:`pod_engine`), the
membership of one pool as list and watch events change it
(:class:`PoolMembership`), and how a fleet file's engines and the pools'
engines make the one fleet the supervisor runs (:func:`merge_pool_engines`).
The watch itself (HTTP, reconnects) is :mod:`direct_frontend.control.pods`.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Mapping
from typing import Any

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import Capabilities
from direct_frontend.engines.neutral import EngineRole
from direct_frontend.fleet.address import Endpoint
from direct_frontend.fleet.checker import Checker, keys_of, required_keys
from direct_frontend.fleet.locate import KeyPath
from direct_frontend.fleet.schema import (
    ENGINE_KINDS,
    EngineConfig,
    FleetConfig,
    KubernetesConfig,
    ModelConfig,
    PoolConfig,
)

Pod = Mapping[str, Any]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_KEY = r"(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_LABEL_VALUE = r"(?:[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_REQUIREMENT = re.compile(
    rf"^\s*(?:!?\s*{_LABEL_KEY}"
    rf"|{_LABEL_KEY}\s*(?:==|=|!=)\s*{_LABEL_VALUE}"
    rf"|{_LABEL_KEY}\s+(?:in|notin)\s+\(\s*{_LABEL_VALUE}(?:\s*,\s*{_LABEL_VALUE})*\s*\))\s*$"
)


def selector_problem(selector: str) -> str | None:
    """Why ``selector`` is not a label selector the API server takes (None: it is one)."""
    # commas split requirements, except inside the parentheses of a set
    terms = re.split(r",(?![^()]*\))", selector)
    bad = [term.strip() for term in terms if not _REQUIREMENT.match(term)]
    if bad:
        return f"{bad[0]!r} is not a label requirement (key=value, key!=value, key in (a,b), key)"
    return None


def _capabilities(kind: str) -> Capabilities:
    return dialect_for(kind).capabilities


class EngineRules(Checker):
    """Rules of an engine's settings that a file engine and a pool's engines share."""

    def check_role(self, path: KeyPath, kind: str, role: EngineRole) -> None:
        if role is not EngineRole.BOTH and not _capabilities(kind).prefill_decode:
            self.report((*path, "role"), f'{kind} engines have no P/D roles; use role = "both"')

    def check_bootstrap(
        self,
        path: KeyPath,
        port: int,
        kind: str | None,
        role: EngineRole | None,
        endpoint: Endpoint | None,
    ) -> None:
        where = (*path, "bootstrap_port")
        if kind is not None and not _capabilities(kind).bootstrap_server:
            served = ", ".join(k for k in ENGINE_KINDS if _capabilities(k).bootstrap_server)
            self.report(where, f"only {served} engines have a bootstrap port (this one is {kind})")
        elif role is EngineRole.DECODE:
            self.report(where, "only prefill engines run a bootstrap server (role is decode)")
        if endpoint is not None and endpoint[1] == port:
            self.report(where, f"must differ from the gRPC port in url ({port})")


class PoolTables(EngineRules):
    """Reads ``[[pool]]`` tables: unique names, a namespace, a label selector, the engine rules."""

    def pools(self, value: object, models: list[ModelConfig]) -> list[PoolConfig]:
        pools: list[PoolConfig] = []
        names: dict[str, int] = {}
        for index, item in enumerate(self.array_of_tables(value, ("pool",), "pool"), 1):
            pool = self.pool(item, index, models)
            if pool is None:
                continue
            first = names.setdefault(pool.name, index)
            if first != index:
                message = f"{pool.name!r} is already used by pool[{first}]"
                self.report(("pool", index, "name"), message)
            pools.append(pool)
        return pools

    def pool(self, value: object, index: int, models: list[ModelConfig]) -> PoolConfig | None:
        path: KeyPath = ("pool", index)
        tbl = self.table(value, path, keys_of(PoolConfig))
        if tbl is None:
            return None
        self.required(tbl, path, required_keys(PoolConfig))
        pool = PoolConfig(**self.fields(PoolConfig, tbl, path))
        if "name" in tbl and pool.name and not _DNS_LABEL.match(pool.name):
            self.report((*path, "name"), f"{pool.name!r} is not a DNS label (a-z, 0-9, '-')")
        if "namespace" in tbl and not _DNS_LABEL.match(pool.namespace):
            self.report((*path, "namespace"), f"{pool.namespace!r} is not a namespace name")
        if "selector" in tbl and pool.selector and (problem := selector_problem(pool.selector)):
            self.report((*path, "selector"), problem)
        if pool.kv_replay_port is not None and "kv_events_port" not in tbl:
            self.report((*path, "kv_replay_port"), "needs kv_events_port (replay serves events)")
        self.pool_engine_rules(pool, tbl, path, models)
        return pool

    def pool_engine_rules(
        self, pool: PoolConfig, tbl: Mapping[str, object], path: KeyPath,
        models: list[ModelConfig],
    ) -> None:
        """The rules a file engine's table has that a pool's engines share: role, model, ports."""
        if "kind" in tbl:
            self.check_role(path, pool.kind, pool.role)
        if pool.bootstrap_port is not None:
            self.check_bootstrap(path, pool.bootstrap_port, pool.kind, pool.role, None)
        names = {name for model in models for name in model.names}
        if pool.model is not None and pool.model not in names:
            known = ", ".join(model.name for model in models)
            self.report((*path, "model"), f"{pool.model!r} names no [[model]] (models: {known})")
        elif pool.model is None and len(models) > 1:
            self.report(path, 'a pool of a fleet of several models needs model = "..."')


# -- pods ------------------------------------------------------------------------------


def pod_name(pod: Pod) -> str:
    return str(pod.get("metadata", {}).get("name", ""))


def pod_uid(pod: Pod) -> str:
    return str(pod.get("metadata", {}).get("uid", ""))


def not_serving(pod: Pod) -> str | None:
    """Why the pod may not serve (None: Ready, with an IP, and not being deleted)."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return "being deleted"
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return "has no IP yet"
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return "not Ready"
    return None


def _port(pod: Pod, annotation: str, default: int | None) -> int | str | None:
    """The port from the pod's annotation, else the pool's (a string: why the annotation is bad)."""
    text = (pod.get("metadata", {}).get("annotations") or {}).get(annotation)
    if text is None:
        return default
    if not str(text).isdigit() or not 1 <= int(text) <= 65535:
        return f"annotation {annotation}={text!r} is not a port"
    return int(text)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def rank_endpoints(host: str, port: int, ranks: int) -> tuple[str, ...]:
    """One ZMQ endpoint per data-parallel rank: the engines offset the port by the rank."""
    return tuple(f"tcp://{host}:{port + rank}" for rank in range(ranks))


def pod_engine(pool: PoolConfig, pod: Pod) -> EngineConfig | str:
    """The engine a pod of ``pool`` is, or why it is none (a sentence for ``/fleet``)."""
    reason = not_serving(pod)
    if reason is not None:
        return reason
    host = _host(str(pod["status"]["podIP"]))
    ports = [
        _port(pod, pool.port_annotation, pool.port),
        _port(pod, pool.kv_events_annotation, pool.kv_events_port),
        _port(pod, pool.kv_replay_annotation, pool.kv_replay_port),
    ]
    if (bad := next((p for p in ports if isinstance(p, str)), None)) is not None:
        return bad
    grpc, events, replay = (port if isinstance(port, int) else None for port in ports)
    if grpc is None:
        return f"no gRPC port: no annotation {pool.port_annotation} and the pool sets no port"
    last = max((p for p in (events, replay) if p is not None), default=0) + pool.dp_ranks - 1
    if last > 65535:
        return f"its last data-parallel rank's KV port {last} is not a port"
    return EngineConfig(
        name=f"{pool.name}/{pod_name(pod)}",
        url=f"grpc://{host}:{grpc}",
        kind=pool.kind,
        role=pool.role,
        kv_events=() if events is None else rank_endpoints(host, events, pool.dp_ranks),
        kv_replay=(() if replay is None or events is None
                   else rank_endpoints(host, replay, pool.dp_ranks)),
        dp_ranks=pool.dp_ranks if pool.dp_ranks > 1 else None,
        context_length=pool.context_length,
        block_size=pool.block_size,
        bootstrap_port=pool.bootstrap_port,
        model=pool.model,
        pool=pool.name,
        pod_uid=pod_uid(pod),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """One pod of a pool as last seen: its engine, or why it has none."""

    name: str
    engine: EngineConfig | None
    reason: str = ""


class PoolMembership:
    """The pods of one pool, kept by list and watch events, and the engines they make.

    Pods are keyed by UID, so a pod deleted and created again under the same
    name (a StatefulSet's) is a new engine however fast it comes back; an IP
    change changes the engine's URL, which is a new engine too.
    """

    def __init__(self, pool: PoolConfig) -> None:
        self.pool = pool
        self.resource_version: str | None = None
        self.members: dict[str, Member] = {}  # by pod UID

    def _member(self, pod: Pod) -> Member:
        found = pod_engine(self.pool, pod)
        if isinstance(found, str):
            return Member(pod_name(pod), None, found)
        return Member(pod_name(pod), found)

    def relist(self, pods: list[Pod], resource_version: str) -> None:
        """A full list: it *is* the membership (a pod missing from it is gone)."""
        self.members = {pod_uid(pod): self._member(pod) for pod in pods if pod_uid(pod)}
        self.resource_version = resource_version

    def event(self, kind: str, pod: Pod) -> None:
        """One watch event (ADDED, MODIFIED, DELETED, BOOKMARK) applied."""
        version = pod.get("metadata", {}).get("resourceVersion")
        if version:
            self.resource_version = str(version)
        uid = pod_uid(pod)
        if kind == "BOOKMARK" or not uid:
            return
        if kind == "DELETED":
            self.members.pop(uid, None)
        else:
            self.members[uid] = self._member(pod)

    @property
    def engines(self) -> tuple[EngineConfig, ...]:
        """The serving pods' engines, by name (one per pod name: the newest UID's wins)."""
        by_name = {m.engine.name: m.engine for m in self.members.values() if m.engine is not None}
        return tuple(by_name[name] for name in sorted(by_name))

    @property
    def waiting(self) -> dict[str, str]:
        """Pods that match the selector but do not serve, with why."""
        return {m.name: m.reason for m in self.members.values() if m.engine is None}


# -- the watch protocol ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK or ERROR
    object: Mapping[str, Any]

    @property
    def gone(self) -> bool:
        """An ERROR whose status is 410: the resourceVersion is too old, relist."""
        return self.type == "ERROR" and self.object.get("code") == 410


def parse_event(line: str | bytes) -> WatchEvent | None:
    """One line of a watch stream (None: blank or not an event, skipped)."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("object"), dict):
        return None
    return WatchEvent(str(data.get("type", "")), data["object"])


def pods_path(pool: PoolConfig) -> str:
    return f"/api/v1/namespaces/{pool.namespace}/pods"


def list_params(pool: PoolConfig, limit: int, cont: str | None) -> dict[str, str]:
    params = {"labelSelector": pool.selector, "limit": str(limit)}
    if cont:
        params["continue"] = cont
    return params


def watch_params(pool: PoolConfig, resource_version: str, timeout_s: float) -> dict[str, str]:
    return {
        "labelSelector": pool.selector,
        "watch": "true",
        "allowWatchBookmarks": "true",
        "resourceVersion": resource_version,
        "timeoutSeconds": str(max(1, int(timeout_s))),
    }


def backoff_s(attempt: int, ceiling: float) -> float:
    """Seconds before reconnect ``attempt`` (0-based): 0.1 s doubling, at most ``ceiling``."""
    return float(min(ceiling, 0.1 * 2 ** min(attempt, 16)))


#: the API server sends a watch's last bookmark 2 s before the end the watch asked for; a
#: watch asks to end this much before its silence deadline, so that bookmark (2 s) arrives
#: in time with 3 s to spare for the network
BOOKMARK_LEAD_S = 5.0
#: a failure this long after the retry of the one before starts the backoff over at 0.1 s
BACKOFF_RESET_S = 60.0


def watch_seconds(settings: KubernetesConfig) -> int:
    """How long one watch asks the server to run (its ``timeoutSeconds``).

    ``watch_timeout_s``, but never so long that a quiet watch stays silent
    for ``watch_silence_s``: with ``allowWatchBookmarks`` the API server sends
    a bookmark about once a minute and 2 s before the watch's end, and its
    end closes the stream, so a healthy watch of a quiet pool shows a byte
    within ``watch_silence_s`` and a silent one is a dead connection.
    """
    silent_within = settings.watch_silence_s - BOOKMARK_LEAD_S
    return max(1, int(min(settings.watch_timeout_s, silent_within)))


class Backoff:
    """How long a failed list or watch waits before it tries again (sans-IO).

    The delay is :func:`backoff_s` of the failures in a row, 0.1 s doubling to
    ``ceiling``, each drawn from its upper half by ``jitter`` so the pools of
    many daemons that lost one API server do not come back in step. Failures
    are in a row until one comes more than ``reset_after_s`` after the retry
    that followed the one before: a list that succeeds does not count as
    recovery, since a watch cut at once after every list (a connection reset)
    would otherwise relist every 0.1 s for ever.
    """

    def __init__(self, ceiling: float, jitter: random.Random,
                 reset_after_s: float = BACKOFF_RESET_S) -> None:
        self.ceiling = ceiling
        self.jitter = jitter
        self.reset_after_s = reset_after_s
        self.in_a_row = 0
        self._retry_at: float | None = None

    def delay(self, now: float) -> float:
        """A failure at ``now``: the seconds to wait before the next try."""
        if self._retry_at is not None and now - self._retry_at > self.reset_after_s:
            self.in_a_row = 0
        ceiling = backoff_s(self.in_a_row, self.ceiling)
        self.in_a_row += 1
        wait = self.jitter.uniform(ceiling / 2, ceiling)
        self._retry_at = now + wait
        return wait


# -- one fleet from the file and the pools -----------------------------------------------


def merge_pool_engines(
    fleet: FleetConfig, members: Mapping[str, tuple[EngineConfig, ...]]
) -> tuple[FleetConfig, dict[str, str]]:
    """``fleet`` with its pools' engines, and the pool engines left out with the reason.

    A pool engine whose name or URL a file engine (or an earlier pool) has
    already is left out: the file wins, then the first pool.
    """
    engines = list(fleet.file_engines)
    by_name = {engine.name: engine for engine in engines}
    by_url = {engine.url: engine for engine in engines}
    clashes: dict[str, str] = {}
    for pool in fleet.pools:
        for engine in members.get(pool.name, ()):
            winner = by_name.get(engine.name) or by_url.get(engine.url)
            if winner is not None:
                same = "name" if winner.name == engine.name else "URL"
                clashes[engine.name] = (f"pool {pool.name}: {engine.url} left out, engine "
                                        f"{winner.name} has the same {same}")
                continue
            by_name[engine.name] = engine
            by_url[engine.url] = engine
            engines.append(engine)
    return dataclasses.replace(fleet, engines=tuple(engines)), clashes
