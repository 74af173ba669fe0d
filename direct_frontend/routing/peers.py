"""What sibling replicas of this router tell it, as the policies read it (sans-IO).

Several daemons in front of one fleet each know only their own requests.
Over the replica link (control/replicas.py) each one sends, every time it
changes, its in-flight requests and KV blocks per engine (by engine name:
incarnation numbers are local) and the approximate-mode placements it
makes. :class:`PeerLoads` keeps the latest word of every peer and forgets a
peer that fell silent; :func:`apply_peer_loads` writes the sums into the
catalog's load counters, where the cost functions read them
(``EngineLoad.fleet_in_flight``, ``EngineLoad.peer_blocks``).
:class:`PlacementShare` sits between the link and whichever ``kv_aware``
policy is current (a reload builds a new one).
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

from direct_frontend.routing.approx import ApproxPrefixIndex
from direct_frontend.routing.catalog import EngineHandle

#: engine name → (requests in flight, the KV blocks they hold). The blocks themselves, not
#: a count: requests sharing a prefix hold its blocks once, whichever replica sent them,
#: so a prompt in flight elsewhere does not make its own cache look busy.
Loads = dict[str, tuple[int, frozenset[int]]]

_NONE: tuple[int, frozenset[int]] = (0, frozenset())


def local_loads(engines: Iterable[EngineHandle]) -> Loads:
    """This replica's own load per engine name (an engine's incarnations summed)."""
    out: Loads = {}
    for engine in engines:
        load = engine.load
        requests, blocks = out.get(engine.name, _NONE)
        out[engine.name] = (requests + load.in_flight, blocks | load.active_set())
    return out


def apply_peer_loads(
    engines: Iterable[EngineHandle], totals: Mapping[str, tuple[int, frozenset[int]]]
) -> None:
    """Set every engine's peer counters to what the peers say (none where they say nothing)."""
    for engine in engines:
        engine.load.peers_say(*totals.get(engine.name, _NONE))


@dataclasses.dataclass(slots=True)
class _Peer:
    loads: Loads
    seen: float
    seq: int


class PeerLoads:
    """The latest load each peer reported; a peer silent for ``timeout_s`` no longer counts."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._peers: dict[str, _Peer] = {}

    def update(self, replica: str, seq: int, loads: Loads, now: float) -> bool:
        """A peer's report; an older one than already held (reordered) is ignored."""
        peer = self._peers.get(replica)
        if peer is not None and seq <= peer.seq:
            return False
        self._peers[replica] = _Peer(loads, now, seq)
        return True

    def leave(self, replica: str) -> None:
        """A peer said goodbye: its load goes at once."""
        self._peers.pop(replica, None)

    def expire(self, now: float) -> list[str]:
        """Forget peers not heard from for ``timeout_s``; the ones forgotten."""
        gone = [r for r, p in self._peers.items() if now - p.seen > self.timeout_s]
        for replica in gone:
            del self._peers[replica]
        return gone

    def clear(self) -> None:
        self._peers.clear()

    def totals(self) -> Loads:
        out: Loads = {}
        for peer in self._peers.values():
            for name, (requests, blocks) in peer.loads.items():
                have_requests, have_blocks = out.get(name, _NONE)
                out[name] = (have_requests + requests, have_blocks | blocks)
        return out

    @property
    def replicas(self) -> list[str]:
        return sorted(self._peers)

    def __contains__(self, replica: object) -> bool:
        return replica in self._peers

    def __len__(self) -> int:
        return len(self._peers)


class PlacementShare:
    """The live ``kv_aware`` policies' approximate indexes, and what they placed since last sent.

    The outbox is bounded (``max_pending`` placements, the oldest dropped
    first): while the link is down it keeps the newest word, which goes out
    when the link is back (:meth:`put_back` keeps what a failed send took).
    Every live index hears a peer's placements (one per model; a reload's
    replaced policy lets go of its own).
    """

    def __init__(self, max_pending: int = 4096,
                 notify: Callable[[], None] | None = None) -> None:
        self.max_pending = max_pending
        self._indexes: weakref.WeakSet[ApproxPrefixIndex] = weakref.WeakSet()
        self._outbox: collections.deque[tuple[str, tuple[int, ...]]] = collections.deque(
            maxlen=max_pending)
        self.dropped = 0
        #: called on each new placement, so the link can send it now rather than next tick
        self.notify = notify

    def new_index(self, ttl_s: float, max_blocks: int,
                  capacity_blocks: int = 0, unit: int = 1) -> ApproxPrefixIndex:
        """A new policy's approximate index: its placements go out, peers' come in to it.

        Placements travel as engine-block hashes, which each index keys at its own unit.
        """
        approx = ApproxPrefixIndex(ttl_s, max_blocks, capacity_blocks, on_record=self._placed,
                                   unit=unit)
        self._indexes.add(approx)
        return approx

    def _placed(self, engine: str, hashes: Sequence[int]) -> None:
        self._queue([(engine, tuple(hashes))])
        if self.notify is not None:
            self.notify()

    def _queue(self, placed: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        for item in placed:
            if len(self._outbox) == self.max_pending:
                self.dropped += 1
            self._outbox.append(item)

    def take(self) -> list[tuple[str, tuple[int, ...]]]:
        """What was placed since the last call (and forget it)."""
        out = list(self._outbox)
        self._outbox.clear()
        return out

    def pending(self) -> list[tuple[str, tuple[int, ...]]]:
        """What waits to go out (kept: :meth:`take` still returns it)."""
        return list(self._outbox)

    def put_back(self, placed: list[tuple[str, tuple[int, ...]]]) -> None:
        """A send of ``placed`` failed: they go out next time, before what came since."""
        since = self.take()
        self._queue(placed)
        self._queue(since)

    def from_peer(self, engine: str, hashes: Sequence[int], now: float) -> None:
        for approx in self._indexes:
            approx.record_peer(engine, hashes, now)
