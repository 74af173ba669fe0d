"""Session affinity every replica agrees on, with no shared store (sans-IO).

A request may carry a routing key (``[frontend.routing] session_key``: an
HTTP header such as ``x-session-id``, or the OpenAI ``user`` or
``prompt_cache_key`` field). The
key's engine is the rendezvous-hash winner (highest-random-weight) among the
engines that may take the request: a stable hash of (key, engine name), so
every replica, and every worker process, computes the same engine from the
same catalog without talking to anyone; and an engine joining or leaving
moves only the keys it wins or held, never a key between two other engines.
Engine names, not incarnations: a name is the same on every replica.

Under ``kv_aware`` the key is a term of the cost (:meth:`SessionAffinity.costs`):
every engine but the key's pays ``weight`` blocks, so a large enough KV
overlap elsewhere still wins, and so does a large enough load difference.
The other policies send a keyed request to its key's engine outright
(:class:`Affine`), and place unkeyed ones as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence

from direct_frontend.fleet.schema import SESSION_USER_FIELD, SessionSource
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.policies import BarePlacements, Placement, Policy, RequestView

#: a key longer than this is cut (it is hashed, not stored; this only bounds the work)
MAX_KEY_BYTES = 256


def routing_key(
    sources: Sequence[SessionSource], headers: Iterable[tuple[bytes, bytes]], user: str | None,
    prompt_cache_key: str | None = None,
) -> str | None:
    """The request's routing key: the first of ``sources`` it carries (non-empty), else None.

    ``headers`` are ASGI's (lower-case names, latin-1 bytes).
    """
    if not sources:
        return None
    values: dict[str, str] = {}
    for name, value in headers:
        values.setdefault(name.decode("latin-1"), value.decode("latin-1").strip())
    for source in sources:
        if source.header is not None:
            key = values.get(source.header)
        elif source.field == SESSION_USER_FIELD:
            key = user
        else:
            key = prompt_cache_key
        if key:
            return key[:MAX_KEY_BYTES]
    return None


def score(key: str, engine: str) -> int:
    """The rendezvous weight of ``engine`` for ``key``: the same in every process."""
    digest = hashlib.blake2b(
        f"{key}\0{engine}".encode(), digest_size=8, person=b"df-affinity"
    ).digest()
    return int.from_bytes(digest, "big")


def preferred(key: str, engines: Iterable[EngineHandle]) -> EngineHandle | None:
    """The key's engine among ``engines`` (highest score; the name breaks a tie)."""
    best: EngineHandle | None = None
    best_rank = (-1, "")
    for engine in engines:
        rank = (score(key, engine.name), engine.name)
        if rank > best_rank:
            best, best_rank = engine, rank
    return best


class SessionAffinity:
    """The affinity term of the ``kv_aware`` cost: ``weight`` blocks off the key's engine.

    The key is the request's routing key; with ``cold_prefixes``, a request
    without one whose prefix no engine is known to hold gets its first
    block's hash as key, so replicas that place the same new prefix at the
    same moment (before they hear of each other's placements) agree on
    where it goes instead of each prefilling it somewhere else.
    """

    def __init__(self, weight: float, *, sessions: bool = True, cold_prefixes: bool = False
                 ) -> None:
        self.weight = weight
        self.sessions = sessions
        self.cold_prefixes = cold_prefixes

    def key_of(self, request: RequestView, hashes: Sequence[int], known: bool) -> str | None:
        """The request's affinity key; ``known``: some engine holds its first block."""
        if self.sessions and request.routing_key is not None:
            return request.routing_key
        if self.cold_prefixes and hashes and not known:
            return f"prefix:{hashes[0]:x}"
        return None

    def costs(
        self, key: str, candidates: Sequence[EngineHandle], costs: Sequence[float]
    ) -> list[float]:
        """``costs`` (one per candidate) with the term added."""
        home = preferred(key, candidates)
        return [c if e is home else c + self.weight
                for e, c in zip(candidates, costs, strict=True)]


class Affine:
    """A policy that predicts nothing, with keyed requests sent to their key's engine."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self._placements = BarePlacements()

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> Placement | None:
        if request.routing_key is None:
            return self.inner.choose(catalog, request, exclude)
        home = preferred(request.routing_key,
                         (e for e in catalog.aggregated if e.name not in exclude))
        return None if home is None else self._placements.of(catalog, home)

    def on_complete(self, placement: Placement, prompt: Sequence[int],
                    answer: Sequence[int]) -> None:
        self.inner.on_complete(placement, prompt, answer)
