"""KV-cache-aware selection: send a request where its prefix is already cached (sans-IO).

Cost per engine, lower is better (after Dynamo's classic form, docs/kv-events.md §13.2)::

    cost = overlap_weight × blocks to prefill (request blocks − cached leading blocks)
         + decode load in blocks (our own accounting of prompt tokens in flight,
           plus the blocks sibling replicas say they hold there)

argmin at ``temperature == 0`` (ties → fewer requests in flight → round robin),
else softmax sampling over the min–max-normalised costs. A load guard (smg's
imbalance gate) spills a request to the least-loaded engine when the chosen
one is far above the mean, so a hot system prompt cannot herd all traffic to
one engine.

Overlap comes from an :class:`OverlapSource`: the KV-event index (exact) or,
for engines without KV events, :class:`ApproxPrefixIndex`, which remembers
what the router itself sent where.
"""

from __future__ import annotations

import collections
import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.index import prefix_hashes
from direct_frontend.kv.keys import incarnation_of
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.policies import Placement, RequestView

if TYPE_CHECKING:
    from direct_frontend.routing.affinity import SessionAffinity


class OverlapSource(Protocol):
    def lookup_hashes(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of the request (given as prefix hashes) each engine holds."""


class ApproxPrefixIndex:
    """Which prefixes the router sent where, for engines that publish no KV events.

    Entries expire after ``ttl_s`` (the engine has probably evicted them by
    then) and the whole map is capped at ``max_blocks`` (oldest first).
    """

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        #: told of every placement this router makes (replicas share them); a peer's
        #: placements come in through :meth:`record_peer`, which does not tell it
        self.on_record: Callable[[str, Sequence[int]], None] | None = None
        # prefix hash → {engine: expiry}; insertion order ≈ age, for the cap
        self._entries: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()

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

    def forget_engine(self, engine: str) -> None:
        for holders in self._entries.values():
            holders.pop(engine, None)

    def __len__(self) -> int:
        return len(self._entries)


class KvAware:
    """The ``kv_aware`` routing policy."""

    name = "kv_aware"

    def __init__(
        self,
        knobs: KvAwareKnobs,
        exact: OverlapSource | None = None,
        approx: ApproxPrefixIndex | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.clock = clock
        self.knobs = knobs
        self.exact = exact
        self.approx = approx or ApproxPrefixIndex(knobs.approx_ttl_s, knobs.approx_max_blocks)
        #: incarnations whose overlap comes from KV events
        self.uses_events: Collection[int] = ()
        self._rng = rng or random.Random()
        self._tie = 0
        self.spills = 0  # load-guard overrides, exported as a metric
        #: the session-affinity term of the cost (routing/affinity.py); None: no such term
        self.affinity: SessionAffinity | None = None

    def hashes(self, input_ids: Sequence[int]) -> list[int]:
        return prefix_hashes(input_ids, self.knobs.block_size)

    def overlaps(
        self, hashes: Sequence[int], now: float, candidates: Sequence[EngineHandle]
    ) -> dict[str, int]:
        """Cached leading blocks per engine: exact where KV events flow, else approximate.

        The exact index is keyed per incarnation and rank (``g<incarnation>r<rank>``);
        an engine's overlap is its best rank's.
        """
        if not hashes:
            return {}
        by_incarnation: dict[int, int] = {}
        if self.exact is not None and self.uses_events:
            for key, blocks in self.exact.lookup_hashes(hashes).items():
                incarnation = incarnation_of(key)
                by_incarnation[incarnation] = max(blocks, by_incarnation.get(incarnation, 0))
        approx = self.approx.lookup_at(hashes, now)
        out: dict[str, int] = {}
        for engine in candidates:
            if engine.incarnation in self.uses_events:
                blocks = by_incarnation.get(engine.incarnation, 0)
            else:
                blocks = approx.get(engine.name, 0)
            if blocks:
                out[engine.name] = blocks
        return out

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
        hashes = self.hashes(request.input_ids)
        overlaps = self.overlaps(hashes, now, candidates)
        request_blocks = math.ceil(len(request.input_ids) / knobs.block_size)
        # decode load: the blocks the engine's requests in flight hold (shared ones
        # once), plus the blocks this request would add there
        costs = [
            knobs.overlap_weight * (request_blocks - overlaps.get(e.name, 0))
            + len(e.load.active_blocks) + e.load.peer_blocks + e.load.new_blocks(hashes)
            for e in candidates
        ]
        # -- session affinity (routing/affinity.py): a term of its own ------------------
        if self.affinity is not None:
            key = self.affinity.key_of(request, hashes, bool(overlaps))
            if key is not None:
                costs = self.affinity.costs(key, candidates, costs)
        # -- end of session affinity -----------------------------------------------------
        chosen = self._pick(candidates, costs)
        spilled = False
        loads = [e.load.fleet_in_flight for e in candidates]
        mean = sum(loads) / len(loads)
        if (
            chosen.load.fleet_in_flight > mean * knobs.balance_rel_threshold
            and chosen.load.fleet_in_flight > mean + knobs.balance_abs_threshold
        ):
            chosen = min(candidates, key=lambda e: e.load.fleet_in_flight)
            spilled = True
        if spilled:
            self.spills += 1
        if chosen.incarnation not in self.uses_events:
            self.approx.record(chosen.name, hashes, now)
        block = knobs.block_size
        predicted = min(
            overlaps.get(chosen.name, 0) * block, (len(request.input_ids) - 1) // block * block
        )
        return Placement(chosen, tuple(hashes), predicted, spilled)

    def on_complete(self, placement: Placement, token_ids: Sequence[int]) -> None:
        """Approximate mode: the engine holds these tokens' blocks now (prompt + answer)."""
        engine = placement.engine
        if engine.incarnation not in self.uses_events:
            self.approx.record(engine.name, self.hashes(token_ids), self.clock())

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
