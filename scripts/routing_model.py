"""Engines modelled in virtual time, and the event loop the routing models play them in.

An engine (:class:`ModelEngine`) is a prefix cache of ``capacity`` blocks
with LRU eviction, whose stores and evictions go to the router's KV index as
events, and the simulated engines' own chunked-prefill steps
(:class:`~direct_frontend.simulator.steps.StepLoop`, the double the live bench
runs), played in virtual time. :class:`VirtualTime` sends each request at its
time, places it (the caller's policy) and steps the engines; the grid
(``routing_sim.py``) and the live shapes (``routing_shapes.py``) both play in it.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Any

from direct_frontend.kv.events import BlockRemoved, BlockStored
from direct_frontend.kv.keys import index_key
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.routing.policies import Placement, Policy
from direct_frontend.simulator.steps import Seat, StepLoop

if TYPE_CHECKING:
    from routing_sim import Point


@dataclasses.dataclass(slots=True)
class Request:
    """One request of a model run: its prompt and answer, and what became of it."""

    rid: int
    user: Any  # who sent it: a grid user, or a live shape's session number's session
    tokens: list[int]
    answer: list[int]
    arrival: float
    hashes: list[int] = dataclasses.field(default_factory=list)
    placement: Placement | None = None
    engine: int = -1
    cached_tokens: int = 0
    ttft: float = math.nan
    pinned: list[int] = dataclasses.field(default_factory=list)  # in chain order
    #: under an oracle, the blocks it finds cached (else the engine looks them up)
    bound_blocks: int | None = None


class ModelEngine:
    """One engine in virtual time: an LRU block cache, and the simulator's scheduler steps.

    The steps are the simulated engines' own (:class:`StepLoop`, the engine double the
    live bench runs): each prefills up to ``chunk`` tokens of the admitted requests, first
    come first served, and decodes one token of every request past its prefill. Admission
    (at most ``max_running``, the cache lookup then) and the cache are the model's.
    """

    def __init__(self, point: Point, number: int, publish: Callable[[str, Any], None],
                 rank: int = 0) -> None:
        self.point = point
        self.key = index_key(number, rank)  # one rank of engine ``number``
        self.publish = publish  # (index key, event) → the router's KV index
        self.capacity: float = point.capacity_blocks()
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unpinned
        self.pins: dict[int, int] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.steps = StepLoop(point.timing())
        #: the admitted requests by their seats in the steps (admission order)
        self.running: dict[Seat, Request] = {}
        #: the decode batch of the step under way
        self.decoded: list[Seat] = []
        #: when the step under way ends (None: none is)
        self.step_end: float | None = None
        self.evictions = 0
        self.requests = 0

    def __contains__(self, h: int) -> bool:
        return h in self.lru or h in self.pins

    @property
    def queued(self) -> int:
        """Requests waiting or running here."""
        return len(self.waiting) + len(self.running)

    def arrive(self, request: Request) -> None:
        self.requests += 1
        self.waiting.append(request)

    def _pin(self, h: int) -> None:
        if h in self.lru:
            del self.lru[h]
        self.pins[h] = self.pins.get(h, 0) + 1

    def _unpin(self, hashes: Sequence[int]) -> None:
        for h in reversed(hashes):  # tail first: the root ends up most recent
            left = self.pins[h] - 1
            if left:
                self.pins[h] = left
            else:
                del self.pins[h]
                self.lru[h] = None

    def _store(self, request: Request, hashes: Sequence[int], tokens: Sequence[int]) -> None:
        """The request's full blocks ``hashes`` are cached now (pinned); new ones are stored."""
        held = len(request.pinned)  # its leading blocks already pinned
        new: list[int] = []
        first = 0
        for i in range(held, len(hashes)):
            h = hashes[i]
            if h in self:
                if new:
                    self._emit(new, hashes[first - 1] if first else None, tokens, first)
                    new = []
                self._pin(h)
            else:
                if not new:
                    first = i
                new.append(h)
                self.pins[h] = 1
            request.pinned.append(h)
        if new:
            self._emit(new, hashes[first - 1] if first else None, tokens, first)
        self._evict()

    def _emit(self, new: list[int], parent: int | None, tokens: Sequence[int], first: int) -> None:
        bs = self.point.block_size
        self.publish(self.key, BlockStored(
            block_hashes=tuple(new), parent_block_hash=parent,
            token_ids=array.array("I", tokens[first * bs:(first + len(new)) * bs]),
            block_size=bs, medium="GPU",
        ))

    def _evict(self) -> None:
        gone = []
        while len(self.lru) + len(self.pins) > self.capacity and self.lru:
            h, _ = self.lru.popitem(last=False)
            gone.append(h)
        if gone:
            self.evictions += len(gone)
            self.publish(self.key, BlockRemoved(tuple(gone), medium="GPU"))

    def admit(self) -> None:
        p = self.point
        while self.waiting and len(self.running) < p.max_running:
            request = self.waiting.popleft()
            held = request.bound_blocks
            if held is None:
                held = held_blocks(self, request.hashes)
            cached = cacheable(p, request, held)
            request.cached_tokens = cached
            for h in request.hashes[: cached // p.block_size]:
                self._pin(h)
                request.pinned.append(h)
            seat = self.steps.admit(len(request.tokens) - cached, len(request.answer))
            self.running[seat] = request
            if p.store_at_admission:
                self._store(request, request.hashes, request.tokens)

    def begin_step(self, now: float) -> float:
        """Start one step at ``now``; returns when it ends (then call :meth:`finish_step`)."""
        self.admit()
        prefilled, self.decoded = self.steps.plan()
        self.step_end = now + self.steps.step_seconds(prefilled, len(self.decoded))
        return self.step_end

    def finish_step(self) -> tuple[list[Request], list[Request]]:
        """The step's effects: the requests that got their first token, and those done."""
        p = self.point
        steps = self.steps
        self.step_end = None
        prefilled = list(itertools.takewhile(lambda seat: seat.left <= 0, steps.prefilling))
        steps.finish(self.decoded)
        ended = [seat for seat in self.decoded if seat.given >= seat.wanted]
        first: list[Request] = []
        for seat in prefilled:
            request = self.running[seat]
            first.append(request)
            if not p.store_at_admission:
                self._store(request, request.hashes, request.tokens)
            if seat.given >= seat.wanted:
                ended.append(seat)
        done = []
        for seat in ended:
            steps.leave(seat)
            request = self.running.pop(seat)
            whole = request.tokens + request.answer
            self._store(request, prefix_hashes(whole, p.block_size), whole)
            self._unpin(request.pinned)
            request.pinned = []
            done.append(request)
        return first, done

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)


def held_blocks(cache: Container[int], hashes: Sequence[int],
                also: Container[int] = ()) -> int:
    """The leading blocks of ``hashes`` in ``cache`` (an engine's, or a pooled one) or ``also``."""
    held = 0
    for h in hashes:
        if h not in cache and h not in also:
            break
        held += 1
    return held


def copy_steps(engine: ModelEngine) -> tuple[StepLoop, dict[Seat, Seat], dict[Seat, list[int]]]:
    """A copy of ``engine``'s steps to play forward: the copy, each seat's copy, and each
    copied seat's prompt blocks."""
    steps = StepLoop(engine.steps.timing)
    copies: dict[Seat, Seat] = {}
    hashes: dict[Seat, list[int]] = {}
    for seat, running in engine.running.items():
        copy = copies[seat] = Seat(seat.left, seat.wanted)
        copy.given = seat.given
        hashes[copy] = running.hashes
        if seat in engine.steps.decoding:
            steps.decoding[copy] = None
        else:
            steps.prefilling.append(copy)
    return steps, copies, hashes


def first_token_in(engine: ModelEngine, request: Request, now: float) -> float:
    """Seconds until ``request``'s first token if it joined ``engine``'s queue at ``now``.

    The engine's own steps played forward on a copy of its seats, the blocks
    each prefill stores included: exact when nothing else arrives there
    before that token and nothing it would find is evicted meanwhile.
    """
    p = engine.point
    steps, copies, hashes = copy_steps(engine)
    waiting = [*engine.waiting, request]
    stored: set[int] = set()  # stored by the prefills played forward
    target: Seat | None = None
    t = now
    # the step under way (its prefill already planned), else none to finish
    decoded = None if engine.step_end is None else [copies[seat] for seat in engine.decoded]
    if engine.step_end is not None:
        t = engine.step_end
    while True:
        if decoded is not None:  # the end of a step, as ModelEngine.finish_step
            ready = list(itertools.takewhile(lambda seat: seat.left <= 0, steps.prefilling))
            steps.finish(decoded)
            for seat in ready:
                if seat is target:
                    return t - now
                stored.update(hashes[seat])
            for seat in [s for s in steps.decoding if s.given >= s.wanted]:
                steps.leave(seat)
        # the next step, as begin_step (admit looks its hits up then)
        while waiting and len(steps.prefilling) + len(steps.decoding) < p.max_running:
            r = waiting.pop(0)
            held = held_blocks(engine, r.hashes, stored)
            seat = steps.admit(len(r.tokens) - cacheable(p, r, held), len(r.answer))
            hashes[seat] = r.hashes
            if p.store_at_admission:
                stored.update(r.hashes)
            if r is request:
                target = seat
        prefilled, decoded = steps.plan()
        t += steps.step_seconds(prefilled, len(decoded))


class ExactGreedy:
    """A reference, not a policy: each request to the engine where its own first token comes first.

    It knows what no router can: every engine's exact queue, batch and cache
    at the instant the request is sent (:func:`first_token_in`). It has no
    foresight, so it is what the best use of the present can give greedily; a
    policy that also weighs what a placement evicts for later requests can
    beat it, and does on some points.
    """

    def __init__(self, engines: Sequence[ModelEngine]) -> None:
        self.engines = engines

    def choose(self, request: Request, now: float) -> int:
        return min(range(len(self.engines)),
                   key=lambda n: (first_token_in(self.engines[n], request, now), n))


def cacheable(point: Point, request: Request, held: int) -> int:
    """Prompt tokens ``held`` leading cached blocks save (the last prompt token is computed)."""
    bs = point.block_size
    return min(held * bs, (len(request.tokens) - 1) // bs * bs)


# -- the event loop ----------------------------------------------------------


class VirtualTime:
    """The event loop every model run plays: requests sent at their times, engines in steps.

    The caller schedules sends (:meth:`send_at`), and for each, when its time
    comes, makes the request and places it (:meth:`dispatch`); the loop runs
    the engines' steps, stamps each request's first token (and tells its
    placement, as the relay does), and at each request's end takes it off its
    engine's load and tells the policy what the engine now holds.
    """

    SEND, STEP, LATER = 0, 1, 2

    def __init__(self, engines: Sequence[ModelEngine], policy: Policy | None,
                 dp_ranks: int = 1) -> None:
        self.engines = engines
        self.policy = policy
        self.dp_ranks = dp_ranks
        self.now = 0.0  # the policies' clock
        self.finished: list[Request] = []
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._stepping = [False] * len(engines)

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def send_at(self, t: float, sender: Any) -> None:
        """``sender`` sends its next request at ``t`` (the ``send`` callback of :meth:`run`)."""
        self._push(t, self.SEND, sender)

    def later(self, t: float, action: Callable[[], None]) -> None:
        """``action()`` at ``t`` (e.g. a KV event reaching the router late)."""
        self._push(t, self.LATER, action)

    def dispatch(self, request: Request, placement: Placement) -> None:
        """``request`` goes where ``placement`` says (the engine's balancer picks an unpinned
        rank)."""
        request.placement = placement
        handle = placement.engine
        handle.load.begin(len(request.tokens), placement.blocks, placement.dp_rank)
        request.engine = handle.incarnation
        dp = self.dp_ranks
        rank = placement.dp_rank
        if rank is None:
            rank = balanced_rank(self.engines, request.engine, dp)
        n = request.engine * dp + rank
        self.engines[n].arrive(request)
        if not self._stepping[n]:
            self._stepping[n] = True
            self._push(self.engines[n].begin_step(self.now), self.STEP, n)

    def run(self, send: Callable[[float, Any], None],
            done: Callable[[float, Request], None] | None = None) -> list[Request]:
        """Until nothing is left to send or step; the requests that ended, in order.

        ``send(t, sender)``: a scheduled send is due; ``done(t, request)``: a request ended.
        """
        while self._heap:
            t, _, kind, obj = heapq.heappop(self._heap)
            self.now = t
            if kind == self.SEND:
                send(t, obj)
            elif kind == self.LATER:
                obj()
            else:
                self._step(t, obj, done)
        return self.finished

    def _step(self, t: float, n: int, done: Callable[[float, Request], None] | None) -> None:
        engine = self.engines[n]
        first, ended = engine.finish_step()
        for request in first:
            request.ttft = t - request.arrival
            if request.placement is not None and request.placement.prefilled is not None:
                request.placement.prefilled()  # as the relay does at the first token
        for request in ended:
            placement = request.placement
            assert placement is not None
            placement.engine.load.end(len(request.tokens), placement.blocks, placement.dp_rank)
            if self.policy is not None:
                prompt = placement.prompt or tuple(request.tokens)  # the placed one: no copy
                self.policy.on_complete(placement, prompt, tuple(request.answer))
            if done is not None:
                done(t, request)
            self.finished.append(request)
        if engine.busy:
            self._push(engine.begin_step(t), self.STEP, n)
        else:
            self._stepping[n] = False


def balanced_rank(engines: Sequence[ModelEngine], number: int, dp: int) -> int:
    """The rank an engine's own balancer gives an unpinned request: its fewest requests.

    vLLM's internal data-parallel balancer weighs each rank's waiting and
    running requests; no cache enters it.
    """
    return min(range(dp), key=lambda rank: (engines[number * dp + rank].queued, rank))
