"""The approximate memory: which prefixes this router (and its sibling replicas) sent where.

For engines that publish no KV events it stands in for the KV index: a
placement is remembered for a while, and where an engine's prefix cache size
is known its share is modelled as that engine's own LRU. A data-parallel
engine's requests are remembered rank by rank (routing/catalog.py's
:func:`memory_names`), as each rank has a cache of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from direct_frontend.routing.placed import (
    FEW,
    Book,
    Holders,
    Joint,
    Known,
    Placed,
    Still,
    claim,
    held_alone,
    held_by,
    joined_runs,
    joints_at,
    known_live,
    last_places,
    placements,
    tags,
    taken_back,
    unheld,
)

__all__ = ["ApproxPrefixIndex", "best_of", "memory_keys"]

_known: Final = functools.partial(operator.is_not, None)
_ENGINE: Final[Callable[[Any], object]] = operator.attrgetter("engine")
_AGE: Final = operator.attrgetter("age")
_ENGINES: Final = itertools.repeat("engine")
_NONES: Final = itertools.repeat(None)


@dataclasses.dataclass(slots=True, eq=False)
class _Lru:
    """One engine's LRU model: which of a placement's blocks it still holds (``still``,
    ``known``: made once), its placements in touch order, and how many blocks it holds."""

    still: Still
    known: Known
    book: Book = dataclasses.field(default_factory=functools.partial(Book, "back"))
    count: int = 0


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

    Each placement is one record (routing/placed.py) that its blocks point at:
    the age order and the LRU orders are orders of placements. A block the cap
    forgot while an LRU model still holds it stays in that model (an orphan:
    invisible to lookups, counted and evicted in its LRU as any block it holds;
    only a placement touching one takes block-by-block steps). An engine whose
    capacity becomes unknown again loses its LRU model.

    It models only what was sent, so it need not know the engine's blocks one
    by one: its unit is ``unit`` engine blocks (:func:`memory_keys`), which
    divides its per-block work by ``unit`` and resolves matches to ``unit``
    blocks. Its interface speaks engine blocks: hashes per engine block in,
    leading engine blocks out; capacities, the cap and counts held are in
    engine blocks too, converted at the boundary.
    """

    def __init__(self, ttl_s: float, max_blocks: int, capacity_blocks: int = 0, *,
                 on_record: Callable[[str, Sequence[int]], None] | None = None,
                 unit: int = 1) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        #: engine blocks per memory block (:func:`memory_keys`)
        self.unit = max(1, unit)
        #: told of every placement this router makes (replicas share them); a peer's
        #: placements come in through :meth:`record_peer`, which does not tell it
        self.on_record = on_record
        #: every engine's capacity in blocks (0: unknown), unless :attr:`capacities` says
        self.capacity_blocks = capacity_blocks
        #: engine → its own capacity in blocks (discovery's), over ``capacity_blocks``
        self.capacities: dict[str, int] = {}
        self._blocks: dict[int, Holders] = {}  # prefix hash → its holders
        self._ages = Book("keys")  # by each block's latest placement, for the cap
        self._lrus: dict[str, _Lru] = {}  # engine → its LRU model
        # forgotten by the cap, not by an LRU: the claims on it, one placement or {engine: it}
        self._orphans: dict[int, Placed | dict[str, Placed]] = {}
        self._seq = 0
        #: the last tuple of hashes keyed and its keys (a placement's hashes are looked up,
        #: then recorded, then extended by its answer's: keyed once)
        self._keyed: tuple[Sequence[int], Sequence[int]] = ((), ())
        #: the last lookup's keys and the prompt it found them to begin with (a placement's,
        #: which its record then extends: compared once)
        self._matched: tuple[tuple[int, ...], Sequence[int]] = ((), ())

    def record(self, engine: str, hashes: Sequence[int], now: float, head: int = 0) -> None:
        """Remember our own placement (:meth:`record_peer`), and tell :attr:`on_record`.

        A prompt's placement (``head`` 0) with no replicas to tell keeps ``hashes``
        as its ``origin``, which its answer's record reads (:meth:`record_answer`);
        no other placement keeps them: nothing would read them, and they are
        ``unit`` times its keys, outside the memory's cap.
        """
        if self.on_record is not None and hashes:
            self.on_record(engine, hashes)
        self.record_peer(engine, hashes, now, head,
                         keep_origin=self.on_record is None and not head)

    def record_peer(self, engine: str, hashes: Sequence[int], now: float, head: int = 0, *,
                    keep_origin: bool = False) -> None:
        """Remember a placement (a sibling replica's, or our own via :meth:`record`).

        Each hash ends up newest, in order, held by ``engine`` until the new
        expiry: one :class:`Placed` that every block points at, set block by
        block for a short prompt, else in bulk (one C pass puts it on the new
        blocks as it looks each up; the known ones, a shared system prompt's, are
        then updated in one C step where each is ``engine``'s alone, else joined
        one by one). ``head``: how many leading hashes are
        likely one earlier placement's (a prompt's, these being it and its
        answer); where that placement alone still holds exactly them, it is
        extended by the rest and made the newest instead (:meth:`_extended`).
        """
        unit = self.unit
        origin = hashes
        if unit > 1:
            hashes = self._keys(hashes)
            head //= unit  # (the earlier placement's keys: one per whole unit)
        lru, capacity = self._model(engine)
        if hashes:
            head = head or self._continued(engine, hashes)
            matched, keys = self._matched
            prompt = matched if keys is hashes and len(matched) == head else tuple(hashes[:head])
            if head and self._extended(engine, prompt, hashes[head:], now, lru):
                mine = claim(self._blocks.get(hashes[-1]), engine)
            else:
                mine = self._place(engine, hashes, now, lru)
            if keep_origin and mine is not None and len(mine.prompt) == len(hashes):
                mine.origin = origin  # (its keys, in order, are those of ``origin``)
        self._settle(engine, lru, capacity)  # (an empty one too: a capacity may have shrunk)

    def record_answer(self, engine: str, hashes: tuple[int, ...], more: tuple[int, ...],
                      now: float) -> None:
        """:meth:`record` of ``hashes + more`` with ``hashes`` as its head: ``hashes`` a placed
        prompt's, ``more`` the hashes of its answer's blocks after them.

        Where the prompt's placement is extended (:meth:`_extended`), only
        ``more`` is keyed and its keys looked up: the prompt's keys are those
        it was recorded with, and the whole is not joined.
        """
        unit = self.unit
        if self.on_record is not None or len(hashes) < unit:  # (peers hear the whole)
            self.record(engine, hashes + more, now, len(hashes))
            return
        # the prompt's placement, found by its last key, knows its keys while it holds them
        placed = claim(self._blocks.get(hashes[len(hashes) // unit * unit - 1]), engine)
        keys = placed.prompt if placed is not None and placed.origin is hashes else tuple(
            self._keys(hashes))
        # the whole's keys after the prompt's: every ``unit``-th block of the whole
        new = more[(unit - 1 - len(hashes)) % unit::unit] if unit > 1 else more
        lru, capacity = self._model(engine)
        if not (self._answered(engine, keys, new, now, lru) if new
                else self._extended(engine, keys, (), now, lru)):
            self._place(engine, (*keys, *new), now, lru)
        self._settle(engine, lru, capacity)

    def _answered(self, engine: str, prompt: tuple[int, ...], answer: Sequence[int],
                  now: float, lru: _Lru | None) -> bool:
        """Whether the placement of ``prompt`` was extended by ``answer`` (new blocks, its
        answer's), as a placement of their own after it, and it was done.

        Placing both anew would leave them newest, in order, in the age order,
        and the answer's before the prompt's in the LRU model's (touched tail
        first): the prompt's placement is extended by nothing (moved to the
        newest end) and the answer's placed after it, then the LRU model's two
        newest change places. Kept apart, a next turn that does not send the
        answer again (an agent's tool result follows the prompt) extends the
        prompt's placement alone, as placing it anew leaves the answer's blocks
        where they are; one that does takes them back (:meth:`_extended`).
        """
        if (len(answer) >= FEW or any(map(self._blocks.__contains__, answer))
                or len(set(answer)) != len(answer) or self._orphaned(answer)
                or not self._extended(engine, prompt, (), now, lru)):
            return False
        placed = claim(self._blocks.get(prompt[-1]), engine)
        assert placed is not None
        placed.answer = self._place(engine, answer, now, lru)
        if lru is not None:
            lru.book.swap_newest()
        return True

    def _keys(self, hashes: Sequence[int]) -> Sequence[int]:
        """:func:`memory_keys` of ``hashes`` (the same tuple again: the same keys)."""
        if self.unit == 1:
            return hashes
        if self._keyed[0] is hashes:
            return self._keyed[1]
        keys = memory_keys(hashes, self.unit)
        if type(hashes) is tuple:
            self._keyed = (hashes, keys)
        return keys

    def _model(self, engine: str) -> tuple[_Lru | None, int]:
        """``engine``'s LRU model (:meth:`_lru_of`) and its capacity in memory blocks."""
        unit = self.unit
        capacity = self.capacity_of(engine)
        if capacity:  # (in memory blocks)
            capacity = max(1, capacity // unit)
        return self._lru_of(engine, capacity), capacity

    def _continued(self, engine: str, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` may be the whole prompt of ``engine``'s placement of
        the first (a conversation's earlier turn, with its answer): that placement's prompt
        length, where ``hashes`` are at least as long (0: none); :meth:`_extended` checks."""
        placed = claim(self._blocks.get(hashes[0]), engine)
        if placed is None:
            return 0
        n = len(placed.prompt)
        return n if n <= len(hashes) else 0

    def _extended(self, engine: str, prompt: tuple[int, ...], extra: Sequence[int],
                  now: float, lru: _Lru | None) -> bool:
        """Whether ``prompt`` + ``extra`` extend the placement of ``prompt`` and it was done.

        That placement must be ``engine``'s, placed on exactly ``prompt``'s
        blocks, each held by it alone or by a Joint (so no other placement holds
        one alone), in the LRU model exactly when there is one, and ``extra``
        must be new blocks (none an orphan): then placing the two anew
        would leave what this leaves, the placement moved to the newest end of
        each order with the rest after its blocks, a new expiry, and its engine's
        claim in each Joint, in a step per new block or Joint, not per block.
        """
        blocks = self._blocks
        head = len(prompt)
        placed = claim(blocks.get(prompt[-1]), engine) if head else None
        if (placed is None or len(placed.prompt) != head
                or placed.expiry == -math.inf or (lru is not None) != (placed.tag == engine)
                or (placed.prompt is not prompt and placed.prompt != prompt)):
            return False
        joints = [h for h in dict.fromkeys(placed.joints) if type(blocks.get(h)) is Joint]
        if placed.sole + len(joints) != head:
            return False
        more = tuple(extra)
        taken = taken_back(placed, more)
        if taken is None:
            return False
        fresh = more[len(taken):]
        if fresh and (any(map(blocks.__contains__, fresh)) or len(set(fresh)) != len(fresh)
                      or self._orphaned(fresh)):
            return False
        self._seq += 1  # (its entries in the books list nothing from now on)
        placed.seq = self._seq
        placed.origin = placed.answer = None
        if taken:  # its answer's blocks are its own again; their placement holds none
            answer: Placed = blocks[taken[0]]  # type: ignore[assignment]
            self._seq += 1
            answer.seq = self._seq
            answer.sole = 0
            answer.prompt = ()
            blocks.update(zip(taken, itertools.repeat(placed)))
        placed.expiry = now + self.ttl_s
        placed.keys = placed.prompt = placed.prompt + more
        placed.sole += len(more)
        placed.joints = joints
        joining = len(fresh)  # (its answer's blocks were in its engine's LRU model)
        for h in joints:
            joint: Joint = blocks[h]  # type: ignore[assignment]
            before = self._claim(engine, h, joint)  # (its orphan, if the cap forgot it)
            joining += before is None or before.tag != engine
            joint[engine] = joint.age = placed
        blocks.update(zip(fresh, itertools.repeat(placed)))
        self._ages.add(placed)
        if lru is not None:
            placed.back = placed.keys[::-1]
            lru.book.add(placed)
            lru.count += joining
        return True

    def _place(self, engine: str, hashes: Sequence[int], now: float, lru: _Lru | None
               ) -> Placed:
        """Record ``hashes`` as a new placement (:meth:`record_peer`); returns it."""
        blocks = self._blocks
        keys = tuple(hashes)
        self._seq += 1
        mine = Placed(engine, now + self.ttl_s, self._seq, keys)
        touched = self._orphaned(keys)
        if len(keys) < FEW and not touched and len(set(keys)) == len(keys):
            self._place_short(mine, lru)
            return mine
        size = len(blocks)
        found, tail = self._found(keys, mine)
        # the blocks before ``tail`` may change holders; those after it are new, all ``mine``'s
        new_tail = len(blocks) - size if tail < len(keys) else 0
        head, before = (keys, found) if tail == len(keys) else (keys[:tail], found[:tail])
        unknown = found.count(None)
        repeated = (len(set(head)) != len(head) or new_tail != len(keys) - tail
                    if unknown < len(keys) else None)
        present: list[Holders] = list(filter(None, before))  # (the known blocks' holders)
        plain = Joint not in set(map(type, present))
        joining = None  # blocks new to the LRU model: when all are new, as many as went in
        if lru is not None and (repeated is not None or touched):
            joining = self._joining(engine, keys, found, present, repeated is not False or touched)
        if plain and {engine}.issuperset(map(_ENGINE, present)):
            values: Iterable[Holders] = itertools.repeat(mine)
        else:  # some held by others too: joined there (which changes their Joint in place)
            values = joined_runs(head, before, mine)
        if repeated:
            last = dict(zip(keys, found, strict=True))  # (a repeated block's holders once)
            unheld(last.values())
        else:
            unheld(present)
        if present:  # (the new blocks hold ``mine`` already)
            blocks.update(zip(head, values, strict=False))
        if repeated is None:
            repeated = len(blocks) - size != len(keys)  # (new ones repeated)
            if joining is None:
                joining = len(blocks) - size
        if repeated:
            mine.keys = last_places(keys)
        mine.prompt = mine.keys
        mine.sole = len(mine.keys) if type(values) is not list else new_tail + _sole(
            mine, head, values, repeated)
        self._ages.add(mine)
        if lru is not None:  # (before the cap, which keeps what an LRU model holds)
            mine.tag = engine
            mine.back = last_places(reversed(keys)) if repeated else keys[::-1]
            lru.book.add(mine)
            lru.count += joining or 0
        return mine

    def _found(self, keys: tuple[int, ...], mine: Placed) -> tuple[list[Holders | None], int]:
        """Each of ``keys``' holders before ``mine`` (None: a new block), which every new
        block holds from here on, and where a tail of only new blocks begins (``len(keys)``:
        none, or new blocks among known ones).

        One C pass looks each up and puts ``mine`` on the new ones; where all
        are new, or only a tail (a conversation's next turn, or a new prompt after
        a shared head), C steps tell them apart.
        """
        found: list[Any] = list(map(self._blocks.setdefault, keys, itertools.repeat(mine)))
        new = found.count(mine)
        if not new:
            return found, len(found)
        first = found.index(mine)
        if new == len(found) - first:
            found[first:] = itertools.repeat(None, new)
            return found, first
        return [None if f is mine else f for f in found], len(found)

    def _place_short(self, mine: Placed, lru: _Lru | None) -> None:
        """:meth:`_place` block by block, for a few distinct blocks, no orphan (cheaper
        than its bulk steps there): each block's holders joined with ``mine``, their
        placements holding it alone no more, and the blocks new to the LRU model counted."""
        blocks = self._blocks
        engine = mine.engine
        joining = sole = 0
        for h in mine.keys:
            held = blocks.get(h)
            if held is None or (type(held) is Placed and held.engine == engine):
                if held is not None:
                    held.sole -= 1
                    joining -= held.tag == engine
                blocks[h] = mine
                sole += 1
                joining += 1
                continue
            if type(held) is Placed:
                held.sole -= 1
                held.joints.append(h)
                blocks[h] = Joint(held, mine)
                joining += 1
            else:
                before = held.get(engine)  # type: ignore[union-attr]
                joining += before is None or before.tag != engine
                held[engine] = held.age = mine  # type: ignore[index,union-attr]
            mine.joints.append(h)
        mine.prompt = mine.keys
        mine.sole = sole
        self._ages.add(mine)
        if lru is not None:
            mine.tag = engine
            mine.back = mine.keys[::-1]
            lru.book.add(mine)
            lru.count += joining

    def _settle(self, engine: str, lru: _Lru | None, capacity: int) -> None:
        """After a placement: the cap, ``engine``'s LRU model, the books' garbage."""
        blocks = self._blocks
        excess = len(blocks) - max(1, self.max_blocks // self.unit)
        if excess > 0:
            self._forget_oldest(excess)
        if lru is not None:
            excess = lru.count - capacity
            if excess > 0:
                self._let_go(engine, lru.book.pop_oldest(excess, lru.still, lru.known))
                lru.count -= excess
            if lru.book.needs_filter(lru.count):
                lru.book.filter(lru.still, lru.known)
        if self._ages.needs_filter(len(blocks)):
            self._ages.filter(self._age_still, self._age_known)

    def _lru_of(self, engine: str, capacity: int) -> _Lru | None:
        """``engine``'s LRU model when its capacity is known (made on first use), else None
        (and a model kept from when it was known is let go of)."""
        if not capacity:
            gone = self._lrus.pop(engine, None)
            if gone is not None:
                self._untag(engine, Placed.leave_lru)
            return None
        lru = self._lrus.get(engine)
        if lru is None:
            lru = self._lrus[engine] = _Lru(self._lru_still(engine), self._lru_known(engine))
        return lru

    def _joining(self, engine: str, keys: Sequence[int], found: list[Holders | None],
                 present: list[Holders], walk: bool) -> int:
        """How many of ``keys`` are new to ``engine``'s LRU model (``found``: their holders,
        ``present`` those not None): a C count over the placements, a step per
        :class:`Joint`; ``walk``: some repeat or are orphans, so a step per block."""
        if not walk:
            members = list(tags(present)).count(engine)
            for at in joints_at(present):
                mine = present[at].get(engine)  # type: ignore[union-attr]
                members += mine is not None and mine.tag == engine
            return len(keys) - members
        held = dict(zip(keys, found, strict=True))  # (members: claimed, tagged its engine's)
        return sum(1 for h, holders in held.items()
                   if getattr(self._claim(engine, h, holders), "tag", None) != engine)

    def _claim(self, engine: str, h: int, holders: Holders | None) -> Placed | None:
        """``engine``'s latest placement of ``h``: its holders', else an orphan's."""
        mine = claim(holders, engine)
        if mine is None and self._orphans:
            mine = claim(self._orphans.get(h), engine)
        return mine

    def _orphaned(self, keys: Iterable[int]) -> bool:
        """Whether any of ``keys`` is an orphan (a C loop; none at all without orphans)."""
        return bool(self._orphans) and not self._orphans.keys().isdisjoint(keys)

    def _age_still(self, keys: list[int], placed: Placed) -> list[int]:
        """Of ``keys``, those whose latest placement is ``placed`` (their age is its)."""
        return held_by(keys, list(map(self._blocks.get, keys)), placed, _AGE)

    def _lru_still(self, engine: str) -> Still:
        """Of a placement's ``keys``, those ``engine``'s LRU model holds where it put them."""
        in_joint = operator.methodcaller("get", engine)

        def still(keys: list[int], placed: Placed) -> list[int]:
            found = list(map(self._blocks.get, keys))
            if found.count(placed) != len(found) and self._orphaned(keys):
                if found.count(None) == len(found) and list(map(
                        self._orphans.get, keys)).count(placed) == len(keys):
                    return keys  # (all orphans, its alone: the cap's usual leftovers)
                return [h for h, f in zip(keys, found, strict=True)
                        if self._claim(engine, h, f) is placed]
            return held_by(keys, found, placed, in_joint)

        return still

    def _age_known(self, placed: Placed, listing: tuple[int, ...]) -> tuple[int, ...] | None:
        """Of the blocks ``placed`` lists in the age order, those still its, told without a
        walk where its count says (None: a walk must tell). Its age's blocks are those it
        holds alone and the Joints whose age it is (noted in :attr:`Placed.joints`), all
        among those it lists; where the others are Joints it left, they are dropped."""
        blocks = self._blocks
        placed.spent(blocks)  # (a filter's pass: its prompt let go of once its blocks moved on)
        return known_live(placed, listing, blocks, _AGE)

    def _lru_known(self, engine: str) -> Known:
        """:meth:`_age_known` for ``engine``'s LRU model: a placement holds there the blocks
        it holds alone and the Joints where it is the engine's (where it lists an orphan, a
        walk must tell)."""
        in_joint = operator.methodcaller("get", engine)

        def known(placed: Placed, listing: tuple[int, ...]) -> tuple[int, ...] | None:
            if placed.tag != engine:
                return ()
            if self._orphaned(listing):
                return None
            return known_live(placed, listing, self._blocks, in_joint)

        return known

    def _forget_oldest(self, count: int) -> None:
        """The cap: forget the ``count`` oldest blocks; what an LRU model holds stays there."""
        blocks = self._blocks
        gone = self._ages.pop_oldest(count, self._age_still)
        found = list(map(blocks.pop, gone))
        unheld(found)
        if not self._lrus:
            return
        orphans = self._orphans
        if Joint not in set(map(type, found)) and orphans.keys().isdisjoint(gone):
            # (in C: each held by one placement, none an orphan already)
            orphans.update(itertools.compress(zip(gone, found, strict=True), map(
                _known, tags(found))))
            return
        for h, holders in zip(gone, found, strict=True):
            claims = [*placements(orphans[h]), *placements(holders)] if h in orphans else [
                *placements(holders)]
            members = {p.engine: p for p in claims if p.tag is not None}
            if members:
                orphans[h] = members.popitem()[1] if len(members) == 1 else members

    def _let_go(self, engine: str, gone: Sequence[int]) -> None:
        """``engine`` no longer holds ``gone`` (its LRU forgot them): forget its claim on each."""
        blocks = self._blocks
        orphaned = self._orphaned(gone)
        if orphaned and blocks.keys().isdisjoint(gone) and {engine} == set(map(
                getattr, map(self._orphans.get, gone), _ENGINES, _NONES)):  # (its orphans alone)
            collections.deque(map(self._orphans.__delitem__, gone), maxlen=0)
            return
        if orphaned or len(gone) < FEW:
            self._let_go_each(engine, gone)
            return
        # the walk found each this engine's: each taken out in C, a Joint put back and left
        found = list(map(blocks.pop, gone))
        first = found[0]
        if type(first) is Placed and found.count(first) == len(found):
            first.sole -= len(found)  # (the usual: blocks one placement held alone)
            return
        at = 0
        for _, same in itertools.groupby(found, key=id):  # (runs of one holder: a step each)
            run = list(same)
            holders = run[0]
            if type(holders) is Placed:
                holders.sole -= len(run)
            else:  # a Joint: put back, and left
                for h in gone[at:at + len(run)]:
                    blocks[h] = holders
                    self._leave_joint(engine, h, holders)  # type: ignore[arg-type]
            at += len(run)

    def _let_go_each(self, engine: str, gone: Sequence[int]) -> None:
        """:meth:`_let_go` block by block (some are orphans, or a few blocks): each block's
        claim where it is."""
        orphans = self._orphans
        get = self._blocks.get
        for h in gone:
            holders = get(h)
            if h in orphans:
                self._unorphan(engine, h)
            if holders is None:
                continue
            if isinstance(holders, Joint):
                self._leave_joint(engine, h, holders)
            elif holders.engine == engine or holders.expiry == -math.inf:
                del self._blocks[h]  # this engine's, or a forgotten one's: nobody's now
                holders.sole -= 1

    def _unorphan(self, engine: str, h: int) -> None:
        """``engine``'s claim on the orphan ``h`` is let go of (it may hold none)."""
        orphan = self._orphans[h]
        if type(orphan) is Placed:
            if orphan.engine == engine:
                del self._orphans[h]
        elif orphan.pop(engine, None) is not None and not orphan:  # type: ignore[union-attr]
            del self._orphans[h]

    def _leave_joint(self, engine: str, h: int, holders: Joint) -> None:
        """``engine`` lets go of ``h``, which ``holders`` hold: gone once only the forgotten
        hold it."""
        holders.pop(engine, None)
        if all(p.expiry == -math.inf for p in holders.values()):
            del self._blocks[h]

    def capacity_of(self, engine: str) -> int:
        """``engine``'s prefix cache in engine blocks as this model knows it (0: unknown)."""
        return self.capacities.get(engine) or self.capacity_blocks

    def lookup_at(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Per engine, how many leading ``hashes`` it holds unexpired (holding none: absent).

        In engine blocks: the memory blocks matched × :attr:`unit`; all of
        ``hashes`` for a prompt shorter than one unit that matched its one key.
        """
        unit = self.unit
        if unit > 1 and hashes:
            found = self._lookup(self._keys(hashes), now)
            whole = len(hashes)
            return {engine: min(depth * unit, whole) for engine, depth in found.items()}
        return self._lookup(hashes, now)

    def _lookup(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """:meth:`lookup_at` in memory blocks (``hashes``: memory keys)."""
        blocks = self._blocks
        first = blocks.get(hashes[0]) if hashes else None
        result: dict[str, int] = {}
        if not first:
            return result
        start = held_alone(first, hashes)  # (leading hashes held by ``first`` alone)
        if start and type(hashes) is tuple:  # (immutable: the record may trust the match)
            self._matched = (first.prompt, hashes)  # type: ignore[union-attr]
        start = start or 1
        # the holders of the leading hashes anyone was sent (a C loop up to the first unknown),
        # as runs of one holder (blocks placed together share theirs): a step per run
        found = itertools.takewhile(_known, map(blocks.get, itertools.islice(hashes, start, None)))
        runs = []
        for _, same in itertools.groupby(found, key=id):
            run = list(same)
            runs.append((run[0], len(run)))
        for first_placed in placements(first):
            engine = first_placed.engine
            if first_placed.expiry <= now:
                continue
            depth = start
            for holders, count in runs:
                if type(holders) is Placed:
                    if holders.engine != engine or holders.expiry <= now:
                        break
                else:
                    mine = holders.get(engine)  # type: ignore[union-attr]
                    if mine is None or mine.expiry <= now:
                        break
                depth += count
            result[engine] = depth
        return result

    def held(self, engine: str) -> int | None:
        """Engine blocks the LRU model says ``engine`` holds (None: no capacity, no model)."""
        if not self.capacity_of(engine):
            return None
        lru = self._lrus.get(engine)
        return 0 if lru is None else lru.count * self.unit

    def forget_engine(self, engine: str) -> None:
        """``engine`` holds nothing (a restart): its placements are forgotten, its LRU model
        too; the blocks stay counted for the cap."""
        self._lrus.pop(engine, None)
        self._untag(engine, Placed.forget)

    def _untag(self, engine: str, leave: Callable[[Placed], None]) -> None:
        """Let go of ``engine``'s orphans; ``leave`` each of its placements its blocks name."""
        for holders in self._blocks.values():
            mine = claim(holders, engine)
            if mine is not None:
                leave(mine)
        for h in [h for h, o in self._orphans.items() if claim(o, engine) is not None]:
            self._unorphan(engine, h)

    def __len__(self) -> int:
        """The memory blocks remembered (engine blocks ÷ :attr:`unit`, rounded up per prompt)."""
        return len(self._blocks)


def memory_keys(hashes: Sequence[int], unit: int) -> Sequence[int]:
    """The memory's keys for a prompt's engine-block prefix hashes: one per ``unit`` blocks.

    A prefix hash names its whole prefix, so the hash of every ``unit``-th
    block keys the prefix up to it; the blocks after the last whole run are
    not remembered. A prompt shorter than ``unit`` blocks is keyed by its last
    hash, so it is remembered too (and matches only a prompt of the same
    blocks). Only then: a partial run's key would be left behind, counted as a
    whole unit, by every next turn or answer, which the measured routing
    (scripts/routing_sim.py) showed costs more than the blocks it matches.
    """
    keys = hashes[unit - 1::unit]
    if not keys and hashes:
        return hashes[-1:]
    return keys


def _sole(mine: Placed, keys: Sequence[int], values: list[Holders], repeated: bool) -> int:
    """Of ``keys``, placed with ``values`` as their holders, how many ``mine`` holds alone
    (where a block repeats, its last holders are its)."""
    return (list(dict(zip(keys, values, strict=True)).values()) if repeated
            else values).count(mine)


def best_of(found: dict[str, int], names: Sequence[str]) -> int:
    """The most blocks any of ``names`` holds in a lookup's answer."""
    if len(names) == 1:
        return found.get(names[0], 0)
    return max(found.get(name, 0) for name in names)
