"""Routing policies behind one interface, so KV-aware routing slots in later.

A policy is pure: it reads the catalog snapshot and our load accounting and
returns an engine (or ``None`` when nothing fits). ``exclude`` names engines
already tried for this request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Protocol

from direct_frontend.routing.catalog import Catalog, EngineHandle


@dataclasses.dataclass(frozen=True, slots=True)
class RequestView:
    """What a policy may know about a request."""

    input_ids: tuple[int, ...]
    max_tokens: int


class Policy(Protocol):
    name: str

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> EngineHandle | None: ...


class RoundRobin:
    """Each engine in turn. Stable under catalog changes: the cursor is a counter."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> EngineHandle | None:
        engines = catalog.aggregated
        count = len(engines)
        for offset in range(count):
            engine = engines[(self._next + offset) % count]
            if engine.name not in exclude:
                self._next = (self._next + offset + 1) % count
                return engine
        return None


class LeastLoaded:
    """The engine with the fewest in-flight requests; ties go round-robin."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._tie = 0

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> EngineHandle | None:
        candidates = [e for e in catalog.aggregated if e.name not in exclude]
        if not candidates:
            return None
        least = min(e.load.in_flight for e in candidates)
        tied = [e for e in candidates if e.load.in_flight == least]
        self._tie += 1
        return tied[self._tie % len(tied)]
