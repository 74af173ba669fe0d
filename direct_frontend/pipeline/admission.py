"""Admission control: a cap on requests in flight and a bounded, timed queue in front of it.

The daemon must never melt down under a burst: past ``max_in_flight`` a
request waits in a FIFO queue of at most ``max_queue`` places for at most
``queue_timeout_s``; beyond that it is refused at once with a 429, which
costs almost nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import trio

from direct_frontend.fleet.schema import LimitsConfig
from direct_frontend.openai.errors import OpenAIHTTPError, rate_limited


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """``[frontend.limits]`` (whose defaults are the schema's)."""

    max_in_flight: int
    max_queue: int
    queue_timeout_s: float


def admission_config(limits: LimitsConfig) -> AdmissionConfig:
    return AdmissionConfig(limits.max_in_flight, limits.max_queue, limits.queue_timeout_s)


class Rejected(Exception):
    """Not admitted: the queue is full or the wait timed out."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def saturated(rejected: Rejected) -> OpenAIHTTPError:
    """The 429 for a request the admission queue would not take."""
    return rate_limited(f"The frontend is saturated: {rejected.reason}.", retry_after=1)


class Admission:
    """The cap and its queue; ``observe_wait`` hears how long each admitted request waited
    (the queue-wait histogram)."""

    def __init__(self, config: AdmissionConfig,
                 observe_wait: Callable[[float], None] | None = None) -> None:
        self.config = config
        self.observe_wait = observe_wait
        self._slots = trio.Semaphore(config.max_in_flight)
        self._gathering = trio.Lock()  # held by the one request gathering several slots
        #: background work's share of the slots (:meth:`background_slot`)
        self._background = trio.CapacityLimiter(max(1, config.max_in_flight // 2))
        self.waiting = 0
        self.rejected = 0

    @property
    def in_flight(self) -> int:
        return self.config.max_in_flight - self._slots.value

    def refuse_if_full(self, count: int = 1) -> None:
        """Raise :class:`Rejected` now if ``count`` slots would find the queue full.

        For work that is accepted at once and admitted later (a background
        response): its client hears the 429 instead of a failure after the fact.
        """
        if self._slots.value < min(count, self.config.max_in_flight) and (
                self.waiting >= self.config.max_queue):
            self.rejected += 1
            raise Rejected("the request queue is full")

    @contextlib.asynccontextmanager
    async def background_slot(self) -> AsyncIterator[None]:
        """One slot for work no client waits on (a background response).

        Such work holds at most half the slots: however much of it is asked
        for, the other half stays for the requests a client is waiting on. Its
        wait for its half is bounded as the queue's is.
        """
        with trio.move_on_after(self.config.queue_timeout_s) as wait:
            await self._background.acquire()
        if wait.cancelled_caught:
            self.rejected += 1
            raise Rejected("timed out waiting for a free slot")
        try:
            async with self.slot(1):
                yield
        finally:
            self._background.release()

    @contextlib.asynccontextmanager
    async def slot(self, count: int = 1) -> AsyncIterator[None]:
        """Hold ``count`` in-flight slots (one per choice) for the duration of the block.

        A request of more choices than ``max_in_flight`` takes every slot, so
        it waits for the daemon to drain rather than never running.
        """
        count = min(count, self.config.max_in_flight)
        try:
            self._take_nowait(count)
            queued = False
        except trio.WouldBlock:
            queued = True
        observe, waited_from = self.observe_wait, trio.current_time()
        if queued:
            if self.waiting >= self.config.max_queue:
                self.rejected += 1
                raise Rejected("the request queue is full")
            self.waiting += 1
            try:
                with trio.move_on_after(self.config.queue_timeout_s) as wait:
                    await self._take(count)
            finally:
                self.waiting -= 1
            if wait.cancelled_caught:
                self.rejected += 1
                raise Rejected("timed out waiting for a free slot")
        if observe is not None:
            observe(trio.current_time() - waited_from)
        try:
            yield
        finally:
            for _ in range(count):
                self._slots.release()

    def _take_nowait(self, count: int) -> None:
        """All ``count`` slots at once, or none (``WouldBlock``)."""
        if count == 1:
            self._slots.acquire_nowait()
            return
        if self._slots.value < count or self._gathering.locked():
            raise trio.WouldBlock
        for _ in range(count):
            self._slots.acquire_nowait()

    async def _take(self, count: int) -> None:
        """Wait for ``count`` slots, FIFO with every other waiter.

        Requests of several slots gather theirs one at a time, one such
        request at a time, so two of them never hold part of what the other
        waits for (no deadlock); a cancelled gathering gives its slots back.
        """
        if count == 1:
            await self._slots.acquire()
            return
        async with self._gathering:
            taken = 0
            try:
                while taken < count:
                    await self._slots.acquire()
                    taken += 1
            except BaseException:
                for _ in range(taken):
                    self._slots.release()
                raise
