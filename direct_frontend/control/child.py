"""One engine incarnation's task: owns its channel, joins it (discovery + first probe), probes it.

The child publishes its state through ``on_change``; the supervisor turns
the serving children into a new catalog. Nothing here decides routing. The
channel outlives :meth:`EngineChild.run` (a crash restart reuses it, a drain
lets in-flight streams finish on it); the supervisor closes it when the
incarnation is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import trio
from grpclib import Status

from direct_frontend.control.lifecycle import (
    EngineState,
    ProbeOutcome,
    ProbeTracker,
    check_transition,
    is_retired,
    retry_delay,
)
from direct_frontend.control.restarts import RestartCount
from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import Rpc
from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.engines.transport import EngineChannel
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.models import engine_model
from direct_frontend.fleet.schema import (
    ENGINE_KINDS,
    EngineConfig,
    FrontendConfig,
    ModelConfig,
    implicit_model,
)
from direct_frontend.routing.catalog import EngineHandle, EngineLoad

log = logging.getLogger("direct_frontend.engine")


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"engine url {url!r} has no host:port")
    return parts.hostname, parts.port


def engine_id(url: str) -> str:
    """The engine's stable identity: its endpoint, the same whenever the URL is re-added."""
    host, port = host_port(url)
    host = host.lower()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def outcome_of(error: EngineError | trio.TooSlowError) -> ProbeOutcome:
    """A failed call as a probe result: a lost connection is a process gone, not misbehaving."""
    if isinstance(error, EngineError) and error.kind is ErrorKind.UNAVAILABLE:
        return ProbeOutcome.UNREACHABLE
    return ProbeOutcome.FAILED


def effective_context_length(
    cfg: EngineConfig, info: EngineInfo, model: ModelConfig | None = None,
    default: int | None = None,
) -> int | None:
    """The engine's override wins, then its model's, then what discovery says; an engine
    that reports none gets ``default`` (``[frontend] default_context_length``)."""
    return cfg.context_length or (model and model.context_length) or info.context_length or (
        default)


@dataclasses.dataclass(slots=True)
class ProbeRecord:
    ok: bool
    message: str
    at: float


class EngineChild:
    """The lifecycle of one engine incarnation (one numbered life of one engine id)."""

    def __init__(
        self,
        cfg: EngineConfig,
        frontend: FrontendConfig,
        incarnation: int,
        on_change: Callable[[EngineChild, EngineState], None],
        models: Callable[[], Sequence[ModelConfig]] = tuple,
        on_load_change: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        #: the fleet's models as they are now (a reload may change them); checked at each join
        self.models = models
        self.frontend = frontend
        self.incarnation = incarnation
        self.on_change = on_change  # (child, previous state)
        self.id = engine_id(cfg.url)
        self.dialect = dialect_for(cfg.kind)
        self._ranks_warned = False  # a data-parallel rank warning, once per incarnation
        self.probe = frontend.probe
        self.tracker = ProbeTracker(self.probe.failure_threshold, self.probe.success_threshold)
        self.state = EngineState.JOINING
        self.info: EngineInfo | None = None
        self.handle: EngineHandle | None = None
        self.last_probe: ProbeRecord | None = None
        self.last_error = ""
        self.since = time.time()
        self.crashes = 0  # of this task (each restarted it in place)
        self.engine_restarts = RestartCount()  # of the engine process (control/restarts.py)
        #: whether the last (re)join found a restarted engine (the KV plane then resyncs)
        self.restarted_at_join = False
        self.channel: EngineChannel | None = None
        self.load = EngineLoad(on_change=on_load_change)  # its in-flight changes: told there
        self._wake = trio.Event()
        #: failed tries to join since this incarnation last started joining
        self.join_failures = 0
        #: optional discovery calls the engine failed (each logged once)
        self._optional_missing: set[str] = set()
        #: no engine of the fleet serves: try without backing off (set by the supervisor)
        self.hurry = False

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def restarts(self) -> int:
        """Times this engine started over: its process, or its task in the daemon."""
        return self.crashes + self.engine_restarts.total

    def publisher_restarted(self, rank: int) -> None:
        """The KV plane saw rank ``rank``'s KV-event publisher start over: a new process."""
        before = self.engine_restarts.total
        self.engine_restarts.publisher_restarted(rank)
        if self.handle is not None:  # the catalog's handle: routing forgets the old process
            self.handle.life = self.engine_restarts.lives
        self._log_restart(before, "its KV-event publisher started over")

    def _log_restart(self, before: int, witness: str) -> None:
        if self.engine_restarts.total > before:
            log.info(
                "engine %s restarted (%s); %d restart(s) so far", self.name, witness,
                self.engine_restarts.total,
                extra={"engine": self.name, "incarnation": self.incarnation},
            )

    @property
    def in_flight(self) -> int:
        """Requests still running on this incarnation (a drain waits for zero)."""
        return self.load.in_flight

    def _set_state(self, state: EngineState, reason: str = "") -> None:
        if is_retired(self.state) and state is not EngineState.GONE:
            return  # a late probe result or fault: a retired engine stays out
        check_transition(self.state, state)
        if state is self.state and not reason:
            return
        previous = self.state
        self.state = state
        if state is not previous:
            self.since = time.time()
            log.info(
                "engine %s is %s", self.name, state.value,
                extra={"engine": self.name, "incarnation": self.incarnation, "reason": reason},
            )
        self.on_change(self, previous)

    def report_fault(self, error: EngineError) -> None:
        """A request saw this engine fail at the transport: take it out now."""
        if is_retired(self.state):
            return
        self.last_error = str(error)
        if self.tracker.fault(outcome_of(error)) is not None:
            self._set_state(EngineState.UNHEALTHY, self.last_error)
            self._wake.set()

    def crashed(self, error: BaseException) -> None:
        """The task died; it will run again from joining (the channel is kept)."""
        self.crashes += 1
        self.last_error = f"crashed: {error!r}"
        self.handle = None
        self._set_state(self.tracker.rejoining(), self.last_error)

    def retire(self, reason: str) -> None:
        """Take no new requests from now on (the supervisor drains, then ends us)."""
        self._set_state(EngineState.DRAINING, reason)

    def gone(self, reason: str) -> None:
        self._set_state(EngineState.GONE, reason)

    def retune(self, frontend: FrontendConfig) -> None:
        """Apply a reloaded ``[frontend]`` (probe settings) without touching the connection."""
        self.frontend = frontend
        self.probe = frontend.probe
        self.tracker.retune(self.probe.failure_threshold, self.probe.success_threshold)
        self._wake.set()  # the next probe follows the new interval

    def hurry_up(self, hurry: bool) -> None:
        """Whether no engine serves: while none does, an engine that is out is tried fast."""
        if hurry != self.hurry:
            self.hurry = hurry
            if hurry:
                self._wake.set()  # the wait under way may be a long backoff

    def open_channel(self) -> EngineChannel:
        """The incarnation's channel (call inside the trio-asyncio loop)."""
        if self.channel is None:
            host, port = host_port(self.cfg.url)
            self.channel = EngineChannel(host, port, self.dialect)
        return self.channel

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()

    async def run(self) -> None:
        """Join, then probe until cancelled (draining or shutdown cancels us)."""
        self.open_channel()
        await self._join()
        await self._probe_forever()

    async def _join(self) -> None:
        """Discover the engine until it answers with our model and passes one probe.

        Tried again fast while it fails (:func:`retry_delay`); a refused engine
        answers, so it is re-checked every probe interval. Why it has not
        joined is logged once, and again whenever the reason changes.
        """
        assert self.channel is not None
        self.join_failures = 0
        logged = ""
        while True:
            try:
                with trio.fail_after(self.probe.join_timeout_s):
                    info = await self._discover()
                    model = self._model_of(info)
                    if isinstance(model, str):
                        self.last_error = model
                        self._set_state(EngineState.REFUSED, self.last_error)
                    elif await self._probe_once() is ProbeOutcome.HEALTHY:
                        self._serve(info, model)
                        return
            except (EngineError, trio.TooSlowError) as exc:
                self.last_error = str(exc) or "discovery timed out"
                if self.state is not EngineState.JOINING:
                    self._set_state(EngineState.JOINING, self.last_error)
            if self.last_error != logged:
                logged = self.last_error
                log.warning(
                    "engine %s has not joined: %s", self.name, logged,
                    extra={"engine": self.name, "incarnation": self.incarnation},
                )
            if self.state is EngineState.REFUSED:
                delay = self.probe.interval_s
            else:
                delay = retry_delay(self.join_failures, self.probe.interval_s, hurry=self.hurry)
            self.join_failures += 1
            with trio.move_on_after(delay):
                await self._wake.wait()
            self._wake = trio.Event()

    def _model_of(self, info: EngineInfo) -> ModelConfig | str:
        """The model the engine joins, or why it is refused."""
        models = self.models() or (implicit_model(self.frontend),)
        return engine_model(self.cfg, info, models)

    async def _discover(self) -> EngineInfo:
        assert self.channel is not None
        replies: list[Any] = []
        for rpc in self.dialect.discovery():
            try:
                replies.append(await self.channel.unary(rpc, self.probe.timeout_s))
                self._optional_missing.discard(rpc.path)  # a restarted engine may serve it now
            except EngineError as exc:
                if not rpc.optional:
                    raise self._kind_hint(exc) from None
                self._without(rpc, exc, "joining without it")
                replies.append(None)
        return self.dialect.engine_info(replies)

    def _kind_hint(self, exc: EngineError) -> EngineError:
        """``exc``, with a hint at the ``kind`` setting when the engine lacks the method.

        Every engine of a kind serves its discovery methods, so UNIMPLEMENTED there
        ("Method not found!") nearly always means an engine of another kind: its gRPC
        services have other names.
        """
        if not exc.message.startswith(Status.UNIMPLEMENTED.name):
            return exc
        table = f"[[pool]] {self.cfg.pool}" if self.cfg.pool else "[[engine]]"
        hint = (f"is this engine a {self.cfg.kind}? check the {table} kind "
                f"({', '.join(ENGINE_KINDS)})")
        return EngineError(exc.kind, f"{exc.message} ({hint})", engine=exc.engine,
                           param=exc.param)

    def _without(self, rpc: Rpc, exc: EngineError, meaning: str) -> None:
        """The engine does not serve optional ``rpc``: not asked again, logged once."""
        if rpc.path not in self._optional_missing:
            self._optional_missing.add(rpc.path)
            log.info("engine %s does not answer %s (%s); %s", self.name,
                     rpc.path.rsplit("/", 1)[-1], exc, meaning,
                     extra={"engine": self.name, "incarnation": self.incarnation})

    def _serve(self, info: EngineInfo, model: ModelConfig) -> None:
        assert self.channel is not None
        before = self.engine_restarts.total
        self.restarted_at_join = self.engine_restarts.discovered(
            info.incarnation, self.channel.connections_opened
        )
        self._log_restart(before, "its reported start changed" if info.incarnation
                          else "it was reached again over a new connection")
        role = self.cfg.role
        if role is EngineRole.BOTH:
            role = info.role or role
        self.info = info
        self.handle = EngineHandle(
            name=self.name,
            kind=self.cfg.kind,
            url=self.cfg.url,
            incarnation=self.incarnation,
            role=role,
            info=info,
            context_length=effective_context_length(self.cfg, info, model,
                                                    self.frontend.default_context_length),
            transport=self.channel,
            load=self.load,  # one per incarnation: a re-join keeps the requests in flight
            life=self.engine_restarts.lives,
            bootstrap_port=self.cfg.bootstrap_port or info.bootstrap_port,
            model=model.name,
            dp_ranks=self._pinned_ranks(info, role),
        )
        self.tracker.joined()
        self.last_error = ""
        self._set_state(EngineState.SERVING)

    def _pinned_ranks(self, info: EngineInfo, role: EngineRole) -> tuple[int, ...]:
        """The ranks KV-aware routing pins requests to, from the servicer's first on.

        One per KV-event endpoint (the fleet file lists them in rank order),
        or ``dp_ranks`` for an engine without KV events (the approximate
        memory then models each rank's cache). Only a whole-request engine of a
        kind whose stock engine honours a rank (vLLM) is pinned, only when it
        has at least that many ranks (a rank it lacks would refuse every
        request) and only when it says which (its first). Fewer than it has
        leaves the other ranks' caches unseen. A mismatch is a warning, once.
        """
        cfg = self.cfg
        ranks = len(cfg.kv_events) or cfg.dp_ranks or 0
        size = info.data_parallel_size
        said = (f"lists {ranks} kv_events endpoint(s)" if cfg.kv_events
                else f"says dp_ranks = {ranks}")
        if ranks and ranks != size and not self._ranks_warned:
            self._ranks_warned = True
            advice = (f"unless its servicer serves only {ranks} of them (multi-node data "
                      "parallelism), list one per rank (base port + rank) so that KV-aware "
                      "routing sees every rank's cache" if ranks < size
                      else "requests are not pinned to ranks")
            log.warning("engine %s has %d data-parallel ranks but the fleet file %s: %s",
                        self.name, size, said, advice, extra={"engine": self.name})
        first = info.first_dp_rank
        if (ranks < 2 or ranks > size or role is not EngineRole.BOTH
                or not info.generates or not self.dialect.capabilities.dp_rank_pin):
            return ()
        if first is None:
            if not self._ranks_warned:
                self._ranks_warned = True
                log.warning("engine %s does not say which data-parallel ranks its servicer "
                            "serves (no GetLoads): requests are not pinned to ranks",
                            self.name, extra={"engine": self.name})
            return ()
        return tuple(range(first, first + ranks))

    async def _probe_once(self) -> ProbeOutcome:
        assert self.channel is not None
        try:
            with trio.fail_after(self.probe.timeout_s + 0.5):
                reply = await self.channel.unary(self.dialect.health(), self.probe.timeout_s)
            result = self.dialect.health_result(reply)
            message = result.message
            outcome = ProbeOutcome.HEALTHY if result.healthy else ProbeOutcome.FAILED
        except (EngineError, trio.TooSlowError) as exc:
            message = str(exc) or "probe timed out"
            outcome = outcome_of(exc)
        ok = outcome is ProbeOutcome.HEALTHY
        self.last_probe = ProbeRecord(ok, message, time.time())
        if not ok:
            self.last_error = message
        return outcome

    async def _probe_forever(self) -> None:
        while True:
            delay = self.tracker.next_delay(self.probe.interval_s, hurry=self.hurry)
            with trio.move_on_after(delay):
                await self._wake.wait()
            self._wake = trio.Event()
            outcome = await self._probe_once()
            changed = self.tracker.record(outcome)
            if changed is EngineState.UNHEALTHY:
                self._set_state(changed, self.last_error)
            elif changed is EngineState.SERVING:
                await self._rejoin()
            if outcome is ProbeOutcome.HEALTHY and self.state is EngineState.SERVING:
                await self._read_loads()
            else:
                self.load.engine_reported(None)

    async def _read_loads(self) -> None:
        """The engine's requests from every client, so a policy weighs the others' too."""
        rpc = self.dialect.loads()
        if rpc is None or not self.probe.read_loads or rpc.path in self._optional_missing:
            return
        assert self.channel is not None
        try:
            with trio.fail_after(self.probe.timeout_s + 0.5):
                reply = await self.channel.unary(rpc, self.probe.timeout_s)
            requests: int | None = self.dialect.engine_requests(reply)
            ranks = self.dialect.rank_requests(reply)
        except (EngineError, trio.TooSlowError) as exc:
            requests, ranks = None, {}  # a stale figure is worse than none: count ours alone
            if isinstance(exc, EngineError) and exc.kind is ErrorKind.BAD_REQUEST:
                self._without(rpc, exc, "weighing our own requests only")  # UNIMPLEMENTED
        self.load.engine_reported(requests, ranks)

    async def _rejoin(self) -> None:
        """Back from unhealthy: re-discover, since the engine may have restarted."""
        try:
            with trio.fail_after(self.probe.join_timeout_s):
                info = await self._discover()
        except (EngineError, trio.TooSlowError) as exc:
            self.last_error = str(exc) or "discovery timed out"
            self.tracker.record(outcome_of(exc))  # still out: a failed try like any other
            return
        model = self._model_of(info)
        if isinstance(model, str):
            self.last_error = f"now refused: {model}"
            self._set_state(EngineState.REFUSED, self.last_error)
            await self._join()
            return
        self._serve(info, model)

