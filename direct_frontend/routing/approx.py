"""The approximate memory: which prefixes this router (and its sibling replicas) sent where.

For engines that publish no KV events it stands in for the KV index: a
placement is remembered for a while, and where an engine's prefix cache size
is known its share is modelled as that engine's own LRU. A data-parallel
engine's requests are remembered rank by rank, as each rank has a cache of its own.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from direct_frontend.routing.catalog import EngineHandle

__all__ = ["ApproxPrefixIndex", "best_of", "memory_names", "rank_memory"]

_known: Final = functools.partial(operator.is_not, None)


#: who holds a block until when: one engine as a pair (shared by all the blocks of one
#: record), or several as {engine: expiry}
Holders = tuple[str, float] | dict[str, float]
_ENGINE: Final[Callable[[Any], object]] = operator.itemgetter(0)


def _pairs(holders: Holders) -> Iterable[tuple[str, float]]:
    """Each (engine, expiry) of ``holders``."""
    return (holders,) if type(holders) is tuple else holders.items()  # type: ignore[union-attr]


def _joined(holders: Holders | None, mine: tuple[str, float]) -> Holders:
    """``holders`` with ``mine`` (an engine and its new expiry) among them."""
    if holders is None:
        return mine
    if type(holders) is tuple:
        if holders[0] == mine[0]:
            return mine
        return {holders[0]: holders[1], mine[0]: mine[1]}
    holders[mine[0]] = mine[1]  # type: ignore[index]
    return holders


def _joined_runs(found: list[Holders | None], mine: tuple[str, float]) -> list[Holders]:
    """Each of ``found`` joined with ``mine``, a run of one holder at a time.

    Blocks recorded together share their holder, so the runs are few: those of
    no holder or of ``mine``'s engine alone take ``mine`` in bulk; the others
    are joined one by one (each block gets a holder of its own).
    """
    out: list[Holders] = []
    for _, same in itertools.groupby(found, key=id):
        run = list(same)
        holders = run[0]
        if holders is None or (type(holders) is tuple and holders[0] == mine[0]):
            out.extend(itertools.repeat(mine, len(run)))
        else:
            out.extend(_joined(h, mine) for h in run)
    return out


def holders_of(holders: Holders | None) -> dict[str, float]:
    """``holders`` as {engine: expiry}."""
    return {} if holders is None else dict(_pairs(holders))


def _drain(calls: Iterable[object]) -> None:
    """Run a lazy map to its end in C (a deque that keeps nothing)."""
    collections.deque(calls, maxlen=0)


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

    def __init__(self, ttl_s: float, max_blocks: int, capacity_blocks: int = 0, *,
                 on_record: Callable[[str, Sequence[int]], None] | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        #: told of every placement this router makes (replicas share them); a peer's
        #: placements come in through :meth:`record_peer`, which does not tell it
        self.on_record = on_record
        #: every engine's capacity in blocks (0: unknown), unless :attr:`capacities` says
        self.capacity_blocks = capacity_blocks
        #: engine → its own capacity in blocks (discovery's), over ``capacity_blocks``
        self.capacities: dict[str, int] = {}
        # prefix hash → its holders; insertion order ≈ age, for the cap
        self._entries: collections.OrderedDict[int, Holders] = collections.OrderedDict()
        # engine → the hashes its LRU model holds, least recently touched first
        self._lru: dict[str, collections.OrderedDict[int, None]] = {}

    def record(self, engine: str, hashes: Sequence[int], now: float) -> None:
        if self.on_record is not None and hashes:
            self.on_record(engine, hashes)
        self.record_peer(engine, hashes, now)

    def record_peer(self, engine: str, hashes: Sequence[int], now: float) -> None:
        """Remember a placement (a sibling replica's, or our own via :meth:`record`).

        Each hash ends up newest, in order, held by ``engine`` until the new
        expiry. A prompt has thousands of blocks, so the usual case (each block
        new, or held by ``engine`` alone) is a few bulk steps in C: one shared
        holder pair for all, then, when some were known, all moved to the end
        in order. Blocks other engines hold too (a shared system prompt's) are
        joined one by one, the others keep the shared pair.
        """
        mine = (engine, now + self.ttl_s)
        entries = self._entries
        found = list(map(entries.get, hashes))
        values: Iterable[Holders]
        if dict in set(map(type, found)) or not {engine}.issuperset(
                map(_ENGINE, filter(None, found))):  # some held by others too: joined there
            values = _joined_runs(found, mine)
        else:
            values = itertools.repeat(mine)
        size = len(entries)
        entries.update(zip(hashes, values, strict=False))
        if len(entries) - size != len(hashes):  # some were known: all newest, in order
            _drain(map(entries.move_to_end, hashes))
        excess = len(entries) - self.max_blocks
        if excess > 0:
            _drain(map(entries.__delitem__, list(itertools.islice(entries, excess))))
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
        """Touch ``hashes`` tail first in ``engine``'s LRU; forget what falls out of it.

        New blocks go in with one bulk update (in C); only when some were there
        already is every block moved to the end in touch order, as if each had
        been touched in turn. What falls out goes in bulk too (an ordered dict's
        oldest are found without a scan).
        """
        lru = self._lru.setdefault(engine, collections.OrderedDict())
        size = len(lru)
        lru.update(zip(reversed(hashes), itertools.repeat(None)))
        if len(lru) - size != len(hashes):  # some were there: put them all in touch order
            _drain(map(lru.move_to_end, reversed(hashes)))
        excess = len(lru) - capacity
        if excess > 0:
            gone = list(itertools.islice(lru, excess))
            _drain(map(lru.__delitem__, gone))
            self._let_go(engine, gone)

    def _let_go(self, engine: str, gone: Sequence[int]) -> None:
        """``engine`` no longer holds ``gone`` (its LRU forgot them): forget its claim on each."""
        entries = self._entries
        found = list(map(entries.get, gone))
        if set(map(type, found)) <= {tuple}:  # the usual case, in C: held by one engine each
            _drain(map(entries.__delitem__, itertools.compress(
                gone, map(operator.eq, map(_ENGINE, found), itertools.repeat(engine)))))
            return
        for h, holders in zip(gone, found, strict=True):
            if holders is None:
                continue
            if type(holders) is tuple:
                if holders[0] == engine:
                    del entries[h]
            else:
                holders.pop(engine, None)  # type: ignore[union-attr]
                if not holders:
                    del entries[h]

    def lookup_at(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Per engine, how many leading ``hashes`` it holds unexpired (holding none: absent)."""
        entries = self._entries
        first = entries.get(hashes[0]) if hashes else None
        result: dict[str, int] = {}
        if not first:
            return result
        # the holders of the leading hashes anyone was sent (a C loop up to the first unknown),
        # as runs of one holder (blocks recorded together share theirs): a step per run
        found = itertools.takewhile(_known, map(entries.get, itertools.islice(hashes, 1, None)))
        runs = []
        for _, same in itertools.groupby(found, key=id):
            run = list(same)
            runs.append((run[0], len(run)))
        for engine, expiry in _pairs(first):
            if expiry <= now:
                continue
            depth = 1
            for holders, blocks in runs:
                if type(holders) is tuple:
                    if holders[0] != engine or holders[1] <= now:
                        break
                elif holders.get(engine, -math.inf) <= now:  # type: ignore[union-attr]
                    break
                depth += blocks
            result[engine] = depth
        return result

    def held(self, engine: str) -> int | None:
        """Blocks the LRU model says ``engine`` holds (None: no capacity, no model)."""
        if not self.capacity_of(engine):
            return None
        lru = self._lru.get(engine)
        return 0 if lru is None else len(lru)

    def forget_engine(self, engine: str) -> None:
        self._lru.pop(engine, None)
        entries = self._entries
        for h, holders in list(entries.items()):
            if isinstance(holders, tuple):
                if holders[0] == engine:
                    entries[h] = {}  # (held by no one now, still counted for the cap)
            else:
                holders.pop(engine, None)

    def __len__(self) -> int:
        return len(self._entries)



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



def best_of(found: dict[str, int], names: Sequence[str]) -> int:
    """The most blocks any of ``names`` holds in a lookup's answer."""
    if len(names) == 1:
        return found.get(names[0], 0)
    return max(found.get(name, 0) for name in names)

