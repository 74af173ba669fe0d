"""The order waiting requests are admitted in: fair between tenants, by weight (sans-IO).

One FIFO queue lets a tenant that sends a burst keep every other tenant
behind its whole backlog. Here each tenant (a *flow*) has its own queue, and
the next request admitted is chosen by start-time fair queueing: a request
gets a virtual start tag, the later of the queue's virtual time and its
flow's previous finish tag, and a finish tag ``start + cost / weight``; the
waiting request with the smallest start tag goes first (ties: the earlier
arrival). So each flow is served in proportion to its weight while it has
requests waiting, a flow's wait depends on its own backlog and share, not on
another's burst, and the queue is work-conserving: a flow that waits for
nothing takes nothing, and an idle flow banks no credit (its next start is
the queue's virtual time, not its old finish). Chosen over deficit round
robin because costs here are small integers (slots) and tags need no
quantum to tune; each choice scans the flows with requests waiting, which
are few (tenants, not requests).

A flow may have a cap on what it holds (``max_in_flight``): its requests
wait, and the others go by, while it is at its cap.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import itertools
from collections.abc import Callable


@dataclasses.dataclass(eq=False, slots=True)
class Waiter:
    """One request waiting for ``cost`` slots on behalf of ``flow`` (``tier``: its queue's)."""

    flow: str
    cost: int
    seq: int
    start: float = 0.0
    finish: float = 0.0
    tier: str = ""
    resumed: bool = False  # a preempted request waiting to go on (pipeline/preempt.py)


class FairQueue:
    """Waiting requests by flow; :meth:`next` names the one to admit."""

    def __init__(self, weight: Callable[[str], float]) -> None:
        self.weight = weight
        self.virtual_time = 0.0
        self._queues: dict[str, collections.deque[Waiter]] = {}
        self._last_finish: dict[str, float] = {}
        self._seq = itertools.count()
        #: how many requests wait (read it rather than ``len()`` where it is checked often)
        self.size = 0
        #: slots being freed by preemption for a flow's first request waiting, by flow
        self._claims: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return self.size

    def waiting(self, flow: str) -> int:
        """How many of ``flow``'s requests wait."""
        queue = self._queues.get(flow)
        return 0 if queue is None else len(queue)

    def longest(self) -> tuple[str, int]:
        """The flow with the most requests waiting, and how many (("", 0) when none waits)."""
        return max(((flow, len(queue)) for flow, queue in self._queues.items()),
                   key=lambda item: item[1], default=("", 0))

    def newest(self, flow: str) -> Waiter:
        """``flow``'s last request in line (it has one; a preempted one waits first)."""
        return self._queues[flow][-1]

    def claim(self, flow: str) -> None:
        """A preemption frees a slot for ``flow``'s first request in line: it goes first
        (:meth:`claimed`) when a slot is free, whatever its tag."""
        self._claims[flow] += 1

    def claims(self, flow: str) -> int:
        """How many slots being freed are ``flow``'s (:meth:`claim`)."""
        return self._claims.get(flow, 0)

    def claimed(self, eligible: Callable[[Waiter], bool]) -> Waiter | None:
        """The first request in line of a flow a slot is being freed for, if ``eligible``."""
        for flow in self._claims:
            head = self._queues[flow][0]
            if eligible(head):
                return head
        return None

    def flows(self) -> collections.abc.ItemsView[str, collections.deque[Waiter]]:
        """Each flow with requests waiting, and its line."""
        return self._queues.items()

    def push(self, flow: str, cost: int, tier: str = "") -> Waiter:
        """Queue a request of ``flow`` for ``cost`` slots; its place in line."""
        start = max(self.virtual_time, self._last_finish.get(flow, 0.0))
        waiter = Waiter(flow, cost, next(self._seq), start,
                        start + cost / max(self.weight(flow), 1e-9), tier)
        self._last_finish[flow] = waiter.finish
        self._queues.setdefault(flow, collections.deque()).append(waiter)
        self.size += 1
        return waiter

    def push_first(self, flow: str, cost: int, tier: str = "") -> Waiter:
        """Queue a preempted request of ``flow`` first in its flow's line, at the tag its
        head has (or the queue's virtual time): it was charged its share when first
        admitted, so its flow's later tags do not move."""
        line = self._queues.setdefault(flow, collections.deque())
        start = line[0].start if line else self.virtual_time
        waiter = Waiter(flow, cost, next(self._seq), start,
                        start + cost / max(self.weight(flow), 1e-9), tier, resumed=True)
        line.appendleft(waiter)
        self.size += 1
        return waiter

    def next(self, eligible: Callable[[Waiter], bool] = lambda waiter: True) -> Waiter | None:
        """The waiting request to admit next among those ``eligible`` allows (a flow's head
        only: a flow's requests go in their order); None if none is."""
        best: Waiter | None = None
        for queue in self._queues.values():
            head = queue[0]
            if eligible(head) and (best is None or (head.start, head.seq) < (best.start, best.seq)):
                best = head
        return best

    def pop(self, waiter: Waiter) -> None:
        """``waiter`` is admitted (its flow's claim, if any, taken): the queue's virtual time
        moves to its start."""
        claims = self._claims.get(waiter.flow)
        if claims:
            if claims > 1:
                self._claims[waiter.flow] = claims - 1
            else:
                del self._claims[waiter.flow]
        self._remove(waiter)
        self.virtual_time = max(self.virtual_time, waiter.start)

    def cancel(self, waiter: Waiter) -> None:
        """``waiter`` leaves without being admitted (its wait timed out, its client left).

        Its flow's later requests keep their tags; the flow's finish tag is
        taken back only when it was the last one queued, so a flow loses no
        share to a request that never ran.
        """
        queue = self._queues.get(waiter.flow)
        last = queue is not None and queue[-1] is waiter and not waiter.resumed
        self._remove(waiter)
        if last:
            self._last_finish[waiter.flow] = waiter.start
        if waiter.flow not in self._queues and self._last_finish.get(waiter.flow, 0.0) <= (
                self.virtual_time):
            self._last_finish.pop(waiter.flow, None)  # idle: it banks nothing

    def _remove(self, waiter: Waiter) -> None:
        queue = self._queues[waiter.flow]
        if queue[0] is waiter:
            queue.popleft()
        else:
            queue.remove(waiter)
        self.size -= 1
        if not queue:
            del self._queues[waiter.flow]
            self._claims.pop(waiter.flow, None)  # none left to take a slot freed for it
            if len(self._last_finish) > 4 * (len(self._queues) + 64):
                self._forget_idle()

    def _forget_idle(self) -> None:
        """Drop the finish tags of flows that are idle and behind the virtual time (they
        would start at it anyway): the map stays the size of the flows that matter."""
        self._last_finish = {flow: tag for flow, tag in self._last_finish.items()
                             if flow in self._queues or tag > self.virtual_time}
