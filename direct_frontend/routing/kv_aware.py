"""KV-cache-aware selection: send a request where its prefix is already cached (sans-IO).

Cost per engine, lower is better, in blocks of prefill work::

    cost = (overlap_weight + eviction_weight × fullness there)
             × blocks to prefill there (request blocks − cached leading blocks)
         + prefill queue there (blocks we sent it that it has not prefilled yet)
         + in_flight_weight × requests in flight there, sibling replicas' and other
           clients' included (routing/peers.py; each decode slows every step;
           half that without KV events: measured better there, scripts/routing_sim.py)

These terms are what TTFT is made of on an engine that prefills first come,
first served: the request waits for the queue ahead of it, then prefills its
own miss, in steps that every running request makes longer. What the miss
costs beyond this request is the eviction term: ``fullness`` (0–1) is how full
the engine's prefix cache would be with the miss stored (:meth:`KvAware.fullness`:
the KV events' block count plus the prefill queue, over the capacity), and a
block stored in a full cache evicts another conversation's, which prefills it
again. So a prefix stays where it lives until the queue there outweighs the
prefill it saves ``overlap_weight + eviction_weight`` times over (moving it
caches it twice), and a new prefix goes where there is room (issue 15: a fixed
weight of 3 placed each new tenant on whichever engine was idle that instant,
and the partition it made, three tenants on one engine and one on another,
never healed). The queue is our own accounting: a request's
miss counts from its dispatch until its prefill is done, which the engine's
KV events show (its last prompt block stored) and its first token shows for
every engine (:attr:`Placement.prefilled`, called by the relay, also when an
attempt ends with no output); one never heard of again stops counting after
``PREFILL_FORGET_S``. Where KV events
flow, the overlap steered by also counts, at ``memory_weight``, the blocks
of requests we sent an engine that its events have not shown yet
(:meth:`KvAware.remembered`), and nothing it was sent before them. No engine
speed enters, so no knob depends on the hardware.

argmin at ``temperature == 0`` (ties → fewer requests in flight → round robin),
else softmax sampling over the min–max-normalised costs. A load guard (smg's
imbalance gate) spills a request to the least-loaded engine when the chosen
one is far above the mean: a safety net, as the queue terms balance.
:class:`CacheAffinity` is the baseline these defaults were measured against
(``scripts/routing_sim.py``).

Overlap comes from an :class:`OverlapSource`: the KV-event index (exact) or,
for engines without KV events, :class:`ApproxPrefixIndex`, which remembers
what the router itself sent where.
"""

from __future__ import annotations

import collections
import functools
import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.keys import incarnation_of, index_key
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.policies import Placement, RequestView, spread_start

if TYPE_CHECKING:
    from direct_frontend.routing.affinity import SessionAffinity


class OverlapSource(Protocol):
    def lookup_hashes(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of the request (given as prefix hashes) each engine holds."""


@runtime_checkable
class HeldBlocks(Protocol):
    """An overlap source that also says how many blocks each index key holds (the KV index)."""

    def engines(self) -> list[str]: ...

    def blocks_of(self, engine: str) -> int: ...


class ApproxPrefixIndex:
    """Which prefixes the router sent where, for engines that publish no KV events.

    Entries expire after ``ttl_s`` (the engine has probably evicted them by
    then) and the whole map is capped at ``max_blocks`` (oldest first). Where
    an engine's prefix cache size is known (``capacity_blocks`` for every
    engine, or :attr:`capacities` per engine, from discovery) its share is
    modelled as the engine's own LRU: what we sent is touched tail first (so a
    prefix's root stays longest, as vLLM's free queue and SGLang's radix tree
    evict leaves first) and the least recently sent blocks beyond the capacity
    are forgotten, as the engine forgets them. What it cannot know: prefixes
    other routers sent, and eviction order under pinning.
    """

    def __init__(self, ttl_s: float, max_blocks: int, capacity_blocks: int = 0) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        #: told of every placement this router makes (replicas share them); a peer's
        #: placements come in through :meth:`record_peer`, which does not tell it
        self.on_record: Callable[[str, Sequence[int]], None] | None = None
        #: every engine's capacity in blocks (0: unknown), unless :attr:`capacities` says
        self.capacity_blocks = capacity_blocks
        #: engine → its own capacity in blocks (discovery's), over ``capacity_blocks``
        self.capacities: dict[str, int] = {}
        # prefix hash → {engine: expiry}; insertion order ≈ age, for the cap
        self._entries: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()
        self._lru: dict[str, collections.OrderedDict[int, None]] = {}

    def record(self, engine: str, hashes: Sequence[int], now: float) -> None:
        if self.on_record is not None and hashes:
            self.on_record(engine, hashes)
        self.record_peer(engine, hashes, now)

    def record_peer(self, engine: str, hashes: Sequence[int], now: float) -> None:
        """Remember a placement (a sibling replica's, or our own via :meth:`record`)."""
        expiry = now + self.ttl_s
        entries = self._entries
        for h in hashes:
            holders = entries.get(h)
            if holders is None:
                entries[h] = {engine: expiry}
            else:
                holders[engine] = expiry
                entries.move_to_end(h)
        while len(entries) > self.max_blocks:
            entries.popitem(last=False)
        capacity = self.capacity_of(engine)
        if capacity:
            self._touch(engine, hashes, capacity)

    def capacity_of(self, engine: str) -> int:
        """``engine``'s prefix cache in blocks as this model knows it (0: unknown)."""
        return self.capacities.get(engine) or self.capacity_blocks

    def models_capacity(self) -> bool:
        """Whether some engine's LRU is modelled (so entries are forgotten before they expire)."""
        return bool(self.capacity_blocks or self.capacities)

    def _touch(self, engine: str, hashes: Sequence[int], capacity: int) -> None:
        lru = self._lru.setdefault(engine, collections.OrderedDict())
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        entries = self._entries
        while len(lru) > capacity:
            h, _ = lru.popitem(last=False)
            holders = entries.get(h)
            if holders is not None:
                holders.pop(engine, None)
                if not holders:
                    del entries[h]

    def lookup_at(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        result: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(hashes):
            holders = self._entries.get(h)
            here = {e for e, expiry in holders.items() if expiry > now} if holders else set()
            if alive is not None:
                here &= alive
            for gone in (alive or set()) - here:
                result[gone] = depth
            if not here:
                return result
            alive = here
        for engine in alive or ():
            result[engine] = len(hashes)
        return result

    def held(self, engine: str) -> int | None:
        """Blocks the LRU model says ``engine`` holds (None: no capacity, no model)."""
        if not self.capacity_of(engine):
            return None
        lru = self._lru.get(engine)
        return 0 if lru is None else len(lru)

    def forget_engine(self, engine: str) -> None:
        self._lru.pop(engine, None)
        for holders in self._entries.values():
            holders.pop(engine, None)

    def __len__(self) -> int:
        return len(self._entries)


#: a queued prefill nobody heard of again (its request failed early) stops counting after this
PREFILL_FORGET_S = 60.0
#: a prefilled request's blocks the KV events never showed (stored and evicted in between, or
#: never stored: a cache full of running requests) stop counting as pending after this
LANDED_FORGET_S = 5.0


def rank_memory(engine: str, rank: int | None) -> str:
    """The approximate memory's name for what was sent to ``engine``'s rank (None: the engine)."""
    return engine if rank is None else f"{engine}#dp{rank}"


def memory_names(engine: EngineHandle) -> tuple[str, ...]:
    """Where the approximate memory keeps what was sent to ``engine``: one per pinned rank.

    Each rank has a cache of its own, so a data-parallel engine's requests are
    remembered (and its LRU modelled) rank by rank.
    """
    if not engine.dp_ranks:
        return (engine.name,)
    return tuple(rank_memory(engine.name, rank) for rank in engine.dp_ranks)


def filled(held: int, request_blocks: int, cached: int, capacity: int) -> float:
    """How full a cache of ``capacity`` blocks that holds ``held`` is with the miss stored."""
    return min(1.0, (held + request_blocks - cached) / capacity)


def best_of(found: dict[str, int], names: Sequence[str]) -> int:
    """The most blocks any of ``names`` holds in a lookup's answer."""
    if len(names) == 1:
        return found.get(names[0], 0)
    return max(found.get(name, 0) for name in names)


class PrefillQueue:
    """Per engine, the prefill work (blocks) we sent it that it has not finished, as we know it.

    Each entry is one request's prompt blocks (prefix hashes) and how many of
    them it has to prefill. Until the engine's KV events show its last prompt
    block stored, its blocks are *pending* there (:meth:`pending`): not in the
    index yet, but cached before a request sent after it is prefilled (engines
    prefill first come, first served), and after its prefill, cached where the
    events have not said so yet. Its blocks count in the queue (:meth:`depth`)
    only until its prefill is done.
    """

    def __init__(self) -> None:
        #: engine → token → [the request's prompt block hashes, blocks to prefill (0 once
        #: prefilled), sent at, prefilled at (None: not yet)]
        self._queued: dict[str, collections.OrderedDict[int, list[Any]]] = {}
        #: engine → block hash → how many pending requests' prompts hold it
        self._pending: dict[str, dict[int, int]] = {}
        self._next = 0

    def add(self, engine: str, hashes: Sequence[int], blocks: int, now: float) -> int:
        self._next += 1
        entry = tuple(hashes)
        self._queued.setdefault(engine, collections.OrderedDict())[self._next] = [
            entry, blocks, now, None]
        pending = self._pending.setdefault(engine, {})
        for h in entry:
            pending[h] = pending.get(h, 0) + 1
        return self._next

    def prefilled(self, engine: str, token: int, now: float) -> None:
        """The request's prefill is done (its first token, or its end): no longer queued.

        Its blocks stay pending until the events show them, for at most
        ``LANDED_FORGET_S`` (on an engine without events, until the next
        :meth:`depth`). A placement carries this as :attr:`Placement.prefilled`;
        a request that never gets that far is forgotten by :meth:`depth` after
        ``PREFILL_FORGET_S``.
        """
        queued = self._queued.get(engine)
        entry = None if queued is None else queued.get(token)
        if entry is not None and entry[3] is None:
            entry[1], entry[3] = 0, now

    def _drop(self, engine: str, token: int) -> None:
        hashes = self._queued[engine].pop(token)[0]
        pending = self._pending[engine]
        for h in hashes:
            left = pending[h] - 1
            if left:
                pending[h] = left
            else:
                del pending[h]

    def forget(self, engine: str) -> None:
        """``engine``'s process is new: what we queued on the old one will never be heard of."""
        self._queued.pop(engine, None)
        self._pending.pop(engine, None)

    def pending(self, engine: str, hashes: Sequence[int]) -> int:
        """The leading blocks of ``hashes`` that requests we sent ``engine`` are storing."""
        pending = self._pending.get(engine)
        if not pending:
            return 0
        n = 0
        for h in hashes:
            if h not in pending:
                break
            n += 1
        return n

    def depth(self, engine: str, now: float, stored: Callable[[int], bool] | None) -> int:
        """Blocks still to prefill; ``stored(h)``: the engine's events show block ``h`` stored.

        ``stored`` None: the engine has no events, so a prefilled request's
        blocks are pending no longer.
        """
        queued = self._queued.get(engine)
        if not queued:
            return 0
        while queued:  # oldest first: forget what we will never hear of again
            token, (_, _, sent, _) = next(iter(queued.items()))
            if now - sent <= PREFILL_FORGET_S:
                break
            self._drop(engine, token)
        total = 0
        for token, (hashes, blocks, _, landed) in list(queued.items()):
            if landed is not None and (stored is None or now - landed > LANDED_FORGET_S):
                self._drop(engine, token)  # prefilled, and no events to wait for (any more)
            elif stored is not None and stored(hashes[-1]):
                self._drop(engine, token)  # the events show it stored
            else:
                total += blocks
        return total


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
    ) -> None:
        self.clock = clock
        self.knobs = knobs
        self.exact = exact
        self.approx = approx or ApproxPrefixIndex(
            knobs.approx_ttl_s, knobs.approx_max_blocks, knobs.approx_capacity_blocks)
        #: incarnations whose overlap comes from KV events
        self.uses_events: Collection[int] = ()
        #: of those, incarnations whose predictions drifted from the engine's reports
        #: (routing/hitrate.py): routed by the approximate memory instead
        self.diverged: Collection[int] = ()
        self._rng = rng or random.Random()
        #: ties (no engine cheaper) go round robin from here (policies.spread_start)
        self._tie = spread_start() if tie_start is None else tie_start
        self.spills = 0  # load-guard overrides, exported as a metric
        self.queue = PrefillQueue()
        #: the session-affinity term of the cost (routing/affinity.py); None: no such term
        self.affinity: SessionAffinity | None = None
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
               media: Sequence[tuple[str, int, int]] = ()) -> list[int]:
        return prefix_hashes(input_ids, self.knobs.block_size, media=media)

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
        hashes = self.hashes(request.input_ids, request.media_keys)
        by_key = self.exact_lookup(hashes)
        approx = self.approx.lookup_at(hashes, now) if hashes else {}
        overlaps = self.overlaps(hashes, now, candidates, by_key, approx)
        steer = self.remembered(overlaps, hashes, candidates) if self.memory else overlaps
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
        if queued <= 0:
            return Placement(chosen, tuple(hashes), predicted, spilled, dp_rank=rank,
                             media_keys=media)
        token = self.queue.add(chosen.name, hashes, queued, now)
        return Placement(chosen, tuple(hashes), predicted, spilled,
                         functools.partial(self._prefilled, chosen.name, token), rank,
                         media_keys=media)

    def _prefilled(self, engine: str, token: int) -> None:
        self.queue.prefilled(engine, token, self.clock())

    def remembered(
        self, overlaps: dict[str, int], hashes: Sequence[int], candidates: Sequence[EngineHandle],
    ) -> dict[str, int]:
        """Overlaps to steer by: with events, also what is pending there, at ``memory_weight``.

        An engine's KV events show a block only once it is stored, so what a
        request we sent is prefilling there (and, after its prefill, what the
        events have not shown yet) counts too (:meth:`PrefillQueue.pending`):
        a burst of one new prefix queues behind its first request instead of
        prefilling it on every engine. Nothing beyond: a prefix sent somewhere
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
            blocks = int(self.queue.pending(engine.name, hashes) * weight)
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
        queued: Sequence[int],
    ) -> dict[str, float]:
        """Per engine, how full its cache would be with this request's miss stored (0–1).

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
        for e, depth in zip(candidates, queued, strict=True):
            if self.by_events(e):  # what it holds, and what it is about to hold
                if by_events is not None:
                    known[e.name] = by_events.get(e.incarnation, 0) + depth
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
        stored_at = [self._stored_at(e) for e in candidates]
        queued = [self.queue.depth(e.name, now, stored)
                  for e, stored in zip(candidates, stored_at, strict=True)]
        fullness = self.fullness(candidates, request_blocks, overlaps, queued)
        for e, stored, depth in zip(candidates, stored_at, queued, strict=True):
            # without events half the weight (measured: routing_sim's grid, README)
            in_flight = knobs.in_flight_weight * (1.0 if stored is not None else 0.5)
            miss = request_blocks - overlaps.get(e.name, 0)
            costs.append(
                (knobs.overlap_weight + knobs.eviction_weight * fullness.get(e.name, 0.0)) * miss
                + depth
                + in_flight * e.load.fleet_in_flight
            )
        # -- session affinity (routing/affinity.py): a term of its own ------------------
        if self.affinity is not None:
            key = self.affinity.key_of(request, hashes, bool(overlaps))
            if key is not None:
                costs = self.affinity.costs(key, candidates, costs)
        # -- end of session affinity -----------------------------------------------------
        chosen = self._pick(candidates, costs)
        loads = [e.load.fleet_in_flight for e in candidates]
        mean = sum(loads) / len(loads)
        if (
            chosen.load.fleet_in_flight > mean * knobs.balance_rel_threshold
            and chosen.load.fleet_in_flight > mean + knobs.balance_abs_threshold
        ):
            return min(candidates, key=lambda e: e.load.fleet_in_flight), True
        return chosen, False

    def on_complete(self, placement: Placement, token_ids: Sequence[int]) -> None:
        """The engine holds these tokens' blocks now (prompt + answer): remembered, and dequeued."""
        if placement.prefilled is not None:
            placement.prefilled()
        self._remember(rank_memory(placement.engine.name, placement.dp_rank),
                       self.hashes(token_ids, placement.media_keys), self.clock())

    def _remember(self, engine: str, hashes: Sequence[int], now: float) -> None:
        self.approx.record(engine, hashes, now)

    def _pick(self, candidates: Sequence[EngineHandle], costs: Sequence[float]) -> EngineHandle:
        low, high = min(costs), max(costs)
        if self.knobs.temperature <= 0 or high - low < 1e-9:
            best = [e for e, c in zip(candidates, costs, strict=True) if c - low < 1e-5]
            least = min(e.load.fleet_in_flight for e in best)
            tied = [e for e in best if e.load.fleet_in_flight == least]
            self._tie += 1
            return tied[self._tie % len(tied)]
        span = high - low
        weights = [math.exp(-(c - low) / span / self.knobs.temperature) for c in costs]
        return self._rng.choices(list(candidates), weights)[0]


class CacheAffinity(KvAware):
    """``cache_affinity``: the longest cached prefix, balance only when it is badly off.

    The baseline issue 15 measured against: the engine holding the longest
    cached prefix of the request (ties → fewer requests in flight); only when
    the busiest candidate has more than 64 requests above the idlest *and*
    1.5× its count does a request go to the least-loaded engine. It weighs no
    load below that gate, so it herds; kept as a selectable policy to compare with.
    """

    name = "cache_affinity"
    memory = False
    GATE_ABS = 64
    GATE_REL = 1.5

    def rank_cost(self, miss: int, fullness: float, busy: int) -> float:
        """The longest cached prefix on the engine's ranks too (ties: fewer in flight)."""
        return float(miss)

    def select(
        self,
        candidates: Sequence[EngineHandle],
        request: RequestView,
        hashes: Sequence[int],
        overlaps: dict[str, int],
    ) -> tuple[EngineHandle, bool]:
        loads = [e.load.fleet_in_flight for e in candidates]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self.GATE_ABS and busiest > self.GATE_REL * idlest:
            return candidates[loads.index(idlest)], True
        return self._pick(candidates, [-overlaps.get(e.name, 0) for e in candidates]), False
