"""One replica's NATS client: connect, judge the server it reached, follow its reconnects.

A connect reads the server's ``INFO`` first (control/bus.py ``probe_info``)
and sends nothing to a server this replica will not share over
(``server_problem``); then ``nats.connect``, after which nats-py keeps
reconnecting on its own, and each server it reaches again is judged again.
A server refused (its trust, the credentials it refuses, a certificate not
trusted) stops the daemon's start with
:class:`~direct_frontend.control.bus.NatsRefused`; met later, it is logged
once for each new reason and the link stays degraded until it changes.
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # before nats, see cli.py

# isort: split
import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import trio

from direct_frontend.control.bus import (
    NatsRefused,
    connect_options,
    is_open,
    probe_info,
    refusal,
    server_problem,
)
from direct_frontend.fleet.bus import scrubbed, shown_url
from direct_frontend.fleet.schema import ReplicasConfig

log = logging.getLogger("direct_frontend.replicas")

RECONNECT_WAIT_S = 0.25
CONNECT_TIMEOUT_S = 1.0
CLOSE_TIMEOUT_S = 1.0


class NatsSession:
    """How the replica ``name`` reaches the server of ``config``: ``lost`` is awaited when
    the connection drops, ``back`` when nats-py reconnects to a server it shares over."""

    def __init__(self, config: ReplicasConfig, name: str, *,
                 lost: Callable[[], Awaitable[None]],
                 back: Callable[[], Awaitable[None]]) -> None:
        assert config.nats is not None
        self.config = config
        self.url = config.nats
        self.shown = shown_url(config.nats)  # the URL as logs and /fleet show it
        self.name = name
        self._lost = lost
        self._back = back
        #: why this replica does not share over the server it reached (None: it does)
        self.refusal: str | None = None
        self._options: dict[str, Any] = {}  # nats.connect's credentials and TLS, read at start
        self._last_error = ""  # the NATS client's last complaint (why a connect failed)
        self._said_open = False  # the warning about an open server (insecure = true) is out

    def read_secrets(self, env: Mapping[str, str]) -> None:
        """Read the credentials and TLS files once (a missing one raises ``NatsRefused``)."""
        self._options = connect_options(self.config, env)

    async def connect(self, *, at_start: bool = False) -> tuple[Any, bool] | None:
        """One attempt: the client and whether this replica shares over its server (False:
        degraded until the server changes), or None if it did not connect (said why)."""
        from nats.aio.client import Client  # the replicas extra: imported only when configured

        info = await probe_info(self.url)
        if info is not None and not self.admit(info, at_start=at_start):
            return None  # nothing was sent to it
        self._last_error = ""
        nc = Client()  # held here, so a failed attempt's socket is closed, not left to the GC
        attempt = _Attempt(self)
        failure = await self._open(nc, attempt)
        attempt.connecting = False  # whatever nats-py reports from now on is not about it
        if failure:
            await self._failed(nc, attempt, failure, at_start=at_start)
            return None
        try:
            return nc, self.admit(nc._server_info, at_start=at_start)
        except NatsRefused:
            await close_client(nc)
            raise

    def admit(self, info: dict[str, Any], *, at_start: bool) -> bool:
        """Whether this replica shares over the server that sent ``info``."""
        problem = server_problem(info, self.config)
        if problem is not None:
            self.refuse(problem, at_start=at_start)
            return False
        if is_open(info) and not self._said_open:
            self._said_open = True
            log.warning("replicas: NATS at %s lets any client in (insecure = true): anyone "
                        "who reaches it can read stored responses and steer routing",
                        self.shown)
        self.refusal = None
        return True

    def refuse(self, problem: str, *, at_start: bool) -> None:
        """Not sharing over this server: at start the daemon does not start; later, it
        is said once (each new reason) and the link stays degraded."""
        message = f"replicas: not sharing over NATS at {self.shown}: {problem}"
        if at_start:
            raise NatsRefused(message)
        if problem != self.refusal:
            log.error("%s; routing on local state", message)
        self.refusal = problem

    def client_error(self, exc: Exception) -> str | None:
        """Note what the NATS client complains of; why connecting again cannot help, if so."""
        self._last_error = scrubbed(str(exc), self.url)  # it may quote the URL
        log.debug("replicas: NATS client error: %s", exc)
        return refusal(self._last_error, self.config)

    async def _open(self, nc: Any, attempt: _Attempt) -> str:
        """``nats.connect`` on ``nc``: the name of what stopped it, or "" once connected."""
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S * 2):
                await trio_asyncio.aio_as_trio(nc.connect)(
                    servers=[self.url], name=self.name, no_echo=True,
                    allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=RECONNECT_WAIT_S, connect_timeout=CONNECT_TIMEOUT_S,
                    ping_interval=5, max_outstanding_pings=2,
                    disconnected_cb=self._lost,
                    reconnected_cb=partial(self._reconnected, nc), error_cb=attempt.error,
                    **self._options,
                )
        except Exception as exc:  # nats-py's own, ours from error(), or the timeout
            return exc.__class__.__name__
        return ""

    async def _failed(self, nc: Any, attempt: _Attempt, failure: str, *, at_start: bool) -> None:
        """A connect that failed: its client closed, and why said (or raised, at start)."""
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            await close_client(nc)
        # the server's refusal, though the connection's reset may be reported after it
        problem = attempt.refused or refusal(self._last_error, self.config)
        if problem is not None:
            self.refuse(problem, at_start=at_start)
        else:
            log.warning("replicas: cannot reach NATS at %s (%s); routing on local state",
                        self.shown, failure)

    async def _reconnected(self, nc: Any) -> None:
        # the server may have changed under the same URL: it is judged again
        if self.admit(getattr(nc, "_server_info", None) or {}, at_start=False):
            await self._back()


async def close_client(nc: Any) -> None:
    """Close a NATS client (a failure to is only logged: the link is leaving it anyway)."""
    try:
        await trio_asyncio.aio_as_trio(nc.close)()
    except Exception as exc:
        log.debug("replicas: NATS close: %s", exc)


class _Attempt:
    """One ``nats.connect``'s client errors: while it is under way, a refusal ends it
    (asking again changes nothing); later, nats-py is reconnecting, and a refusal is
    said once and leaves the link degraded."""

    def __init__(self, session: NatsSession) -> None:
        self.session = session
        self.connecting = True  # the first connect; the later reconnects are nats-py's
        self.refused: str | None = None  # its refusal (a reset that follows it is not news)

    async def error(self, exc: Exception) -> None:
        problem = self.session.client_error(exc)
        if problem is None:
            return
        if self.connecting:
            self.refused = self.refused or problem
            # out of nats.connect's retry loop (raised before it half-closes its socket,
            # which nc.close() then closes whole)
            raise NatsRefused(problem)
        self.session.refuse(problem, at_start=False)  # a reconnect refused: said once
