"""All that http/ sees of the control plane: read-only views, and asking for a reload.

A protocol, so the HTTP shell never imports the control plane: the daemon
hands the app whatever implements it (``control.reload.ControlPlane``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import trio

from direct_frontend.fleet.describe import JsonValue
from direct_frontend.pipeline.models import ModelTable
from direct_frontend.pipeline.settings import Settings

Event = dict[str, JsonValue]


class EventFeed(Protocol):
    """One viewer's receive side of the control plane's event broadcast."""

    @property
    def rx(self) -> trio.abc.ReceiveChannel[Event]:
        """The events; it ends (or closes) when the daemon shuts down."""

    def take_lag(self) -> int | None:
        """If events were dropped since the last call: discard the stale ones, say how many."""


class ControlView(Protocol):
    @property
    def settings(self) -> Settings:
        """The snapshot new requests run under (replaced whole on reload)."""

    @property
    def models(self) -> ModelTable:
        """The models served, each with its own settings snapshot (replaced whole on reload)."""

    def waiting_for_pools(self) -> list[str]:
        """Pools whose first serving engine ``/ready`` still waits for."""

    def ready(self) -> tuple[int, int]:
        """(engines serving, engines in the fleet file)."""

    def status(self) -> dict[str, JsonValue]:
        """``GET /fleet``: engines, the running config and the last reload."""

    def loads(self) -> dict[str, JsonValue]:
        """Requests in flight per engine incarnation."""

    def request_counts(self) -> dict[str, JsonValue]:
        """Requests sent so far per engine incarnation (``requests`` in ``status``)."""

    def subscribe(self) -> AbstractContextManager[EventFeed]:
        """A feed of control-plane events for as long as the block runs."""

    async def reload(self, trigger: str) -> dict[str, JsonValue]:
        """Reload the fleet file; the result as JSON."""

    def collect_metrics(self) -> None:
        """Bring the control plane's gauges up to date before a scrape."""
