"""The approximate memory's records: one per placement, shared by all its blocks (sans-IO).

A placement of a prompt's thousand blocks is one :class:`Placed`; each block
points at the latest placement that sent it to each engine (its holders). The
memory's two orders, every block's age (for the cap) and each engine's LRU
model, are orders of placements: a :class:`Book` lists them oldest first, and
a block is where its latest placement put it (within one, in the placement's
order). So a placement is one bulk dict update, not a linked node per block
and order; what falls out of an order is found by walking its oldest
placements and keeping the blocks still theirs, a C loop per placement.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal

__all__ = ["FEW", "Book", "Holders", "Joint", "Known", "Placed", "Still", "claim", "held_alone",
           "held_by", "joined_runs", "joints_at", "known_live", "last_places", "placements",
           "same_as", "tags", "taken_back", "unheld", "without"]


@dataclasses.dataclass(slots=True, eq=False)
class Placed:
    """One placement: ``keys`` (its blocks, each at its last place) sent to ``engine``.

    ``back``: the blocks in the engine's LRU touch order (tail first, each at its
    last place there), when the engine's LRU is modelled; ``tag`` is then the
    engine while the placement counts in that LRU (None once the engine is forgotten).
    """

    engine: str
    expiry: float
    seq: int
    keys: tuple[int, ...]
    back: tuple[int, ...] = ()
    tag: str | None = None
    #: its blocks as placed, while an extension may take it (``keys`` as the age order
    #: lists them may be fewer since); () once its blocks moved on (:meth:`spent`)
    prompt: tuple[int, ...] = ()
    #: blocks whose holders are this placement itself (it alone holds them)
    sole: int = 0
    #: blocks where it joined a :class:`Joint` (some may have moved on since)
    joints: list[int] = dataclasses.field(default_factory=list)
    #: the engine-block hashes whose memory keys ``prompt`` is, until it changes (its
    #: answer is recorded on them without keying them again); None: not known
    origin: Sequence[int] | None = None
    #: the placement of its answer's blocks, placed with it (a next turn that sends them
    #: again takes them back: routing/approx.py ``_answered``)
    answer: Placed | None = None

    def spent(self, blocks: Mapping[int, Placed | Joint]) -> None:
        """Let go of ``prompt`` once fewer of the blocks placed are still this placement's
        than it placed: those it holds alone (``sole``) and the noted Joints among
        ``blocks`` (each block's holders) whose claim for its engine is still it.

        An extension could still take Joints its engine's later placements claim
        (placing anew would leave the same), but it is a shortcut for the answer
        that follows a prompt, and a placement whose blocks have moved on (a
        conversation's earlier turn, whose answer the next turn did not resend) would
        otherwise keep its whole conversation's tuple.
        """
        if not self.prompt:
            return
        claimed = sum(type(held := blocks.get(h)) is Joint
                      and held.get(self.engine) is self
                      for h in set(self.joints))
        if self.sole + claimed < len(self.prompt):
            self.prompt = ()
            self.origin = None

    def leave_lru(self) -> None:
        """Its engine's LRU is modelled no more: this placement counts in none."""
        self.tag = None

    def forget(self) -> None:
        """The engine is forgotten: this placement holds nothing, anywhere, any more."""
        self.expiry = -math.inf
        self.tag = None


class Joint(dict[str, Placed]):
    """A block's holders when several engines hold it: {engine: its latest placement},
    and the latest placement of all (``age``: where the block is in the age order)."""

    __slots__ = ("age",)

    def __init__(self, *placed: Placed) -> None:
        super().__init__((p.engine, p) for p in placed)
        self.age = placed[-1]


#: a block's holders: one placement (one engine, its age too), or a :class:`Joint`
Holders = Placed | Joint
#: fewer blocks than this are cheaper placed, let go of or told still held one by one in
#: a Python loop than in the bulk C steps
FEW: Final = 16
_SLACK: Final = 4096  # listed blocks a book may carry beyond twice its live ones
_WINDOW: Final = 8  # blocks walked past what :meth:`Book.pop_oldest` needs


def claim(holders: Placed | Mapping[str, Placed] | None, engine: str) -> Placed | None:
    """``engine``'s latest placement among ``holders``."""
    if holders is None:
        return None
    if type(holders) is Placed:
        return holders if holders.engine == engine else None
    return holders.get(engine)  # type: ignore[union-attr]


def _joined(holders: Holders | None, mine: Placed) -> Holders:
    """``holders`` with ``mine`` among them (as its engine's latest)."""
    if holders is None:
        return mine
    if type(holders) is Placed:
        if holders.engine == mine.engine:
            return mine
        return Joint(holders, mine)
    holders[mine.engine] = mine  # type: ignore[index]
    holders.age = mine  # type: ignore[union-attr]
    return holders


def joined_runs(keys: Sequence[int], found: list[Holders | None], mine: Placed
                ) -> list[Holders]:
    """Each of ``found`` (the holders of ``keys``) joined with ``mine``, a run of one
    holder at a time.

    Blocks placed together share their holder, so the runs are few: those of
    no holder or of ``mine``'s engine alone take ``mine`` in bulk; the others
    are joined one by one (each block gets a Joint of its own), and each
    placement in a Joint notes the block (:attr:`Placed.joints`).
    """
    out: list[Holders] = []
    at = 0
    for _, same in itertools.groupby(found, key=id):
        run = list(same)
        holders = run[0]
        if holders is None or (type(holders) is Placed and holders.engine == mine.engine):
            out.extend(itertools.repeat(mine, len(run)))
        else:
            for h, one in zip(keys[at:at + len(run)], run, strict=True):
                if type(one) is Placed:
                    one.joints.append(h)
                mine.joints.append(h)
                out.append(_joined(one, mine))
        at += len(run)
    return out


#: of some blocks a placement lists in a book's order, those it still holds there, in order
Still = Callable[[list[int], Placed], list[int]]
#: of the blocks a placement lists in a book's order, those still its there, told without
#: a walk where its counts tell (None: a walk must tell)
Known = Callable[[Placed, tuple[int, ...]], tuple[int, ...] | None]


class Book:
    """Placements oldest first: one order of blocks (see the module docstring).

    ``listing`` names the field of a placement that lists its blocks in this
    order (``keys`` or ``back``); the owner says, in bulk, which blocks a
    placement still holds there. A placement added again (extended: its ``seq``
    moved on) leaves its earlier entry behind, which lists nothing any more (so
    adding one is a step, not a search), unless that entry is the newest: then
    it is replaced.
    """

    __slots__ = ("_head", "_listed", "entries", "listing")

    def __init__(self, listing: Literal["keys", "back"]) -> None:
        self.listing = listing
        #: (placement, its seq when added, what it listed then), oldest first
        self.entries: collections.deque[tuple[Placed, int, tuple[int, ...]]] = (
            collections.deque())
        self._head = 0  # blocks of the oldest entry already walked past
        self._listed = 0  # blocks the entries list from the head on

    def add(self, placed: Placed) -> None:
        """List ``placed`` newest; where it is the newest entry already (extended before
        any other placement came), that entry is replaced rather than left behind."""
        listed: tuple[int, ...] = getattr(placed, self.listing)
        entries = self.entries
        if entries and entries[-1][0] is placed and (len(entries) > 1 or not self._head):
            self._listed -= len(entries.pop()[2])
        entries.append((placed, placed.seq, listed))
        self._listed += len(listed)

    def swap_newest(self) -> None:
        """The two newest entries change places (neither is the oldest, partly walked)."""
        entries = self.entries
        assert len(entries) > 2 or not self._head
        newest = entries.pop()
        entries.insert(len(entries) - 1, newest)

    def needs_filter(self, live: int) -> bool:
        """Whether the listed blocks outnumber ``live`` enough to filter (:meth:`filter`)."""
        return self._listed > 2 * live + _SLACK

    def pop_oldest(self, count: int, still: Still, known: Known | None = None) -> list[int]:
        """Walk past the ``count`` oldest blocks still placed (``still``: of some listed
        blocks of a placement, those it still holds here, in order); returns them.

        ``known`` (as :meth:`filter`'s): where it tells which blocks a placement not
        walked into yet still holds, they are taken without a walk.
        """
        out: list[int] = []
        entries = self.entries
        while len(out) < count and entries:
            p, seq, listed = entries[0]
            start = self._head
            end = len(listed)
            held = None if start or known is None or p.seq != seq else known(p, listed)
            if held is not None:
                need = count - len(out)
                if len(held) > need:  # (all it lists held: they end where the need does)
                    end = need if held is listed else listed.index(held[need - 1]) + 1
                    held = held[:need]
                out.extend(held)
            elif p.seq == seq:  # (a window of a few more, so dead blocks cost no extra walk)
                need = count - len(out)
                live = still(list(listed[start:start + need + _WINDOW]), p)
                if len(live) > need:
                    del live[need:]
                    end = listed.index(live[-1], start) + 1
                else:
                    end = min(end, start + need + _WINDOW)
                out.extend(live)
            self._listed -= end - start
            if end == len(listed):
                entries.popleft()
                self._head = 0
            else:
                self._head = end
        return out

    def current(self) -> Iterator[tuple[Placed, tuple[int, ...]]]:
        """Each placement's entry that still lists, with what it lists from the head on."""
        for n, (p, seq, listed) in enumerate(self.entries):
            if p.seq == seq:
                yield p, listed[self._head:] if n == 0 and self._head else listed

    def filter(self, still: Still, known: Known) -> None:
        """Let each placement list only the blocks it still holds here.

        ``known``: of a placement's listed blocks, those it still holds, told
        without a walk (None: its blocks are walked).
        """
        kept: collections.deque[tuple[Placed, int, tuple[int, ...]]] = collections.deque()
        listed = 0
        partial = self._head and self.entries and self.entries[0][0].seq == self.entries[0][1]
        for n, (p, listing) in enumerate(self.current()):
            live = None if n == 0 and partial else known(p, listing)
            if live is None:
                live = tuple(still(list(listing), p))
            if not live:
                continue
            if live is not listing or (n == 0 and partial):
                setattr(p, self.listing, live)
            kept.append((p, p.seq, live))
            listed += len(live)
        self.entries = kept
        self._head = 0
        self._listed = listed


def without(listing: tuple[int, ...], live: int, stale: Iterable[int]) -> tuple[int, ...] | None:
    """``listing`` without ``stale``'s blocks, where that leaves ``live`` blocks (else None:
    some other listed block is not held either)."""
    at = []
    for h in stale:
        try:
            at.append(listing.index(h))
        except ValueError:
            continue
    if live + len(at) != len(listing):
        return None
    out: list[int] = []
    start = 0
    for i in sorted(at):
        out.extend(listing[start:i])
        start = i + 1
    out.extend(listing[start:])
    return tuple(out)


def same_as(found: Iterable[Any], p: Placed) -> Iterator[bool]:
    """For each of ``found``, whether it is ``p`` itself (a C loop)."""
    return map(operator.is_, found, itertools.repeat(p))


def unheld(found: Iterable[Holders | None]) -> None:
    """The blocks whose holders were ``found`` are held otherwise now (or not at all): each
    placement among them holds that many fewer alone (a step per run of one holder)."""
    for _, same in itertools.groupby(found, key=id):
        run = list(same)
        if type(run[0]) is Placed:
            run[0].sole -= len(run)


def joints_at(found: Sequence[Holders | None]) -> list[int]:
    """Where among ``found`` the holders are a :class:`Joint` (a C loop; they are few)."""
    return list(itertools.compress(range(len(found)), map(
        operator.is_, map(type, found), itertools.repeat(Joint))))


def tags(found: Iterable[Holders | None]) -> Iterator[str | None]:
    """Each of ``found``'s LRU tag where it is one placement, else None (a C loop)."""
    return map(getattr, found, itertools.repeat("tag"), itertools.repeat(None))


def placements(holders: Placed | Mapping[str, Placed]) -> Iterable[Placed]:
    """Each placement among ``holders``."""
    return (holders,) if type(holders) is Placed else holders.values()  # type: ignore[union-attr]


def last_places(keys: Iterable[int]) -> tuple[int, ...]:
    """``keys`` with each repeated one at its last place only."""
    return tuple(reversed(dict.fromkeys(reversed(list(keys)))))


def known_live(placed: Placed, listing: tuple[int, ...], blocks: Mapping[int, Holders],
               in_joint: Callable[[Joint], Placed | None]) -> tuple[int, ...] | None:
    """Of ``listing``, the blocks ``placed`` still holds, where its counts tell (else None):
    those it holds alone, and its noted Joints in ``blocks`` where it is ``in_joint``."""
    joined = [type(held := blocks.get(h)) is Joint and in_joint(held) is placed
              for h in dict.fromkeys(placed.joints)]
    live = placed.sole + sum(joined)
    if live == len(listing):
        return listing
    if not live:
        return ()
    return without(listing, live, itertools.compress(
        dict.fromkeys(placed.joints), map(operator.not_, joined)))


def held_by(keys: list[int], found: list[Holders | None], placed: Placed,
            in_joint: Callable[[Joint], Placed | None]) -> list[int]:
    """Of ``keys`` (``found``: their holders), those ``placed`` holds: it alone, or where it
    is ``in_joint`` of their Joint (a C count in the usual case, all its alone)."""
    if found.count(placed) == len(found):
        return keys
    if len(found) < FEW:
        return [h for h, f in zip(keys, found, strict=True)
                if f is placed or (type(f) is Joint and in_joint(f) is placed)]
    live = list(same_as(found, placed))
    for at in joints_at(found):
        live[at] = in_joint(found[at]) is placed  # type: ignore[arg-type]
    return list(itertools.compress(keys, live))


def held_alone(first: Holders, hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` are the prompt of ``first``, the first's holders, which
    holds each of them alone (0: not so, or not told without a walk).

    A conversation's next turn begins with its last turn's placement, which
    holds its blocks alone until they move on (its ``sole`` count says): those
    are compared in one C step, not looked up.
    """
    if type(first) is not Placed:
        return 0
    prompt = first.prompt
    n = len(prompt)
    if not n or first.sole != n or n > len(hashes):
        return 0
    return n if prompt == tuple(hashes[:n]) else 0


def taken_back(placed: Placed, more: tuple[int, ...]) -> tuple[int, ...] | None:
    """Of ``more`` (what extends ``placed``), the leading blocks its answer's placement
    holds, to take back: all of that placement's, held by it alone where ``placed``'s
    engine holds them (() where ``more`` does not begin with them; None: it does, but
    they are not all so held, and placing anew must tell)."""
    answer = placed.answer
    if answer is None or not answer.prompt or more[:len(answer.prompt)] != answer.prompt:
        return ()
    if (answer.sole != len(answer.prompt) or answer.engine != placed.engine
            or answer.expiry == -math.inf or answer.tag != placed.tag):
        return None
    return answer.prompt
