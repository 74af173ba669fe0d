"""Admission control: a cap on requests in flight and a bounded, timed queue in front of it.

The daemon must never melt down under a burst: past ``max_in_flight`` a
request waits in a queue of at most ``max_queue`` places for at most
``queue_timeout_s``; beyond that it is refused at once with a 429, which
costs almost nothing. The queue is fair between tenants (pipeline/fair.py):
a request names its flow (the tenant it is sent for), and a freed slot goes
to the flow whose turn it is by weight, not to whoever queued first, so one
tenant's burst does not keep the others waiting behind it. With one flow (a
server without API keys) it is first come, first served.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import trio

from direct_frontend.fleet.schema import LimitsConfig, TenantsConfig
from direct_frontend.openai.errors import OpenAIHTTPError, rate_limited
from direct_frontend.pipeline.fair import FairQueue, Waiter


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


#: a tenant that asked this recently is active: the others leave it headroom
ACTIVE_S = 10.0
#: slots left free for each active tenant short of its share (fewer if it is nearly there)
SPARE = 1


class Admission:
    """The cap and its fair queue.

    ``observe_wait`` hears how long each admitted request waited (the
    queue-wait histogram); ``tenants`` gives each flow its weight and cap
    (``[frontend.tenants]``; by default every flow weighs 1, capped by the
    model's limit alone).
    """

    def __init__(self, config: AdmissionConfig,
                 observe_wait: Callable[[float], None] | None = None,
                 tenants: TenantsConfig | None = None) -> None:
        self.config = config
        self.observe_wait = observe_wait
        tenants = tenants or TenantsConfig()
        weights, default = tenants.weights(), tenants.default_weight
        self._caps, self._default_cap = tenants.caps(), tenants.max_in_flight
        self._free = config.max_in_flight
        self._queue = FairQueue(lambda flow: weights.get(flow, default))
        self._wake: dict[Waiter, trio.Event] = {}
        self._held: dict[str, int] = {}  # slots each flow holds
        self._pushed_out: set[Waiter] = set()  # refused to make room for another tenant
        #: when each tenant last asked (those of the last ACTIVE_S only)
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._seen_weight = 0.0  # the active tenants' weights, summed
        #: the most slots a tenant past its share leaves free for the others (see _fits)
        self._headroom = config.max_in_flight // 4
        #: background work's share of the slots (:meth:`background_slot`)
        self._background = trio.CapacityLimiter(max(1, config.max_in_flight // 2))
        self.rejected = 0

    @property
    def in_flight(self) -> int:
        return self.config.max_in_flight - self._free

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def refuse_if_full(self, count: int = 1) -> None:
        """Raise :class:`Rejected` now if ``count`` slots would find the queue full.

        For work that is accepted at once and admitted later (a background
        response): its client hears the 429 instead of a failure after the fact.
        """
        if self._free < min(count, self.config.max_in_flight) and (
                len(self._queue) >= self.config.max_queue):
            self.rejected += 1
            raise Rejected("the request queue is full")

    @contextlib.asynccontextmanager
    async def background_slot(self, flow: str = "") -> AsyncIterator[None]:
        """One slot for work no client waits on (a background response) of ``flow``.

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
            async with self.slot(1, flow):
                yield
        finally:
            self._background.release()

    @contextlib.asynccontextmanager
    async def slot(self, count: int = 1, flow: str = "") -> AsyncIterator[None]:
        """Hold ``count`` in-flight slots (one per choice) for ``flow`` for the duration of
        the block.

        A request of more choices than ``max_in_flight`` takes every slot, so
        it waits for the daemon to drain rather than never running. The
        request chosen next keeps its turn until enough slots are free, so a
        request of several choices is not passed over for ever.
        """
        count = min(count, self.config.max_in_flight)
        waited_from = trio.current_time()
        self._saw(flow, waited_from)
        if not self._queue and self._free >= count and self._fits(flow, count):
            self._grant(flow, count)
        else:
            await self._wait(flow, count)
        if self.observe_wait is not None:
            self.observe_wait(trio.current_time() - waited_from)
        try:
            yield
        finally:
            self._release(flow, count)

    async def _wait(self, flow: str, count: int) -> None:
        """Queue for ``count`` slots until granted; :class:`Rejected` when the queue is full
        or the wait times out (a cancelled wait leaves nothing behind)."""
        if len(self._queue) >= self.config.max_queue:
            self._push_out(flow)
        waiter = self._queue.push(flow, count)
        granted = self._wake[waiter] = trio.Event()
        self._dispatch()
        try:
            with trio.move_on_after(self.config.queue_timeout_s):
                await granted.wait()
        except BaseException:
            self._leave(waiter, granted, flow, count)
            raise
        if waiter in self._pushed_out:
            self._pushed_out.discard(waiter)
            raise Rejected("the request queue is full, and this tenant holds the most of it")
        if not granted.is_set():
            self._leave(waiter, granted, flow, count)
            self.rejected += 1
            raise Rejected("timed out waiting for a free slot")

    def _push_out(self, flow: str) -> None:
        """The queue is full: make room for ``flow`` by refusing the newest request of the
        tenant holding the most places, if that is another with more than ``flow`` has; else
        :class:`Rejected` for ``flow``. A flood fills the queue, but never keeps a quieter
        tenant out of it."""
        longest, places = self._queue.longest()
        if longest == flow or places <= self._queue.waiting(flow) + 1:
            self.rejected += 1
            raise Rejected("the request queue is full")
        victim = self._queue.newest(longest)
        self._queue.cancel(victim)
        self._pushed_out.add(victim)
        self.rejected += 1
        self._wake.pop(victim).set()

    def _leave(self, waiter: Waiter, granted: trio.Event, flow: str, count: int) -> None:
        """A wait that ends without its slots: out of the queue, or, granted meanwhile,
        the slots given back."""
        if granted.is_set():
            self._release(flow, count)
        else:
            self._queue.cancel(waiter)
            del self._wake[waiter]
            self._dispatch()  # it may have held the others back (a turn it could not take)

    def _fits(self, flow: str, count: int) -> bool:
        """Whether ``flow`` may hold ``count`` more slots.

        Under its cap; and a tenant past its fair share of the slots (by
        weight, among the tenants active within :data:`ACTIVE_S`) leaves one
        slot free for each other active tenant short of its share, so that
        tenant's next request starts at once instead of waiting for a slot to
        end. Alone, or with everyone at its share, a tenant takes every slot:
        the queue stays work-conserving.
        """
        held = self._held.get(flow, 0) + count
        cap = self._caps.get(flow, self._default_cap)
        if cap and held > max(cap, count):
            return False
        self._forget_idle()
        if len(self._seen) < 2:
            return True
        weight, slots, total = self._queue.weight, self.config.max_in_flight, self._seen_weight
        if held <= slots * weight(flow) / total:
            return True
        wanted = min(self._headroom, self._free)  # past it, nothing more to count
        short = 0.0
        for other in self._seen:
            if other != flow:
                short += max(0.0, min(SPARE, slots * weight(other) / total
                                      - self._held.get(other, 0)))
                if short >= wanted:
                    break
        return self._free - count >= min(short, self._headroom)

    def _saw(self, flow: str, now: float) -> None:
        """``flow`` asked at ``now``: it is active (the most recent last)."""
        if flow not in self._seen:
            self._seen_weight += self._queue.weight(flow)
        self._seen[flow] = now
        self._seen.move_to_end(flow)

    def _forget_idle(self) -> None:
        """Forget the tenants that asked nothing within :data:`ACTIVE_S` (oldest first: the
        map is in the order they last asked, so this stops at the first still active)."""
        since = trio.current_time() - ACTIVE_S
        while self._seen:
            flow, seen = next(iter(self._seen.items()))
            if seen >= since:
                return
            del self._seen[flow]
            self._seen_weight = (self._seen_weight - self._queue.weight(flow)) if self._seen \
                else 0.0  # none left: no rounding carried over

    def _grant(self, flow: str, count: int) -> None:
        self._free -= count
        self._held[flow] = self._held.get(flow, 0) + count

    def _release(self, flow: str, count: int) -> None:
        self._free += count
        left = self._held[flow] - count
        if left:
            self._held[flow] = left
        else:
            del self._held[flow]
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant free slots to the waiting requests in fair order."""
        while self._queue:
            waiter = self._queue.next(lambda head: self._fits(head.flow, head.cost))
            if waiter is None or waiter.cost > self._free:
                return
            self._queue.pop(waiter)
            self._grant(waiter.flow, waiter.cost)
            self._wake.pop(waiter).set()
