"""The catalog: an immutable, versioned snapshot of the engines that may take requests.

The control plane builds a new :class:`Catalog` on every state change and
swaps it in whole; a request holds one snapshot for its whole decision. An
:class:`EngineHandle` is what a dispatch borrows: the engine's identity, what
discovery learnt, its transport and its live load counters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from direct_frontend.engines.neutral import EngineInfo, EngineRole


@dataclasses.dataclass(eq=False, slots=True)
class EngineLoad:
    """Our own accounting of one engine's work, and what other clients have there.

    The others' share comes from the engine's own report (GetLoads, on the probe
    cadence): what it has less what we and our sibling replicas had at that
    moment, so an engine that other routers or clients also feed weighs its real
    load. Everything else is our accounting, exact and at once.
    """

    in_flight: int = 0
    prompt_tokens_in_flight: int = 0
    requests_total: int = 0
    #: what the other replicas of this router have in flight here (control/replicas.py):
    #: requests, and the KV blocks they hold (``peer_blocks`` of them); none without replicas
    peer_in_flight: int = 0
    peer_active: frozenset[int] = frozenset()
    peer_blocks: int = 0
    #: from the engine's last report: its requests beyond ours and our siblings' then, how
    #: many our siblings had then, and the most they have had since (:attr:`foreign_in_flight`)
    others_reported: int = 0
    peers_at_report: int = 0
    peers_most_since: int = 0
    #: one callback per running stream that asks it to move to another engine
    #: (a planned migration off a draining engine)
    movers: set[Callable[[], None]] = dataclasses.field(default_factory=set)
    #: told when ``in_flight`` changes (the replica link sends it to the siblings at once)
    on_change: Callable[[], None] | None = None

    @property
    def fleet_in_flight(self) -> int:
        """Requests in flight here from every replica and other client: the load a policy weighs."""
        return self.in_flight + self.peer_in_flight + self.foreign_in_flight

    @property
    def foreign_in_flight(self) -> int:
        """Requests other clients have here, as of the engine's last report (0: none reported).

        A sibling's request we heard of only after the report may be one the
        report already counted: what our siblings gained since comes off, so no
        request counts twice (a new one of theirs may count once too few until
        the next report).
        """
        gained = max(self.peers_most_since, self.peer_in_flight) - self.peers_at_report
        return max(0, self.others_reported - gained) if gained > 0 else self.others_reported

    def peers_say(self, requests: int, blocks: frozenset[int] = frozenset()) -> None:
        """Our sibling replicas have ``requests`` in flight here, holding ``blocks``
        (routing/peers.py)."""
        self.peer_in_flight = requests
        self.peer_active = blocks
        self.peer_blocks = len(blocks)
        if requests > self.peers_most_since:
            self.peers_most_since = requests

    def engine_reported(self, requests: int | None, ranks: Mapping[int, int] | None = None) -> None:
        """The engine reports ``requests`` from every client (None: it could not say).

        ``ranks``: the same per data-parallel rank. What is not ours there (other
        clients', and sibling replicas', whose ranks we are not told) counts as
        the rank's others until the next report.
        """
        ours = self.in_flight + self.peer_in_flight
        self.others_reported = 0 if requests is None else max(0, requests - ours)
        self.peers_at_report = self.peers_most_since = self.peer_in_flight
        mine = self.rank_in_flight
        self.rank_others = {rank: n - mine.get(rank, 0) for rank, n in (ranks or {}).items()
                            if n > mine.get(rank, 0)}

    def rank_load(self, rank: int) -> int:
        """Requests on one data-parallel rank: ours pinned there, and the others' at the report."""
        return self.rank_in_flight.get(rank, 0) + self.rank_others.get(rank, 0)

    def move_all(self) -> int:
        """Ask every stream running here to continue elsewhere; returns how many were asked."""
        movers = list(self.movers)
        for move in movers:
            move()
        return len(movers)

    #: the KV blocks (prefix hashes) of the requests in flight: id of a request's blocks
    #: → [those blocks, how many requests in flight hold that very sequence]
    holding: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    #: data-parallel rank → our requests in flight pinned to it (KV-aware routing's)
    rank_in_flight: dict[int, int] = dataclasses.field(default_factory=dict)
    #: data-parallel rank → the engine's other requests there, as of its last report
    rank_others: dict[int, int] = dataclasses.field(default_factory=dict)

    def begin(
        self, prompt_tokens: int, blocks: Sequence[int] = (), rank: int | None = None
    ) -> None:
        if rank is not None:
            self.rank_in_flight[rank] = self.rank_in_flight.get(rank, 0) + 1
        self.in_flight += 1
        self.prompt_tokens_in_flight += prompt_tokens
        self.requests_total += 1
        if blocks:  # (one step, not one per block: the multiset is made when asked for)
            held = self.holding.get(id(blocks))
            if held is None:
                self.holding[id(blocks)] = [blocks, 1]
            else:
                held[1] += 1
        if self.on_change is not None:
            self.on_change()

    def end(self, prompt_tokens: int, blocks: Sequence[int] = (), rank: int | None = None) -> None:
        if rank is not None:
            self.rank_in_flight[rank] -= 1
        self.in_flight -= 1
        self.prompt_tokens_in_flight -= prompt_tokens
        if blocks:
            key = self._key_of(blocks)
            held = self.holding[key]
            held[1] -= 1
            if not held[1]:
                del self.holding[key]
        if self.on_change is not None:
            self.on_change()

    def _key_of(self, blocks: Sequence[int]) -> int:
        """Where :attr:`holding` keeps ``blocks``: the same sequence :meth:`begin` was given,
        else an equal one."""
        held = self.holding.get(id(blocks))
        if held is not None and held[0] is blocks:
            return id(blocks)
        return next(k for k, (b, _) in self.holding.items() if b == blocks)

    def active_set(self) -> frozenset[int]:
        """The KV blocks the requests in flight occupy, each once (what the sibling replicas
        are told): one union in C."""
        return frozenset().union(*[blocks for blocks, _ in self.holding.values()])

    def new_blocks(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are not already held by a request in flight (any replica's)."""
        active = self.active_set()
        peer = self.peer_active
        if peer:
            return sum(1 for block in blocks if block not in active and block not in peer)
        return sum(1 for block in blocks if block not in active)


@dataclasses.dataclass(eq=False, slots=True)
class EngineHandle:
    """One serving engine incarnation as seen by the data plane.

    ``incarnation`` distinguishes incarnations of the same engine id (the same
    URL removed and re-added), so late callbacks of an old one are ignored.
    ``transport`` is the engine's channel; routing code never touches it.
    """

    name: str
    kind: str
    url: str
    incarnation: int
    role: EngineRole
    info: EngineInfo
    context_length: int | None
    transport: Any
    load: EngineLoad = dataclasses.field(default_factory=EngineLoad)
    #: SGLang prefill engines: the bootstrap server's port (the fleet file's, else discovery's)
    bootstrap_port: int | None = None
    #: the model it serves (its ``[[model]]`` name); requests for other models never reach it
    model: str = ""
    #: the data-parallel ranks a request may be pinned to, one per KV-event endpoint of
    #: the fleet file in its order, or its ``dp_ranks`` (each rank has a cache of its
    #: own); empty: the engine balances its ranks itself (one rank, none named, or a kind
    #: whose stock engine does not honour a rank)
    dp_ranks: tuple[int, ...] = ()
    #: which life of the engine's process this is, as far as the daemon can tell: it moves
    #: (in place, on the handle the catalog holds) whenever a witness says the process may
    #: have restarted under the same incarnation (control/restarts.py). A new process holds
    #: none of its predecessor's cache, so routing state about the engine is fenced by
    #: (``incarnation``, ``life``).
    life: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Catalog:
    """The serving engines at one moment. Never mutated; replaced."""

    version: int = 0
    engines: tuple[EngineHandle, ...] = ()
    #: the engines of embedding models (they serve ``Embed``, never ``Generate``), by name
    embedders: frozenset[str] = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        embedders = frozenset(e.name for e in self.engines if not e.info.generates)
        object.__setattr__(self, "embedders", embedders)

    @property
    def aggregated(self) -> tuple[EngineHandle, ...]:
        """Engines that serve a whole request (prefill and decode) on their own.

        Prefill-only and decode-only engines are left out: a request may only
        reach them through a disaggregated flow that pairs one of each.
        """
        return tuple(e for e in self.engines if e.role is EngineRole.BOTH)

    def of_model(self, model: str) -> Catalog:
        """The engines serving ``model``, as a catalog of the same version."""
        return Catalog(self.version, tuple(e for e in self.engines if e.model == model))

    def serving(self, role: EngineRole | None = None) -> tuple[EngineHandle, ...]:
        if role is None:
            return self.engines
        return tuple(e for e in self.engines if e.role in (role, EngineRole.BOTH))


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
