"""Per engine, the prefill work a KV-aware router sent and the engine has not finished (sans-IO).

Engines prefill first come, first served, so a request waits for the blocks
queued ahead of it; until an engine's KV events show a request's blocks, they
are also cached there for the requests sent after it.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from direct_frontend.routing.tally import add_all, remove_all

__all__ = ["LANDED_FORGET_S", "PREFILL_FORGET_S", "PrefillQueue"]

#: a queued prefill nobody heard of again (its request failed early) stops counting after this
PREFILL_FORGET_S = 60.0
#: a prefilled request's blocks the KV events have not shown stop counting as pending this
#: long after its first token. Engines publish a prompt's blocks when they admit it or schedule
#: its last chunk, before its first token, so by then only the events' way to the index (a few
#: ms) can hide them; what is still not shown after that was never stored (a cache full of
#: running requests' blocks has no room for the prompt's tail) or was evicted before the index
#: was read, and crediting it sends the prompt's followers where its prefix is not (in a tight
#: cache a tenant's system prompt can be gone within a second)
LANDED_FORGET_S = 0.25


class PrefillQueue:
    """Per engine, the prefill work (blocks) we sent it that it has not finished, as we know it.

    Each entry is one request's prompt blocks (prefix hashes) and how many of
    them it has to prefill. Until the engine's KV events show its last prompt
    block stored, its blocks are *pending* there (:meth:`pending`): not in the
    index yet, but cached before a request sent after it is prefilled (engines
    prefill first come, first served), and after its prefill, cached where the
    events have not said so yet, for ``LANDED_FORGET_S`` at most. Its blocks
    count in the queue (:meth:`depth`) until its prefill is done (its first
    token), events or not.
    """

    def __init__(self) -> None:
        #: engine → token → [the request's prompt block hashes, blocks to prefill (0 once
        #: prefilled), sent at, prefilled at (None: not yet), whether they count as pending]
        self._queued: dict[str, collections.OrderedDict[int, list[Any]]] = {}
        #: engine → block hash → how many pending requests' prompts hold it
        self._pending: dict[str, dict[int, int]] = {}
        #: engine → (prefilled at, token) of its prefilled entries, oldest first: let go of
        #: once ``LANDED_FORGET_S`` is past (:meth:`_expire`; some are dropped already)
        self._landed: dict[str, collections.deque[tuple[float, int]]] = {}
        self._next = 0

    def add(self, engine: str, hashes: Sequence[int], blocks: int, now: float,
            pending: bool = True) -> int:
        """Queue one request's prompt blocks on ``engine``; the token to call it prefilled by.

        ``pending`` False: its blocks do not count in :meth:`pending` (asked only of
        engines whose KV events flow; without them the approximate memory, which
        records each placement as it is made, says what is there), which saves a
        step per block. What is past its time on ``engine`` goes first (:meth:`_prune`),
        so a queue whose depth nobody asks (``cache_affinity``'s) stays bounded too.
        """
        self._prune(engine, now)
        self._next += 1
        entry = tuple(hashes)
        self._queued.setdefault(engine, collections.OrderedDict())[self._next] = [
            entry, blocks, now, None, pending]
        if pending:
            add_all(self._pending.setdefault(engine, {}), entry)
        return self._next

    def prefilled(self, engine: str, token: int, now: float) -> None:
        """The request's prefill is done (its first token, or its end): no longer queued.

        Its blocks stay pending until the events show them, for at most
        ``LANDED_FORGET_S`` (on an engine without events, until the next
        :meth:`depth`). A placement carries this as :attr:`Placement.prefilled`;
        a request that never gets that far is forgotten by :meth:`depth` or the
        engine's next :meth:`add` after ``PREFILL_FORGET_S``.
        """
        queued = self._queued.get(engine)
        entry = None if queued is None else queued.get(token)
        if entry is not None and entry[3] is None:
            entry[1], entry[3] = 0, now
            self._landed.setdefault(engine, collections.deque()).append((now, token))

    def _expire(self, engine: str, now: float) -> None:
        """Drop ``engine``'s prefilled entries older than ``LANDED_FORGET_S`` (a step each)."""
        landed = self._landed.get(engine)
        if not landed:
            return
        queued = self._queued[engine]
        while landed and now - landed[0][0] > LANDED_FORGET_S:
            _, token = landed.popleft()
            if token in queued:
                self._drop(engine, token)

    def _prune(self, engine: str, now: float) -> None:
        """Drop what ``engine``'s queue holds past its time: prefilled entries after
        ``LANDED_FORGET_S``, any entry after ``PREFILL_FORGET_S`` (oldest first)."""
        self._expire(engine, now)
        queued = self._queued.get(engine)
        while queued:  # oldest first: forget what we will never hear of again
            token, (_, _, sent, _, _) = next(iter(queued.items()))
            if now - sent <= PREFILL_FORGET_S:
                break
            self._drop(engine, token)

    def _drop(self, engine: str, token: int) -> None:
        hashes, *_, pending = self._queued[engine].pop(token)
        if pending:
            remove_all(self._pending[engine], hashes)

    def forget(self, engine: str) -> None:
        """``engine``'s process is new: what we queued on the old one will never be heard of."""
        self._queued.pop(engine, None)
        self._pending.pop(engine, None)
        self._landed.pop(engine, None)

    def pending(self, engine: str, hashes: Sequence[int], now: float) -> int:
        """The leading blocks of ``hashes`` that requests we sent ``engine`` are storing
        (those prefilled more than ``LANDED_FORGET_S`` before ``now`` no longer)."""
        self._expire(engine, now)
        pending = self._pending.get(engine)
        if not pending:
            return 0
        return len(list(itertools.takewhile(pending.__contains__, hashes)))  # (a C loop)

    def depth(self, engine: str, now: float, stored: Callable[[int], bool] | None) -> int:
        """Blocks still to prefill (:meth:`depths`)."""
        return self.depths(engine, now, stored)[0]

    def requests(self, engine: str) -> int:
        """Requests in ``engine``'s queue as of its last pruning (:meth:`add`,
        :meth:`pending`, :meth:`depths`): those still to prefill, and those prefilled whose
        blocks its events have not shown yet."""
        return len(self._queued.get(engine, ()))

    def depths(self, engine: str, now: float,
               stored: Callable[[int], bool] | None) -> tuple[int, int]:
        """Blocks still to prefill, and of those the blocks the engine's events do not show
        stored yet (what the engine is about to hold beyond what the index says);
        ``stored(h)``: the engine's events show block ``h`` stored.

        A request counts until its first token (:meth:`prefilled`): engines
        announce a prompt's blocks when they admit it (SGLang's radix tree, the
        simulated engines) or schedule its last chunk (vLLM), before its
        prefill ends, so the events showing its last block stored say it is
        under way, not done. From then its blocks are in the index and pending
        no longer. ``stored`` None: the engine has no events, so a prefilled
        request's blocks are pending no longer.
        """
        self._prune(engine, now)
        queued = self._queued.get(engine)
        if not queued:
            return 0, 0
        total = unshown = 0
        for token, entry in list(queued.items()):
            hashes, blocks, _, landed, pending = entry
            shown = bool(hashes) and stored is not None and stored(hashes[-1])
            if landed is not None and (
                    stored is None or not hashes or shown or now - landed > LANDED_FORGET_S):
                self._drop(engine, token)  # prefilled, and stored or no events to wait for
                continue
            if shown:  # the index holds its blocks from here on: pending no longer
                if pending:
                    remove_all(self._pending[engine], hashes)
                entry[0] = ()
            elif hashes:
                unshown += blocks
            total += blocks  # queued until its first token, whatever the events say
        return total, unshown

