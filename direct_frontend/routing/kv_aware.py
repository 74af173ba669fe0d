"""KV-cache-aware selection: send a request where its prefix is already cached (sans-IO).

Cost per engine, lower is better, in blocks of prefill work::

    cost = (overlap_weight + eviction_weight × fullness there)
             × blocks to prefill there (request blocks − cached leading blocks)
         + prefill queue there (blocks we sent it that it has not prefilled yet)
         + in_flight_weight × requests in flight there, sibling replicas' and other
           clients' included (routing/peers.py; each decode slows every step)

These terms are what TTFT is made of on an engine that prefills first come,
first served: the request waits for the queue ahead of it, then prefills its
own miss, in steps that every running request makes longer. What the miss
costs beyond this request is the eviction term: ``fullness`` (0–1) is how full
the engine's prefix cache would be with the miss stored (:meth:`KvAware.fullness`:
the KV events' block count plus the prefill queue, over the capacity), and a
block stored in a full cache evicts another conversation's, which prefills it
again. So a prefix stays where it lives until the queue there outweighs the
prefill it saves ``overlap_weight + eviction_weight`` times over (moving it
caches it twice), and a new prefix goes where there is room (with a fixed
weight instead, each new tenant goes to whichever engine is idle that instant,
and the partition that makes never heals). The queue is our own accounting
(routing/prefill_queue.py): a request's miss counts from its dispatch until
its prefill is done, which its first token shows (:attr:`Placement.prefilled`,
called by the relay, also when an attempt ends with no output); not the KV
events, which show a prompt's blocks when the engine admits it or schedules its
last chunk, before its prefill ends. One never heard of again stops counting
after ``PREFILL_FORGET_S``. Where KV events
flow, the overlap steered by also counts, at ``memory_weight``, the blocks
of requests we sent an engine that its events have not shown yet
(:meth:`KvAware.remembered`), and nothing it was sent before them. No engine
speed enters, so no knob depends on the hardware.

argmin at ``temperature == 0`` (ties → the larger prefix cache → fewer requests
in flight → round robin),
else softmax sampling over the min–max-normalised costs. A load guard (smg's
imbalance gate) spills a request when the chosen engine is far above the
mean (a safety net, as the queue terms balance), or just above it where
its prefill queue is a backlog (:meth:`KvAware.guard_line`). It spills to the cheapest
engine under the guard (a second home of the prefix, or room for one), not to
the least loaded, which would scatter a hot prefix over every engine.
``cache_affinity`` (routing/cache_affinity.py) is the baseline these defaults
were measured against (``scripts/routing_sim.py``).

Overlap comes from an :class:`OverlapSource`: the KV-event index (exact) or,
for engines without KV events, the approximate memory (routing/approx.py),
which remembers what the router itself sent where.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.keys import incarnation_of, index_key
from direct_frontend.kv.prefix import more_hashes, prompt_hashes
from direct_frontend.routing.approx import ApproxPrefixIndex, best_of
from direct_frontend.routing.catalog import Catalog, EngineHandle, memory_names, rank_memory
from direct_frontend.routing.policies import Placement, RequestView, spread_start
from direct_frontend.routing.prefill_queue import PrefillQueue

if TYPE_CHECKING:
    from direct_frontend.routing.affinity import SessionAffinity


#: the load guard's line where the chosen engine's prefill queue is a backlog
#: (:meth:`KvAware.guard_line`): this many times the mean requests in flight …
BACKLOG_REL = 2.0
#: … and this many over it
BACKLOG_ABS = 2.0
#: a backlog is also this many times the fleet's mean prefill queue …
BACKLOG_QUEUE_REL = 2.0
#: … and of this many requests at least
BACKLOG_REQUESTS = 3


class OverlapSource(Protocol):
    def lookup_hashes(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of the request (given as prefix hashes) each engine holds."""


@runtime_checkable
class HeldBlocks(Protocol):
    """An overlap source that also says how many blocks each index key holds (the KV index)."""

    def engines(self) -> list[str]: ...

    def blocks_of(self, engine: str) -> int: ...


def filled(held: int, request_blocks: int, cached: int, capacity: int) -> float:
    """How full a cache of ``capacity`` blocks that holds ``held`` is with the miss stored."""
    return min(1.0, (held + request_blocks - cached) / capacity)


class KvAware:
    """The ``kv_aware`` routing policy."""

    name = "kv_aware"
    #: steer by the memory of where prefixes were sent, too (see :meth:`remembered`)
    memory = True

    def __init__(
        self,
        knobs: KvAwareKnobs,
        exact: OverlapSource | None = None,
        approx: ApproxPrefixIndex | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        tie_start: int | None = None,
        uses_events: Collection[int] = (),
        diverged: Collection[int] = (),
        affinity: SessionAffinity | None = None,
    ) -> None:
        self.clock = clock
        self.knobs = knobs
        self.exact = exact
        self.approx = approx if approx is not None else ApproxPrefixIndex(
            knobs.approx_ttl_s, knobs.approx_max_blocks, knobs.approx_capacity_blocks,
            unit=knobs.approx_unit_blocks)
        #: incarnations whose overlap comes from KV events
        self.uses_events = uses_events
        #: of those, incarnations whose predictions drifted from the engine's reports
        #: (routing/hitrate.py): routed by the approximate memory instead
        self.diverged = diverged
        self._rng = rng or random.Random()
        #: ties (no engine cheaper) go round robin from here (policies.spread_start)
        self._tie = spread_start() if tie_start is None else tie_start
        self.spills = 0  # load-guard overrides, exported as a metric
        self.queue = PrefillQueue()
        #: the session-affinity term of the cost (routing/affinity.py); None: no such term
        self.affinity = affinity
        #: the most blocks any engine was seen holding: its capacity when none is configured
        self._peak = 0
        #: engine name → the (incarnation, life) what we remember of it belongs to (:meth:`fence`)
        self._lives: dict[str, tuple[int, int]] = {}

    def fence(self, candidates: Sequence[EngineHandle]) -> None:
        """Forget all we remember of an engine whose process is not the one we sent to.

        A new incarnation of a name (an edit replaced the engine), or a new life
        of one (its process restarted on the same address:
        :attr:`EngineHandle.life`), holds none of the blocks its predecessor
        was sent: where we sent prefixes, our model of its LRU and its prefill
        queue go, as the KV index drops its entries. An incarnation older than
        the newest seen of its name is one on its way out, still serving while
        its successor joins: no change.
        """
        lives = self._lives
        for engine in candidates:
            life = (engine.incarnation, engine.life)
            seen = lives.get(engine.name)
            if seen is None or life > seen:
                lives[engine.name] = life
                if seen is not None:
                    self.forget(engine)

    def forget(self, engine: EngineHandle) -> None:
        """Drop what was sent to ``engine`` (every rank's) and its prefill queue."""
        for name in {engine.name, *memory_names(engine)}:
            self.approx.forget_engine(name)
        self.queue.forget(engine.name)

    def capacity_of(self, engine: EngineHandle) -> int:
        """``engine``'s prefix cache in our blocks: the fleet file's, else discovery's (0: unknown).

        ``approx_capacity_blocks`` wins when set; else the KV cache size the
        engine reported (``max_total_num_tokens``; the whole pool, which is the
        prefix cache: blocks of running requests are cached too).
        """
        if self.knobs.approx_capacity_blocks:
            return self.knobs.approx_capacity_blocks
        tokens = engine.info.kv_capacity_tokens
        return tokens // self.knobs.block_size if tokens else 0

    def learn_capacities(self, candidates: Sequence[EngineHandle]) -> None:
        """Tell the approximate memory each engine's capacity, as discovery reports it."""
        approx = self.approx
        for engine in candidates:
            blocks = self.capacity_of(engine)
            if not blocks:
                continue
            for name in memory_names(engine):  # a rank's cache: the size discovery reports
                approx.capacities[name] = blocks

    def hashes(self, input_ids: Sequence[int],
               media: Sequence[tuple[str, int, int]] = ()) -> tuple[int, ...]:
        return prompt_hashes(input_ids, self.knobs.block_size, media=media)

    def by_events(self, engine: EngineHandle) -> bool:
        """Whether ``engine``'s overlap comes from its KV events (else the approximate memory)."""
        incarnation = engine.incarnation
        return incarnation in self.uses_events and incarnation not in self.diverged

    def overlaps(
        self, hashes: Sequence[int], now: float, candidates: Sequence[EngineHandle],
        by_key: dict[str, int] | None = None, approx: dict[str, int] | None = None,
    ) -> dict[str, int]:
        """Cached leading blocks per engine: exact where KV events flow, else approximate.

        The exact index is keyed per incarnation and rank (``g<incarnation>r<rank>``);
        an engine's overlap is its best rank's (the rank :meth:`rank_for` pins).
        ``by_key``, ``approx``: the index's and the approximate memory's answers
        for ``hashes``, when already asked.
        """
        if not hashes:
            return {}
        by_incarnation: dict[int, int] = {}
        if by_key is None:
            by_key = self.exact_lookup(hashes)
        for key, blocks in by_key.items():
            incarnation = incarnation_of(key)
            by_incarnation[incarnation] = max(blocks, by_incarnation.get(incarnation, 0))
        if approx is None:
            approx = self.approx.lookup_at(hashes, now)
        out: dict[str, int] = {}
        for engine in candidates:
            if self.by_events(engine):
                blocks = by_incarnation.get(engine.incarnation, 0)
            else:
                blocks = best_of(approx, memory_names(engine))
            if blocks:
                out[engine.name] = blocks
        return out

    def exact_lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """Cached leading blocks per index key (incarnation and rank); {} without events."""
        if self.exact is None or not self.uses_events or not hashes:
            return {}
        return self.exact.lookup_hashes(hashes)

    def rank_for(
        self, engine: EngineHandle, by_key: dict[str, int], approx: dict[str, int],
        request_blocks: int,
    ) -> tuple[int | None, int | None]:
        """The data-parallel rank to pin the request to on ``engine``, and its cached blocks.

        ``(None, None)`` when the engine balances its ranks itself. Each rank
        has a cache of its own, so the request goes where its prefix is (and
        the prediction is that rank's, not the engine's best), at the same
        price as between engines: the blocks to prefill there, dearer in a
        fuller cache, plus ``in_flight_weight`` × the requests there: ours
        pinned there and, as of the engine's last load report, everyone
        else's. What a rank holds is its KV events', else the approximate
        memory's of that rank.
        """
        ranks = engine.dp_ranks
        if len(ranks) < 2:
            return None, None
        knobs = self.knobs
        events = self.by_events(engine)
        capacity = self.capacity_of(engine) or self._peak
        exact = self.exact
        held = exact if events and isinstance(exact, HeldBlocks) else None
        load = engine.load
        best: tuple[float, int, int] | None = None
        choice = (ranks[0], 0)
        for position, rank in enumerate(ranks):
            if events:
                key = index_key(engine.incarnation, position)
                cached = by_key.get(key, 0)
                stored = held.blocks_of(key) if held is not None else None
            else:
                name = rank_memory(engine.name, rank)
                cached = approx.get(name, 0)
                stored = self.approx.held(name)
            busy = load.rank_load(rank)
            fullness = 0.0
            if stored is not None and capacity > 0 and knobs.eviction_weight:
                fullness = filled(stored, request_blocks, cached, capacity)
            ranking = (self.rank_cost(request_blocks - cached, fullness, busy), busy, position)
            if best is None or ranking < best:
                best, choice = ranking, (rank, cached)
        return choice

    def rank_cost(self, miss: int, fullness: float, busy: int) -> float:
        """One rank's price for the request (:meth:`rank_for`): its engine-level cost's terms."""
        knobs = self.knobs
        return ((knobs.overlap_weight + knobs.eviction_weight * fullness) * miss
                + knobs.in_flight_weight * busy)

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> Placement | None:
        return self.choose_at(catalog, request, exclude, now=self.clock())

    def choose_at(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str], now: float
    ) -> Placement | None:
        """The placement, predicting the cached tokens from the chosen engine's overlap.

        Engines always recompute at least the last prompt token, so the
        prediction is capped at the last full block before it.
        """
        candidates = [e for e in catalog.aggregated if e.name not in exclude]
        if not candidates:
            return None
        knobs = self.knobs
        self.fence(candidates)
        self.learn_capacities(candidates)
        # (one tuple, which the placement, the memory and the queue share rather than copy)
        hashes = self.hashes(request.input_ids, request.media_keys)
        by_key = self.exact_lookup(hashes)
        approx = self.approx.lookup_at(hashes, now) if hashes else {}
        overlaps = self.overlaps(hashes, now, candidates, by_key, approx)
        steer = self.remembered(overlaps, hashes, candidates, now) if self.memory else overlaps
        chosen, spilled = self.select(candidates, request, hashes, steer)
        if spilled:
            self.spills += 1
        block = knobs.block_size
        rank, on_rank = self.rank_for(
            chosen, by_key, approx, math.ceil(len(request.input_ids) / block))
        self._remember(rank_memory(chosen.name, rank), hashes, now)
        held = overlaps.get(chosen.name, 0) if on_rank is None else on_rank
        predicted = min(held * block, (len(request.input_ids) - 1) // block * block)
        # queued as the cost weighed it (a miss the memory expects to be short is short),
        # until the engine's events show its last block stored, its first token, or its end
        queued = len(hashes) - max(held, steer.get(chosen.name, 0))
        media = request.media_keys
        prompt = request.input_ids
        if queued <= 0:
            return Placement(chosen, hashes, predicted, spilled, dp_rank=rank,
                             media_keys=media, prompt=prompt)
        token = self.queue.add(chosen.name, hashes, queued, now, self.by_events(chosen))
        return Placement(chosen, hashes, predicted, spilled,
                         functools.partial(self._prefilled, chosen.name, token), rank,
                         media_keys=media, prompt=prompt)

    def _prefilled(self, engine: str, token: int) -> None:
        self.queue.prefilled(engine, token, self.clock())

    def remembered(
        self, overlaps: dict[str, int], hashes: Sequence[int], candidates: Sequence[EngineHandle],
        now: float,
    ) -> dict[str, int]:
        """Overlaps to steer by: with events, also what is pending there, at ``memory_weight``.

        An engine's KV events show a block only once it is stored, so what a
        request we sent is prefilling there (and, after its prefill, what the
        events have not shown yet, for the events' lag: ``LANDED_FORGET_S``)
        counts too (:meth:`PrefillQueue.pending`): a burst of one new prefix
        queues behind its first request instead of prefilling it on every
        engine. Nothing beyond: a prefix sent somewhere
        long ago and evicted since is not there (crediting it sent requests to
        engines that had evicted their prefix). Without events the approximate
        memory, which records each placement when it is made, already says it.
        """
        if not self.uses_events:
            return overlaps
        weight = self.knobs.memory_weight
        out = dict(overlaps)
        for engine in candidates:
            if not self.by_events(engine):
                continue
            blocks = int(self.queue.pending(engine.name, hashes, now) * weight)
            if blocks > out.get(engine.name, 0):
                out[engine.name] = blocks
        return out

    def held(self) -> dict[int, int] | None:
        """Blocks each incarnation's KV events show it holding (its fullest rank's).

        None: the overlap source counts no blocks (only the KV index does).
        """
        exact = self.exact
        if not isinstance(exact, HeldBlocks):
            return None
        out: dict[int, int] = {}
        for key in exact.engines():
            incarnation = incarnation_of(key)
            out[incarnation] = max(exact.blocks_of(key), out.get(incarnation, 0))
        return out

    def fullness(
        self,
        candidates: Sequence[EngineHandle],
        request_blocks: int,
        overlaps: dict[str, int],
        unshown: Sequence[int],
    ) -> dict[str, float]:
        """Per engine, how full its cache would be with this request's miss stored (0–1);
        ``unshown``: per candidate, the blocks of its queued prefills its events do not show yet.

        Against the engine's capacity (:meth:`capacity_of`: the fleet file's, else
        discovery's), else the most blocks any engine was seen holding (caches of
        one fleet are alike; before the first engine fills, this ranks them by
        occupancy). Engines whose occupancy is unknown (no events, no LRU model)
        count as full.
        """
        if not self.knobs.eviction_weight:
            return {}
        full = {e.name: 1.0 for e in candidates}  # unknown: full, as a cache is in steady state
        by_events = self.held() if self.uses_events else None
        known: dict[str, int] = {}
        for e, coming in zip(candidates, unshown, strict=True):
            if self.by_events(e):  # what it holds, and what it is about to hold
                if by_events is not None:
                    known[e.name] = by_events.get(e.incarnation, 0) + coming
            elif (modelled := self.modelled_held(e)) is not None:
                known[e.name] = modelled
        if not known:
            return full
        self._peak = max(self._peak, *known.values())
        for e in candidates:
            n = known.get(e.name)
            capacity = self.capacity_of(e) or self._peak
            if n is not None and capacity > 0:
                full[e.name] = filled(n, request_blocks, overlaps.get(e.name, 0), capacity)
        return full

    def modelled_held(self, engine: EngineHandle) -> int | None:
        """Blocks the LRU model says ``engine`` holds (its fullest rank's; None: no model)."""
        held = [n for name in memory_names(engine) if (n := self.approx.held(name)) is not None]
        return max(held) if held else None

    def _stored_at(self, engine: EngineHandle) -> Callable[[int], bool] | None:
        """Whether the KV events show a block stored on ``engine`` (None: no events flow)."""
        exact = self.exact
        if exact is None or not self.by_events(engine):
            return None
        incarnation = engine.incarnation

        def stored(block: int) -> bool:
            return any(incarnation_of(key) == incarnation for key in exact.lookup_hashes([block]))

        return stored

    def select(
        self,
        candidates: Sequence[EngineHandle],
        request: RequestView,
        hashes: Sequence[int],
        overlaps: dict[str, int],
    ) -> tuple[EngineHandle, bool]:
        """The engine for the request, and whether the load guard overrode the cache."""
        knobs = self.knobs
        request_blocks = math.ceil(len(request.input_ids) / knobs.block_size)
        now = self.clock()
        costs = []
        depths = [self.queue.depths(e.name, now, self._stored_at(e)) for e in candidates]
        queued = [depth for depth, _ in depths]
        fullness = self.fullness(candidates, request_blocks, overlaps,
                                 [unshown for _, unshown in depths])
        for e, depth in zip(candidates, queued, strict=True):
            miss = request_blocks - overlaps.get(e.name, 0)
            costs.append(
                (knobs.overlap_weight + knobs.eviction_weight * fullness.get(e.name, 0.0)) * miss
                + depth
                + knobs.in_flight_weight * e.load.fleet_in_flight
            )
        # -- session affinity (routing/affinity.py): a term of its own ------------------
        if self.affinity is not None:
            key = self.affinity.key_of(request, hashes, bool(overlaps))
            if key is not None:
                costs = self.affinity.costs(key, candidates, costs)
        # -- end of session affinity -----------------------------------------------------
        room = [self.capacity_of(e) or self._peak for e in candidates]  # as fullness reads it
        chosen = self._pick(candidates, costs, room)
        loads = [e.load.fleet_in_flight for e in candidates]
        limit = self.guard_line(loads, queued, candidates.index(chosen),
                                self.queue.requests(chosen.name))
        if chosen.load.fleet_in_flight > limit:
            # the cheapest engine under the guard: where the prefix has a second home, or
            # room for one (the least loaded would scatter the prefix)
            under = [(c, e, r) for c, e, r in zip(costs, candidates, room, strict=True)
                     if e.load.fleet_in_flight <= limit]
            return self._pick([e for _, e, _ in under], [c for c, _, _ in under],
                              [r for _, _, r in under]), True
        return chosen, False

    def guard_line(self, loads: Sequence[int], queued: Sequence[int], chosen: int,
                   waiting: int) -> float:
        """The requests in flight on candidate ``chosen`` above which the load guard spills.

        ``loads``, ``queued``: every candidate's requests in flight and prefill
        queue (blocks); ``waiting``: the requests in the chosen one's queue. The
        line is far above the mean load (``balance_rel_threshold`` × it and
        ``balance_abs_threshold`` over it), but where the chosen engine's
        prefill queue is a backlog (more than ``balance_backlog_blocks``,
        :data:`BACKLOG_QUEUE_REL` × the fleet's mean queue, and of at least
        :data:`BACKLOG_REQUESTS` requests: one new conversation's prompt is
        no burst) it is just above the mean (:data:`BACKLOG_REL` × it and
        :data:`BACKLOG_ABS` over it, if that is lower). A backlog is a burst of prompts one
        engine holds little of (a hot tenant's sessions starting, agent turns
        carrying tool output) that every request sent there waits behind;
        the cost's queue term weighs that backlog against the whole shared
        prefix a second engine would prefill, once, and so keeps the burst on
        one engine. The guard moves it to the cheapest engine under the
        line, which then holds the hot prefix too. Chat turns queue too little
        to make a backlog, so the line stays where it was for them.
        """
        knobs = self.knobs
        mean = sum(loads) / len(loads)
        line = max(mean * knobs.balance_rel_threshold, mean + knobs.balance_abs_threshold)
        backlog = knobs.balance_backlog_blocks
        depth = queued[chosen]
        if (backlog and depth > backlog and waiting >= BACKLOG_REQUESTS
                and depth > BACKLOG_QUEUE_REL * sum(queued) / len(queued)):
            return min(line, max(mean * BACKLOG_REL, mean + BACKLOG_ABS))
        return line

    def on_complete(self, placement: Placement, prompt: Sequence[int],
                    answer: Sequence[int]) -> None:
        """The engine holds these tokens' blocks now (prompt + answer): remembered, and dequeued."""
        if placement.prefilled is not None:
            placement.prefilled()
        engine = rank_memory(placement.engine.name, placement.dp_rank)
        more = self.answer_blocks(placement, prompt, answer)
        if more is None:
            self._remember(engine, self.hashes((*prompt, *answer), placement.media_keys),
                           self.clock(), len(placement.blocks))
        else:  # (the prompt's placement extended by the answer's blocks: the whole not joined)
            self.approx.record_answer(engine, placement.blocks, more, self.clock())

    def answered_hashes(self, placement: Placement, prompt: Sequence[int],
                        answer: Sequence[int]) -> tuple[int, ...]:
        """The block hashes of ``prompt`` + ``answer``."""
        more = self.answer_blocks(placement, prompt, answer)
        if more is None:
            return self.hashes((*prompt, *answer), placement.media_keys)
        return placement.blocks + more

    def answer_blocks(self, placement: Placement, prompt: Sequence[int],
                      answer: Sequence[int]) -> tuple[int, ...] | None:
        """The hashes of the blocks of ``prompt`` + ``answer`` after the placed prompt's, where
        they begin with the placed prompt (most often ``prompt`` itself; a continuation's is
        longer): hashed on from its hashes, without joining or hashing the prompt again.
        None where they do not begin with it (or images key its blocks)."""
        placed, blocks = placement.prompt, placement.blocks
        if not blocks or placement.media_keys:
            return None
        block = self.knobs.block_size
        start = len(blocks) * block
        if prompt is placed:
            return more_hashes(blocks, (*prompt[start:], *answer), block)
        whole = (*prompt, *answer)
        if len(whole) >= len(placed) and whole[: len(placed)] == tuple(placed):
            return more_hashes(blocks, whole[start:], block)
        return None

    def _remember(self, engine: str, hashes: Sequence[int], now: float, head: int = 0) -> None:
        """Record a placement; ``head``: the leading hashes of the one it extends (a prompt's,
        these being it and its answer), which the memory extends in a step per new block."""
        self.approx.record(engine, hashes, now, head)

    def _pick(self, candidates: Sequence[EngineHandle], costs: Sequence[float],
              room: Sequence[int] = ()) -> EngineHandle:
        """The cheapest engine (``temperature`` 0), else a softmax sample over the costs.

        Ties go to the largest prefix cache in ``room`` (each candidate's capacity
        in blocks; empty: no preference), then to the fewest requests in flight,
        then round robin. Under the same traffic a larger cache's least recently
        used blocks are older, so what a miss evicts there is less likely to be
        read again: a new prefix that costs the same everywhere goes there.
        """
        low, high = min(costs), max(costs)
        if self.knobs.temperature <= 0 or high - low < 1e-9:
            if room and min(room) != max(room):  # caches of different sizes
                cheapest = [(r, e) for e, c, r in zip(candidates, costs, room, strict=True)
                            if c - low < 1e-5]
                largest = max(r for r, _ in cheapest)
                best = [e for r, e in cheapest if r == largest]
            else:
                best = [e for e, c in zip(candidates, costs, strict=True) if c - low < 1e-5]
            least = min(e.load.fleet_in_flight for e in best)
            tied = [e for e in best if e.load.fleet_in_flight == least]
            self._tie += 1
            return tied[self._tie % len(tied)]
        span = high - low
        weights = [math.exp(-(c - low) / span / self.knobs.temperature) for c in costs]
        return self._rng.choices(list(candidates), weights)[0]

