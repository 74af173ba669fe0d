r"""The KV-event plane: one index for the fleet, one subscription per engine rank.

Each engine incarnation with ``kv_events`` in the fleet file gets one
subscriber per data-parallel rank, run inside that incarnation's nursery (so
removing or replacing the engine cancels it). Index keys name the
incarnation (``g<incarnation>r<rank>``), so a replaced engine's late events or
clean-up never touch its successor. Fencing: an engine that goes unhealthy
or restarts is resynced (its entries cleared, replayed from the start when
the engine keeps history); a gone one is removed from the index. A publisher
that starts over is also a witness of its engine's restart, which the child
counts (control/restarts.py).

Replicas (control/kv_share.py): :meth:`KvPlane.snapshot` is what this
replica's index holds of the ranks it follows live; a late replica
:meth:`KvPlane.offer`\ s a sibling's before its engines start, and each rank
found there is loaded and continued from the sibling's seq instead of
replayed from the start.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import trio

from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.keys import index_key
from direct_frontend.kv.regroup import compatible
from direct_frontend.kv.snapshot import IndexSnapshot, RankKey, RankSnapshot
from direct_frontend.kv.subscriber import KvSubscription, run_kv_subscriber
from direct_frontend.observability.logging import log_once

if TYPE_CHECKING:
    from direct_frontend.control.child import EngineChild
    from direct_frontend.observability.metrics import Metrics

log = logging.getLogger("direct_frontend.kv")


def engine_page_size(file: int | None, discovered: int | None, ours: int) -> int:
    """An engine's KV page size: the fleet file's when set, else discovery's, else ours.

    The file wins because some engines report none or a misleading one
    (TensorRT-LLM reports none). A page size other than ours is fine when it
    divides ours or is a multiple of it: the index re-cuts such pages into its
    blocks (kv/regroup.py).
    """
    return file or discovered or ours


class KvPlane:
    def __init__(self, index: KvIndex, metrics: Metrics | None = None) -> None:
        self.index = index
        self.metrics = metrics
        self.subscriptions: dict[str, KvSubscription] = {}
        #: incarnations whose overlap comes from KV events (read by the kv_aware policy)
        self.live: set[int] = set()
        #: of those, incarnations whose predictions drifted (routing/hitrate.py fills it):
        #: routed by the approximate memory until their entries are rebuilt
        self.diverged: set[int] = set()
        self._fenced: set[int] = set()
        #: index key → the rank as every replica names it
        self.ranks: dict[str, RankKey] = {}
        #: a sibling's ranks, waiting for their engine's subscription to start
        self._warm: dict[RankKey, RankSnapshot] = {}
        self.warmed_ranks = 0  # ranks started from a sibling's snapshot
        self.warmed_blocks = 0

    async def run_for(self, child: EngineChild) -> None:
        """Follow ``child``'s KV events until cancelled; its entries go with it."""
        cfg = child.cfg
        if not cfg.kv_events:
            return
        ours = self.index.block_size
        page = engine_page_size(cfg.block_size, None, ours)
        if not compatible(page, ours):
            log.error(
                "engine %s: block_size %d neither divides nor is a multiple of the KV "
                "index's %d ([frontend.routing.knobs] block_size); its KV events are ignored",
                child.name, page, ours, extra={"engine": child.name},
            )
            return
        keys = [index_key(child.incarnation, rank) for rank in range(len(cfg.kv_events))]
        lag = self.metrics.kv_event_lag(child.name).observe if self.metrics is not None else None
        try:
            async with trio.open_nursery() as nursery:
                for rank, endpoint in enumerate(cfg.kv_events):
                    replay = cfg.kv_replay[rank] if cfg.kv_replay else None
                    self.ranks[keys[rank]] = (child.name, cfg.url, endpoint, rank)
                    subscription = await nursery.start(
                        functools.partial(
                            run_kv_subscriber, keys[rank], endpoint, replay, self.index, page,
                            on_malformed=functools.partial(self._malformed, child.name),
                            on_restart=functools.partial(self._restarted, child, rank),
                            on_lag=lag,
                            warm_next_seq=self._load_warm(keys[rank]),
                        )
                    )
                    self.subscriptions[keys[rank]] = subscription
                self.live.add(child.incarnation)
                child.engine_restarts.follows_publisher = True
                log.info("engine %s: following KV events on %s", child.name,
                         ", ".join(cfg.kv_events), extra={"engine": child.name})
        finally:
            self.live.discard(child.incarnation)
            self.diverged.discard(child.incarnation)
            child.engine_restarts.follows_publisher = False
            self._fenced.discard(child.incarnation)
            for key in keys:
                self.subscriptions.pop(key, None)
                self.ranks.pop(key, None)
                self.index.remove_engine(key)

    # -- replicas: snapshots ------------------------------------------------------

    def snapshot(self, replica: str) -> IndexSnapshot:
        """The ranks this index follows live, each with the seq it would apply next.

        Ranks replaying, idle or disconnected are left out: what they hold
        is not known to be whole. Synchronous, so entries and seqs agree.
        """
        ranks = []
        for key, subscription in self.subscriptions.items():
            tracker = subscription.tracker
            where = self.ranks.get(key)
            next_seq = tracker.next_seq
            if where is None or tracker.state != "live" or next_seq is None:
                continue
            if not subscription.connected:
                continue
            blocks, copies = self.index.export_engine(key)
            ranks.append(RankSnapshot.of(where, next_seq, blocks, copies))
        return IndexSnapshot(replica, self.index.block_size, ranks)

    def offer(self, snapshot: IndexSnapshot) -> str | None:
        """Keep a sibling's ranks for when their engines start; why it was refused, or None."""
        if snapshot.block_size != self.index.block_size:
            return (f"its KV block size {snapshot.block_size} differs from ours "
                    f"{self.index.block_size}")
        for rank in snapshot.ranks:
            self._warm[rank.key] = rank
        return None

    def _load_warm(self, key: str) -> int | None:
        """Load the sibling's entries for ``key``'s rank; the seq to continue from, or None."""
        where = self.ranks.get(key)
        rank = self._warm.pop(where, None) if where is not None else None
        if rank is None:
            return None
        try:
            loaded = self.index.import_engine(key, rank.blocks(), rank.copies)
        except ValueError as exc:
            log.warning("engine %s: a sibling's KV snapshot is malformed (%s); not used",
                        rank.engine, exc, extra={"engine": rank.engine})
            self.index.clear_engine(key)
            return None
        self.warmed_ranks += 1
        self.warmed_blocks += loaded
        log.info("engine %s rank %d: %d KV blocks from a sibling's snapshot, continuing "
                 "from seq %d", rank.engine, rank.rank, loaded, rank.next_seq,
                 extra={"engine": rank.engine})
        return rank.next_seq

    # -- fencing ------------------------------------------------------------------

    def fence(self, child: EngineChild, reason: str) -> None:
        """Drop what the index believes ``child`` holds (it went unhealthy)."""
        for rank in range(len(child.cfg.kv_events)):
            self.index.clear_engine(index_key(child.incarnation, rank))
        self._fenced.add(child.incarnation)
        if child.cfg.kv_events:
            log.info("engine %s: KV index entries cleared (%s)", child.name, reason,
                     extra={"engine": child.name})

    def _resync(self, child: EngineChild, reason: str) -> None:
        """Clear and rebuild from the engine's own history (replay from the start)."""
        self.diverged.discard(child.incarnation)  # judged afresh on the rebuilt entries
        for rank in range(len(child.cfg.kv_events)):
            subscription = self.subscriptions.get(index_key(child.incarnation, rank))
            if subscription is not None:
                subscription.resync()
        if child.cfg.kv_events:
            log.info("engine %s: KV index entries rebuilt (%s)", child.name, reason,
                     extra={"engine": child.name})

    def note_serving(self, child: EngineChild) -> None:
        """On (re)joining: rebuild after a fence or a restart, from the engine's history."""
        info = child.info
        ours = self.index.block_size
        page = engine_page_size(child.cfg.block_size, info.block_size if info else None, ours)
        if not compatible(page, ours):
            if child.incarnation in self.live:
                log.error(
                    "engine %s reports KV page size %d, which neither divides nor is a "
                    "multiple of the KV index's %d ([frontend.routing.knobs] block_size): "
                    "its KV events cannot match requests, so it is routed by the approximate "
                    "prefix memory instead (set block_size for it in the fleet file if the "
                    "report is wrong)",
                    child.name, page, ours, extra={"engine": child.name},
                )
            self.live.discard(child.incarnation)
            return
        if child.incarnation in self._fenced:
            self._fenced.discard(child.incarnation)
            self._resync(child, "the engine restarted" if child.restarted_at_join
                         else "the engine is back")
        elif child.restarted_at_join:
            self._resync(child, "the engine restarted")

    def routing_of(self, incarnation: int) -> str:
        """How KV-aware routing sees this incarnation, for ``/fleet``."""
        if incarnation in self.diverged:
            return "approximate (prediction diverged from the engine's reports)"
        return "events" if incarnation in self.live else "approximate"

    @staticmethod
    def _restarted(child: EngineChild, rank: int, key: str) -> None:
        """A rank's publisher started over (its subscriber has cleared and resynced it)."""
        child.publisher_restarted(rank)

    def _malformed(self, engine: str, key: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_malformed_events_total.labels(engine).inc()
        log_once(log, f"kv-malformed:{engine}",
                 "engine %s sent a malformed KV event (counted, skipped)", engine)

    def export(self) -> None:
        """Publish the index's size (called when metrics are scraped)."""
        if self.metrics is not None:
            stats = self.index.stats()
            self.metrics.kv_index_blocks.set(stats.blocks)
            self.metrics.kv_index_bytes.set(stats.bytes_estimate)
