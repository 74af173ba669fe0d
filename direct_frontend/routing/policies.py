"""Routing policies behind one interface: a request in, a :class:`Placement` out.

A policy is pure: it reads the catalog snapshot and our load accounting and
returns where the request goes, with whatever it predicted there (or
``None`` when nothing fits). ``exclude`` names engines already tried for the
request. When a request it placed has finished well, the policy hears of it
(:meth:`Policy.on_complete`), so a policy that learns from what it sent
where needs no side channel.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from direct_frontend.routing.catalog import Catalog, EngineHandle


@dataclasses.dataclass(frozen=True, slots=True)
class RequestView:
    """What a policy may know about a request."""

    input_ids: Sequence[int]
    max_tokens: int
    #: the session's routing key (routing/affinity.py), when the request carries one
    routing_key: str | None = None
    #: (image hash, placeholder offset, length) per image: they key the blocks they fill
    media_keys: tuple[tuple[str, int, int], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where a policy put a request, and what it expected to find there."""

    engine: EngineHandle
    #: the request's KV block hashes (KV-aware routing), counted in the engine's load
    blocks: tuple[int, ...] = ()
    #: prompt tokens the policy expects the engine to have cached; ``None``: no prediction
    predicted_cached_tokens: int | None = None
    #: the load guard overrode the cache: the engine holding the prefix was too busy
    spilled: bool = False
    #: to call when the engine's first output arrives (its prefill is done) or the attempt
    #: ends without any, so the policy stops counting the request's prefill in that
    #: engine's queue; None: it counts none
    prefilled: Callable[[], None] | None = None
    #: the engine's data-parallel rank to run on (one of ``engine.dp_ranks``); None: any
    dp_rank: int | None = None
    #: the request's images' KV keys (:attr:`RequestView.media_keys`), for what it leaves
    media_keys: tuple[tuple[str, int, int], ...] = ()
    #: the prompt placed, whose block hashes ``blocks`` are (KV-aware routing): what the
    #: engine holds at the end is hashed on from them
    prompt: Sequence[int] = dataclasses.field(default=(), compare=False, repr=False)


class Policy(Protocol):
    name: str

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> Placement | None: ...

    def on_complete(self, placement: Placement, prompt: Sequence[int],
                    answer: Sequence[int]) -> None:
        """A request placed at ``placement`` ended well; ``prompt``, ``answer``: its token ids
        (apart: most policies learn nothing from them, and joining a long prompt costs)."""


class BarePlacements:
    """One engine-only placement per engine, made once per catalog version.

    For the policies that predict nothing: placing a request is then a
    lookup, not an allocation, on the hot path.
    """

    __slots__ = ("_of", "_version")

    def __init__(self) -> None:
        self._version = -1
        self._of: dict[EngineHandle, Placement] = {}

    def of(self, catalog: Catalog, engine: EngineHandle) -> Placement:
        if catalog.version != self._version:
            self._version = catalog.version
            self._of = {}  # handles of earlier versions may be gone: let them go
        placement = self._of.get(engine)
        if placement is None:
            placement = self._of[engine] = Placement(engine)
        return placement


def spread_start() -> int:
    """Where a new policy's turn-taking starts: at random.

    Replicas and workers that place requests at the same moment, before they
    hear of each other, would otherwise all break their first ties the same
    way: every one of them sent its first cold prompts to the same engines, and
    an engine nobody picked first could stay idle for good once the prompts
    lived elsewhere. Envoy randomizes its round-robin start per
    worker for the same reason.
    """
    return random.randrange(1 << 20)


class _TakingTurns:
    """A policy that predicts nothing and takes turns among engines from a random start."""

    def __init__(self, start: int | None = None) -> None:
        #: the turn counter: where the next choice (or tie) starts
        self._turn = spread_start() if start is None else start
        self._placements = BarePlacements()

    def on_complete(self, placement: Placement, prompt: Sequence[int],
                    answer: Sequence[int]) -> None:
        """Nothing to learn: the choice did not depend on what engines hold."""


class RoundRobin(_TakingTurns):
    """Each engine in turn. Stable under catalog changes: the cursor is a counter."""

    name = "round_robin"

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> Placement | None:
        engines = catalog.aggregated
        count = len(engines)
        for offset in range(count):
            engine = engines[(self._turn + offset) % count]
            if engine.name not in exclude:
                self._turn = (self._turn + offset + 1) % count
                return self._placements.of(catalog, engine)
        return None


class LeastLoaded(_TakingTurns):
    """The engine with the fewest in-flight requests (all replicas'); ties go round-robin."""

    name = "least_loaded"

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> Placement | None:
        candidates = [e for e in catalog.aggregated if e.name not in exclude]
        if not candidates:
            return None
        least = min(e.load.fleet_in_flight for e in candidates)
        tied = [e for e in candidates if e.load.fleet_in_flight == least]
        self._turn += 1
        return self._placements.of(catalog, tied[self._turn % len(tied)])
