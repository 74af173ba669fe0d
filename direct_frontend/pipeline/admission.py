"""Admission control: a cap on requests in flight and bounded, timed queues in front of it.

The daemon must never melt down under a burst: past ``max_in_flight`` a
request waits in a queue of at most ``max_queue`` places for at most
``queue_timeout_s``; beyond that it is refused at once with a 429, which
costs almost nothing.

Requests wait by tier (``service_tier``): every ``priority`` request that
can go goes before any ``default`` one, and ``flex`` takes only what those
leave. Within a tier the queue is fair between tenants (pipeline/fair.py):
a request names its flow (the tenant it is sent for), and a freed slot goes
to the flow whose turn it is by weight, not to whoever queued first, so one
tenant's burst does not keep the others waiting behind it. With one flow (a
server without API keys) it is first come, first served.

A tenant past its share of the slots leaves free slots for each other
active tenant short of its share (pipeline/shares.py: as many as that
tenant's count in flight varies by), so that tenant's next request starts
at once instead of waiting for another's to end; a tier leaves them to
tenants of its own and earlier tiers (priority to none of default's), and
a default request leaves room for every tenant active at priority.
``flex`` takes only what the interactive tiers leave: it is admitted while
``flex_reserve`` slots stay free after it and it stays out of the most
slots they held lately (a peak decaying over a few times as long as a
flex request holds its slot), so their next burst finds room; it may wait
``flex_queue_timeout_s``, and a full queue refuses (or pushes out) flex
first.

A slot ends when its request does, so a quiet tenant's requests that
arrive several at once find the slots left free taken. With ``preempt`` on
(the default), such a request, short of its tenant's share, takes a
running request of the tenant most past its share off its engine
(pipeline/preempt.py says which, and what bounds it); that one waits for
a slot again first in its tenant's line (:meth:`Admission.requeue`) and
goes on where it stopped. scripts/sim_admission.py measures the policy in
virtual time, scripts/bench_fairness.py in real time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator

import trio

from direct_frontend.fleet.schema import LimitsConfig, TenantsConfig
from direct_frontend.openai.errors import OpenAIHTTPError, rate_limited
from direct_frontend.openai.types import TIERS, Tier
from direct_frontend.pipeline.fair import FairQueue, Waiter
from direct_frontend.pipeline.preempt import Hold, new_hold, preempt_for
from direct_frontend.pipeline.shares import Shares
from direct_frontend.pipeline.slot import AdmissionObserver, Reason, Slot
from direct_frontend.pipeline.tenancy import Tenants

#: the tiers whose requests a client waits on (flex takes what they leave)
INTERACTIVE: tuple[Tier, ...] = ("priority", "default")
#: how long the most slots the interactive tiers held is remembered (decaying), in flex
#: requests' holds (what they may need while a flex request holds its slot is what they needed
#: over a few such stretches), and its bounds in seconds: flex stays out of what they used lately
PEAK_HOLDS = 4
PEAK_S = (0.25, 10.0)

@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """``[frontend.limits]`` (whose defaults are the schema's)."""

    max_in_flight: int
    max_queue: int
    queue_timeout_s: float
    flex_queue_timeout_s: float = 600.0
    #: slots a flex request leaves free for the interactive tiers when admitted
    flex_reserve: int = 1
    #: a request short of its tenant's share may take a running one off its engine
    preempt: bool = True
    max_preemptions: int = 2  # times one request may be taken off its engine


def admission_config(limits: LimitsConfig) -> AdmissionConfig:
    return AdmissionConfig(limits.max_in_flight, limits.max_queue, limits.queue_timeout_s,
                           limits.flex_queue_timeout_s, limits.flex_reserve_slots,
                           limits.preempt, limits.max_preemptions)


class Rejected(Exception):
    """Not admitted: the queue is full, the tenant's is, or the wait timed out."""

    def __init__(self, reason: str, why: Reason = "queue_full") -> None:
        super().__init__(reason)
        self.reason = reason
        self.why: Reason = why


def saturated(rejected: Rejected) -> OpenAIHTTPError:
    """The 429 for a request the admission queue would not take."""
    return rate_limited(f"The frontend is saturated: {rejected.reason}.", retry_after=1)


class Admission:
    """The cap and its queues: one per tier, each fair between tenants.

    ``observer`` hears how long each admitted request waited and each
    refusal (``/metrics``); ``tenants`` gives each flow its weight, caps and
    right to ``priority`` (``[frontend.tenants]``; by default every flow
    weighs 1, capped by the model's limits alone, and none has ``priority``).
    """

    def __init__(self, config: AdmissionConfig, observer: AdmissionObserver | None = None,
                 tenants: TenantsConfig | None = None) -> None:
        self.config = config
        self.observer = observer
        self.tenants = Tenants(tenants or TenantsConfig())
        self._free = config.max_in_flight
        self._queues = {tier: FairQueue(self.tenants.weight) for tier in TIERS}
        self._queued: collections.Counter[str] = collections.Counter()  # per flow, every tier
        self._wake: dict[Waiter, trio.Event] = {}
        self._held: dict[str, int] = {}  # slots each flow holds, every tier (when capped)
        #: whether any flow has a cap of its own: without one, what each holds is not kept
        self._caps = self.tenants.any_cap()
        #: the slots each tenant holds at priority, and at priority or default: the shares
        #: the spare slots follow (a tier leaves spares for its own and earlier tiers only)
        self._shares = {tier: Shares(config.max_in_flight, self.tenants.weight)
                        for tier in INTERACTIVE}
        #: the accounts a request of each tier counts in (priority both, default its own)
        self._accounts: dict[Tier, tuple[Shares, ...]] = {
            "priority": tuple(self._shares.values()), "default": (self._shares["default"],),
            "flex": ()}
        #: the queues a new request of each tier waits behind: its own, those served first
        self._before: dict[Tier, tuple[FairQueue, ...]] = {
            tier: tuple(self._queues[first] for first in TIERS[:TIERS.index(tier) + 1])
            for tier in TIERS}
        #: the interactive tiers' slots now, and the most of them held lately (decaying)
        self._interactive = 0
        self._peak = (0.0, 0.0)  # (the peak, when it was last brought up to date)
        self._flex = 0  # the slots flex holds
        self._flex_hold = 1.0  # how long a flex request holds its slots (an average)
        self._memory = _peak_memory(self._flex_hold)  # how long the interactive peak lasts
        self._pushed_out: dict[Waiter, str] = {}  # refused to make room, and why
        self._holds: dict[Hold, None] = {}  # the admitted requests of one slot, in order
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
        return sum(len(queue) for queue in self._queues.values())

    def waiting_by(self) -> dict[tuple[str, str], int]:
        """The requests waiting by the tenant's label and tier (the labels bounded)."""
        out: collections.Counter[tuple[str, str]] = collections.Counter()
        for tier, queue in self._queues.items():
            for flow, line in queue.flows():
                out[self.tenants.label(flow), tier] += len(line)
        return dict(out)

    def tier(self, flow: str, asked: str | None) -> Tier:
        """The tier ``flow``'s request is served at when it asks for ``asked``."""
        return self.tenants.tier(flow, asked)  # type: ignore[arg-type]

    def refuse_if_full(self, count: int = 1, flow: str = "", tier: Tier = "default") -> None:
        """Raise :class:`Rejected` now if ``count`` slots would find the queue full.

        For work that is accepted at once and admitted later (a background
        response): its client hears the 429 instead of a failure after the fact.
        """
        if self._free < min(count, self.config.max_in_flight) and (
                self.waiting >= self.config.max_queue):
            raise self._refused(flow, tier, "queue_full", "the request queue is full")

    @contextlib.asynccontextmanager
    async def background_slot(self, flow: str = "", tier: Tier = "default") -> AsyncIterator[Hold]:
        """One slot for work no client waits on (a background response) of ``flow``.

        Such work holds at most half the slots: however much of it is asked
        for, the other half stays for the requests a client is waiting on. Its
        wait for its half is bounded as the queue's is.
        """
        with trio.move_on_after(self._timeout(tier)) as wait:
            await self._background.acquire()
        if wait.cancelled_caught:
            raise self._refused(flow, tier, "timeout", "timed out waiting for a free slot")
        try:
            async with self.slot(1, flow, tier) as hold:
                yield hold
        finally:
            self._background.release()

    def slot(self, count: int = 1, flow: str = "", tier: Tier = "default") -> Slot:
        """``count`` in-flight slots (one per choice) for ``flow`` at ``tier``, held in an
        ``async with`` block; its :class:`Hold` may be preempted while its request runs on
        an engine (:meth:`Hold.running`), and then :meth:`requeue`.

        A request of more choices than ``max_in_flight`` takes every slot, so it waits for
        the daemon to drain rather than never running. The request chosen next keeps its
        turn until enough slots are free, so one of several choices is not passed over.
        """
        return Slot(self, min(count, self.config.max_in_flight), flow, tier)

    async def admit(self, count: int, flow: str, tier: Tier) -> Hold:
        """A :class:`Slot`'s way in: ``count`` slots held for ``flow`` at ``tier``."""
        granted = now = trio.current_time()
        for shares in self._accounts[tier]:
            shares.saw(flow, now)
        waited = 0.0  # admitted at once: none at all (the histogram's 0 bucket says so)
        if not self._ahead(tier) and self._free >= count and self._fits(flow, count, tier, now):
            self._count(flow, count, tier, now)
        else:
            if await self._wait(flow, count, tier):
                waited = trio.current_time() - now
            granted = trio.current_time()
        if self.observer is not None:
            self.observer.admitted(self.tenants.label(flow), tier, waited)
        hold = new_hold(flow, count, tier, granted)
        if count == 1:
            self._holds[hold] = None
        return hold

    def vacate(self, hold: Hold, granted: float) -> None:
        """A :class:`Slot`'s way out, whatever ended it (``granted``: its first admission)."""
        self._holds.pop(hold, None)
        if hold.tier == "flex":
            self._flex_hold += (trio.current_time() - granted - self._flex_hold) / 8
            self._memory = _peak_memory(self._flex_hold)
        if hold.held:  # not while it waits for them again (it left that wait)
            self._release(hold.flow, hold.count, hold.tier)

    def _ahead(self, tier: Tier) -> bool:
        """Whether a request of ``tier`` or of a tier served first waits (before its own)."""
        waiting = 0
        for queue in self._before[tier]:  # a loop: no generator made per request
            waiting += queue.size
        return waiting > 0

    def _timeout(self, tier: Tier) -> float:
        config = self.config
        return config.flex_queue_timeout_s if tier == "flex" else config.queue_timeout_s

    def _refused(self, flow: str, tier: Tier, why: Reason, reason: str) -> Rejected:
        """Count a refusal of ``flow``'s request (``reason``: what its client reads)."""
        self.rejected += 1
        if self.observer is not None:
            self.observer.refused(self.tenants.label(flow), tier, why)
        return Rejected(reason, why)

    async def _wait(self, flow: str, count: int, tier: Tier) -> bool:
        """Queue for ``count`` slots until granted; whether it had to wait at all (its turn
        may come at once). :class:`Rejected` when the queue (or the tenant's share of it) is
        full or the wait times out (a cancelled wait leaves nothing behind)."""
        limit = self.tenants.max_queue(flow)
        if limit and self._queued[flow] >= limit:
            raise self._refused(flow, tier, "tenant_queue_full",
                                f"{self.tenants.called(flow)} has {limit} requests waiting "
                                "already, its limit ([frontend.tenants] max_queue)")
        queue = self._queues[tier]
        waiter = queue.push(flow, count, tier)
        self._queued[flow] += 1
        granted = self._wake[waiter] = trio.Event()
        self._dispatch()
        if granted.is_set():
            await trio.lowlevel.checkpoint()
            return False  # its turn at once: it never took a place in the queue
        if self.waiting > self.config.max_queue:  # it took the last place and one more
            try:
                self._push_out(flow, tier)
            except Rejected:
                self._leave(waiter, granted, count)
                raise
        if self.config.preempt and tier != "flex" and count == 1 and preempt_for(
                self._holds, self._shares, flow, tier, queue.waiting(flow) - 1 - queue.claims(flow),
                self._queued.__getitem__, trio.current_time(),
                self.config.max_preemptions) is not None:
            queue.claim(flow)  # the slot it frees is this tenant's
        try:
            with trio.move_on_after(self._timeout(tier)):
                await self._granted(granted, tier)
        except BaseException:
            self._leave(waiter, granted, count)
            raise
        pushed_out = self._pushed_out.pop(waiter, None)
        if pushed_out is not None:
            raise Rejected(pushed_out, "pushed_out")  # counted when it was pushed out
        if not granted.is_set():
            self._leave(waiter, granted, count)
            raise self._refused(flow, tier, "timeout", "timed out waiting for a free slot")
        return True

    async def _granted(self, granted: trio.Event, tier: Tier) -> None:
        """Wait for ``granted``; flex dispatches again as the interactive peak decays."""
        if tier != "flex":
            await granted.wait()
        while not granted.is_set():  # the interactive peak decays with no event
            with trio.move_on_after(self._memory / 4):
                await granted.wait()
            self._dispatch()

    async def requeue(self, hold: Hold, until: float) -> bool:
        """``hold`` was preempted and its request is off its engine: give its slots to the
        waiting, then wait for them again, first in its tenant's line, with no queue cap and
        no timeout but ``until`` (its request's own deadline). True once it holds them
        again; False when ``until`` passed first (it holds none then)."""
        flow, count, tier = hold.flow, hold.count, hold.tier
        hold.held = hold.asked = False
        self._release(flow, count, tier)
        waiter = self._queues[tier].push_first(flow, count, tier)
        self._queued[flow] += 1
        granted = self._wake[waiter] = trio.Event()
        self._dispatch()
        try:
            with trio.move_on_at(until):
                await self._granted(granted, tier)
        except BaseException:
            self._leave(waiter, granted, count)
            raise
        if not granted.is_set():
            self._leave(waiter, granted, count)
            return False
        hold.held = True
        hold.granted = trio.current_time()
        return True

    def _push_out(self, flow: str, tier: Tier) -> None:
        """The queue is full: make room for ``flow``'s request of ``tier``, or
        :class:`Rejected` for it.

        A request of a tier served later gives way first (flex before
        default before priority): its tenant with the most waiting loses its
        newest. Within the request's own tier, the newest request of the
        tenant holding the most places gives way if that is another with more
        than ``flow`` has. A flood fills the queue, but never keeps a quieter
        tenant, or a higher tier, out of it.
        """
        for later in reversed(TIERS[TIERS.index(tier) + 1:]):
            queue = self._queues[later]
            if queue and self._evict(queue, queue.longest()[0], "the request queue is full, "
                                     "and a request of a higher service tier took this one's "
                                     "place"):
                return
        queue = self._queues[tier]
        longest, places = queue.longest()
        if longest == flow or places <= queue.waiting(flow):
            raise self._refused(flow, tier, "queue_full", "the request queue is full")
        if not self._evict(queue, longest, "the request queue is full, and this tenant holds "
                           "the most of it"):
            raise self._refused(flow, tier, "queue_full", "the request queue is full")

    def _evict(self, queue: FairQueue, flow: str, reason: str) -> bool:
        """Push ``flow``'s newest request out of ``queue``; False if it may not be (a
        preempted request waiting to go on: its stream is open)."""
        victim = queue.newest(flow)
        if victim.resumed:
            return False
        queue.cancel(victim)
        self._unqueued(flow)
        self._pushed_out[victim] = reason
        self._refused(flow, victim.tier, "pushed_out", reason)  # type: ignore[arg-type]
        self._wake.pop(victim).set()
        return True

    def _leave(self, waiter: Waiter, granted: trio.Event, count: int) -> None:
        """A wait that ends without its slots: out of the queue, or, granted meanwhile,
        the slots given back."""
        if granted.is_set():
            self._release(waiter.flow, count, waiter.tier)  # type: ignore[arg-type]
        else:
            self._queues[waiter.tier].cancel(waiter)  # type: ignore[index]
            self._unqueued(waiter.flow)
            del self._wake[waiter]
            self._dispatch()  # it may have held the others back (a turn it could not take)

    def _fits(self, flow: str, count: int, tier: Tier, now: float) -> bool:
        """Whether ``flow`` may hold ``count`` more slots at ``tier`` at ``now``.

        Under its cap; flex only while ``flex_reserve`` slots stay free after
        it and it stays out of the interactive tiers' recent peak. An
        interactive request within its tenant's share (at its tier) fits; a
        tenant past its share leaves free slots for each other active tenant
        short of its share (:meth:`Shares.spare`: at least one), and a default
        request leaves room for each tenant active at priority (what its count
        varies by, :meth:`Shares.room`) whatever its share, so that tenant's
        next request starts at once instead of waiting for a slot to end (at
        most a quarter of the slots in all). Alone, or with everyone at its
        share, a tenant takes every slot: the queue stays work-conserving.
        """
        if self._caps and self._capped(flow, count):
            return False
        if tier == "flex":
            slots = self.config.max_in_flight
            reserve = min(self.config.flex_reserve, slots - count)
            room = slots - reserve - round(self._interactive_peak(now))
            return self._free - count >= reserve and self._flex + count <= max(room, count)
        if tier == "default":  # room for the tenants at priority, whatever its own share
            first = self._shares["priority"]
            at_first = first.active(now)  # no generator made while none is active there
            ahead = sum(first.room(o) for o in at_first if o != flow) if at_first else 0
            if self._free - count < min(ahead, self._headroom):
                return False
        shares = self._shares[tier]
        active = shares.active(now)
        if len(active) < 2 or shares.held(flow) + count <= shares.share(flow):
            return True
        wanted = min(self._headroom, self._free)  # past it, nothing more to count
        short = 0.0
        for other in active:
            if other != flow:
                short += shares.spare(other)
                if short >= wanted:
                    break
        return self._free - count >= min(short, self._headroom)

    def _capped(self, flow: str, count: int) -> bool:
        """Whether ``count`` more slots would put ``flow`` past its ``max_in_flight``."""
        cap = self.tenants.max_in_flight(flow)
        return bool(cap) and self._held.get(flow, 0) + count > max(cap, count)

    def _interactive_peak(self, now: float) -> float:
        """The most slots the interactive tiers held lately: the peak decays towards what
        they hold now over :attr:`_memory`."""
        peak, since = self._peak
        held = self._interactive
        if peak <= held:  # nothing above what they hold to decay (as the formula gives)
            return held + 0.0
        return held + (peak - held) * math.exp(-(now - since) / self._memory)

    def _count(self, flow: str, count: int, tier: Tier, now: float) -> None:
        """``flow`` holds ``count`` more slots at ``tier`` (fewer if negative) from ``now``."""
        self._free -= count
        if self._caps:
            held = self._held.get(flow, 0) + count
            if held:
                self._held[flow] = held
            else:
                del self._held[flow]
        for shares in self._accounts[tier]:
            shares.add(flow, count, now)
        if tier == "flex":
            self._flex += count
            return
        interactive = self._interactive + count
        if count > 0 and self._peak[0] <= interactive:
            # the peak as of now lies between what they held and the peak kept, so at most
            # what they hold now: that is the peak (no decay to work out)
            peak = float(interactive)
        else:
            peak = max(self._interactive_peak(now), interactive)
        self._interactive = interactive
        self._peak = (peak, now)

    def _release(self, flow: str, count: int, tier: Tier) -> None:
        self._count(flow, -count, tier, trio.current_time())
        if self._queued:  # someone waits for the slots (else there is no one to grant)
            self._dispatch()

    def _dispatch(self) -> None:
        """Grant free slots to the waiting requests: by tier, and in fair order within one."""
        while (found := self._next()) is not None:
            queue, waiter = found
            if waiter.cost > self._free:
                return  # it keeps its turn
            queue.pop(waiter)
            self._unqueued(waiter.flow)
            self._count(waiter.flow, waiter.cost, waiter.tier,  # type: ignore[arg-type]
                        trio.current_time())
            self._wake.pop(waiter).set()

    def _next(self) -> tuple[FairQueue, Waiter] | None:
        """The waiting request whose turn it is: of the first tier with one that fits."""
        if not self._queued:  # none waits (it counts every queue's requests)
            return None
        now = trio.current_time()
        for queue in self._queues.values():  # in the order the tiers are served
            if queue.size:
                waiter = queue.claimed(lambda head: head.cost <= self._free and not (
                    self._capped(head.flow, head.cost))) or queue.next(lambda head: self._fits(
                        head.flow, head.cost, head.tier, now))  # type: ignore[arg-type]
                if waiter is not None:
                    return queue, waiter
        return None

    def _unqueued(self, flow: str) -> None:
        """One request of ``flow`` left the queue (admitted, gone or pushed out)."""
        left = self._queued[flow] - 1
        if left:
            self._queued[flow] = left
        else:
            del self._queued[flow]


def _peak_memory(flex_hold: float) -> float:
    """How long the interactive tiers' peak is remembered: a few flex holds (each so long)."""
    return min(max(PEAK_HOLDS * flex_hold, PEAK_S[0]), PEAK_S[1])
