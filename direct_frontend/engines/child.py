"""One engine's task: owns its channel, joins it (discovery + first probe), probes it.

The child publishes its state through ``on_change``; the supervisor turns
the serving children into a new catalog. Nothing here decides routing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import trio

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.lifecycle import EngineState, ProbeTracker
from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.engines.transport import EngineChannel
from direct_frontend.errors import EngineError
from direct_frontend.fleet.schema import EngineConfig, FrontendConfig
from direct_frontend.routing.catalog import EngineHandle

log = logging.getLogger("direct_frontend.engine")


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"engine url {url!r} has no host:port")
    return parts.hostname, parts.port


def effective_context_length(cfg: EngineConfig, info: EngineInfo) -> int | None:
    """The fleet file's override wins; otherwise what the dialect trusts from discovery."""
    return cfg.context_length or info.context_length


@dataclasses.dataclass(slots=True)
class ProbeRecord:
    ok: bool
    message: str
    at: float


class EngineChild:
    """The lifecycle of one engine incarnation (one generation of one engine id)."""

    def __init__(
        self,
        cfg: EngineConfig,
        frontend: FrontendConfig,
        generation: int,
        on_change: Callable[[EngineChild], None],
    ) -> None:
        self.cfg = cfg
        self.frontend = frontend
        self.generation = generation
        self.on_change = on_change
        self.dialect = dialect_for(cfg.kind)
        self.probe = frontend.probe
        self.tracker = ProbeTracker(self.probe.failure_threshold, self.probe.success_threshold)
        self.state = EngineState.JOINING
        self.info: EngineInfo | None = None
        self.handle: EngineHandle | None = None
        self.last_probe: ProbeRecord | None = None
        self.last_error = ""
        self.since = time.time()
        self.restarts = 0
        self.channel: EngineChannel | None = None
        self._wake = trio.Event()

    @property
    def name(self) -> str:
        return self.cfg.name

    def _set_state(self, state: EngineState, reason: str = "") -> None:
        if state is self.state and not reason:
            return
        changed = state is not self.state
        self.state = state
        if changed:
            self.since = time.time()
            log.info(
                "engine %s is %s", self.name, state.value,
                extra={"engine": self.name, "generation": self.generation, "reason": reason},
            )
        self.on_change(self)

    def report_fault(self, error: EngineError) -> None:
        """A request saw this engine fail at the transport: take it out now."""
        self.last_error = str(error)
        if self.tracker.fault() is not None:
            self._set_state(EngineState.UNHEALTHY, self.last_error)
            self._wake.set()

    async def run(self) -> None:
        host, port = host_port(self.cfg.url)
        self.channel = EngineChannel(host, port, self.dialect)
        try:
            await self._join()
            await self._probe_forever()
        finally:
            self.channel.close()

    async def _join(self) -> None:
        """Discover the engine until it answers with our model and passes one probe."""
        assert self.channel is not None
        delay = min(0.05, self.probe.interval_s)
        while True:
            try:
                with trio.fail_after(self.probe.join_timeout_s):
                    info = await self._discover()
                    if info.served_model_name != self.frontend.served_model_name:
                        self.last_error = (
                            f"serves model {info.served_model_name!r}, "
                            f"the fleet serves {self.frontend.served_model_name!r}"
                        )
                        self._set_state(EngineState.REFUSED, self.last_error)
                    elif await self._probe_once():
                        self._serve(info)
                        return
            except (EngineError, trio.TooSlowError) as exc:
                self.last_error = str(exc) or "discovery timed out"
                if self.state is not EngineState.JOINING:
                    self._set_state(EngineState.JOINING, self.last_error)
            await trio.sleep(delay)
            delay = min(delay * 2, self.probe.interval_s)

    async def _discover(self) -> EngineInfo:
        assert self.channel is not None
        replies = [
            await self.channel.unary(rpc, self.probe.timeout_s) for rpc in self.dialect.discovery()
        ]
        return self.dialect.engine_info(replies)

    def _serve(self, info: EngineInfo) -> None:
        role = self.cfg.role if self.cfg.role is not EngineRole.BOTH else (info.role or self.cfg.role)
        previous = self.handle
        self.info = info
        self.handle = EngineHandle(
            name=self.name,
            kind=self.cfg.kind,
            url=self.cfg.url,
            generation=self.generation,
            role=role,
            info=info,
            context_length=effective_context_length(self.cfg, info),
            transport=self.channel,
        )
        if previous is not None:  # a re-join keeps the load of requests still in flight
            self.handle.load = previous.load
        self.tracker.joined()
        self.last_error = ""
        self._set_state(EngineState.SERVING)

    async def _probe_once(self) -> bool:
        assert self.channel is not None
        try:
            with trio.fail_after(self.probe.timeout_s + 0.5):
                reply = await self.channel.unary(self.dialect.health(), self.probe.timeout_s)
            result = self.dialect.health_result(reply)
            ok, message = result.healthy, result.message
        except (EngineError, trio.TooSlowError) as exc:
            ok, message = False, str(exc) or "probe timed out"
        self.last_probe = ProbeRecord(ok, message, time.time())
        if not ok:
            self.last_error = message
        return ok

    async def _probe_forever(self) -> None:
        while True:
            with trio.move_on_after(self.probe.interval_s):
                await self._wake.wait()
            self._wake = trio.Event()
            ok = await self._probe_once()
            changed = self.tracker.record(ok)
            if changed is EngineState.UNHEALTHY:
                self._set_state(changed, self.last_error)
            elif changed is EngineState.SERVING:
                await self._rejoin()

    async def _rejoin(self) -> None:
        """Back from unhealthy: re-discover, since the engine may have restarted."""
        try:
            with trio.fail_after(self.probe.join_timeout_s):
                info = await self._discover()
        except (EngineError, trio.TooSlowError) as exc:
            self.last_error = str(exc) or "discovery timed out"
            self.tracker.fault()
            return
        if info.served_model_name != self.frontend.served_model_name:
            self.last_error = f"now serves model {info.served_model_name!r}"
            self._set_state(EngineState.REFUSED, self.last_error)
            await self._join()
            return
        self._serve(info)
