"""The broadcast behind ``/fleet/events``: control-plane events fanned out to viewers.

Built so the control plane never waits for a viewer: every subscriber has a
bounded queue and ``publish`` only ever does ``send_nowait``. A subscriber
that falls behind loses events and is marked; its writer then discards the
stale queue and sends a fresh snapshot carrying the number dropped, so a slow
viewer ends up right, just later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from direct_frontend.fleet.describe import JsonValue

Event = dict[str, JsonValue]

SUBSCRIBER_BUFFER = 256



class Subscriber:
    """One viewer's bounded queue; ``dropped`` counts events it missed."""

    def __init__(self, buffer: int) -> None:
        self._tx, self.rx = trio.open_memory_channel[Event](buffer)
        self.dropped = 0
        self.lagging = False

    def offer(self, event: Event) -> bool:
        """Queue ``event`` without waiting; False if it was dropped because we are behind."""
        try:
            self._tx.send_nowait(event)
        except trio.WouldBlock:
            self.dropped += 1
            self.lagging = True
            return False
        except trio.ClosedResourceError:
            pass  # the viewer is leaving
        return True

    def close(self) -> None:
        self._tx.close()

    def take_lag(self) -> int | None:
        """If events were dropped since the last call: discard the stale queue, return the count."""
        if not self.lagging:
            return None
        self.lagging = False
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
            while True:
                self.rx.receive_nowait()
        return self.dropped


class EventHub:
    """Fan-out of control-plane events to any number of viewers, never blocking."""

    def __init__(self, buffer: int = SUBSCRIBER_BUFFER) -> None:
        self.buffer = buffer
        self.subscribers: set[Subscriber] = set()
        self.dropped_total = 0
        self.closed = False

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[Subscriber]:
        sub = Subscriber(self.buffer)
        if self.closed:
            sub.close()
        self.subscribers.add(sub)
        try:
            yield sub
        finally:
            self.subscribers.discard(sub)
            sub.close()

    def publish(self, event: Event) -> None:
        for sub in list(self.subscribers):
            if not sub.offer(event):
                self.dropped_total += 1

    def close(self) -> None:
        """Shutdown: every viewer's stream ends (so HTTP shutdown does not wait for them)."""
        self.closed = True
        for sub in self.subscribers:
            sub.close()
