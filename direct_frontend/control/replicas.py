"""The replica link: several daemons in front of one fleet, routing as one, over NATS.

Each replica still follows every engine itself (probes, KV events); over
NATS it tells its siblings only what nobody else can know
(control/replica_wire.py): its in-flight requests and blocks per engine (the
load term of the routing cost, routing/peers.py), the approximate-mode
placements it makes, and the transport faults its requests see, which every
sibling acts on at once. A replica that starts late asks one sibling (a
queue group picks it) for its KV index before its engines start
(control/kv_share.py). A stored response (the Responses API) stays
with the replica that answered it; a sibling asks that replica for it
(control/response_rpc.py), over this link.

nats-py is asyncio; like the engines' gRPC channels (engines/transport.py)
it runs on the trio-asyncio loop, every call through ``aio_as_trio``, and
its message callbacks only hand messages to a Trio channel, so every
decision is taken in a Trio task. Nothing a request does ever waits on
NATS: the data plane only appends to in-memory outboxes, and a link that is
down (degraded: ``/fleet`` and ``direct_frontend_replica_degraded`` say so)
means routing on local state alone until it is back, when the next report
resyncs everyone.
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # before nats and grpclib, see cli.py

# isort: split
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from direct_frontend.control.kv_share import KvShare
from direct_frontend.control.nats_session import (
    RECONNECT_WAIT_S,
    NatsSession,
    close_client,
)
from direct_frontend.control.replica_wire import (
    FaultReport,
    LoadReport,
    Placements,
    Subjects,
    decode,
    encode,
)
from direct_frontend.control.response_rpc import ResponseRpc
from direct_frontend.errors import EngineError
from direct_frontend.fleet.bus import nats_auth_summary
from direct_frontend.fleet.describe import JsonValue
from direct_frontend.fleet.schema import ReplicasConfig
from direct_frontend.openai.response_store import ResponseStore
from direct_frontend.routing.catalog import EngineHandle
from direct_frontend.routing.peers import (
    Loads,
    PeerLoads,
    PlacementShare,
    apply_peer_loads,
    local_loads,
)

if TYPE_CHECKING:
    from direct_frontend.control.kv_plane import KvPlane
    from direct_frontend.control.supervisor import Supervisor

log = logging.getLogger("direct_frontend.replicas")

GOODBYE_TIMEOUT_S = 1.0
#: faults kept while the link is down (they are only news for a short while)
MAX_PENDING_FAULTS = 64

Inbound = tuple[str, bytes, str]  # subject, data, reply subject
#: what siblings tell each other on the link's own subjects
_Word = TypeVar("_Word", LoadReport, FaultReport, Placements)


class LinkNews:
    """What wakes the link before its next tick: news to send at once (a placement, a
    fault, a sibling heard anew) or a change of this replica's load.

    Built before the supervisor and the placement share, which are told to call
    :meth:`load_changed` and :meth:`urgent`, and before the link that waits on it.
    """

    def __init__(self) -> None:
        self._wake = trio.Event()
        self._urgent = False  # news to send at once
        self._change_pending = False  # a change of load woke the link; its report is not out yet

    def urgent(self) -> None:
        self._urgent = True
        self._wake.set()

    def load_changed(self) -> None:
        if not self._change_pending:  # one wake per report, however many changes it carries
            self._change_pending = True
            self._wake.set()

    async def heard(self, deadline: float) -> bool:
        """Until news or ``deadline`` (Trio's clock); True: news woke us."""
        with trio.move_on_at(deadline):
            await self._wake.wait()
        if not self._wake.is_set():
            return False
        self._wake = trio.Event()
        return True

    def take_urgent(self) -> bool:
        """Whether news to send at once came since the last call."""
        urgent, self._urgent = self._urgent, False
        return urgent

    def take_change(self) -> bool:
        """Whether a change of load came since the last call (the report now carries it)."""
        change, self._change_pending = self._change_pending, False
        return change


class ReplicaLink:
    """One replica's side of the link; :meth:`run` owns the NATS connection.

    ``news`` is the one ``supervisor`` and ``placements`` were built to wake.
    """

    def __init__(
        self,
        config: ReplicasConfig,
        supervisor: Supervisor,
        placements: PlacementShare,
        news: LinkNews,
        *,
        kv: KvPlane | None = None,
        replica_id: str | None = None,
        responses: ResponseStore | None = None,
    ) -> None:
        self.config = config
        self.supervisor = supervisor
        self.placements = placements
        self.news = news
        self.subjects = Subjects(config.cluster)
        self.replica = replica_id or (
            f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        #: shares ``kv``'s index with a sibling that starts late, and warms it from one
        self.kv_share = None if kv is None else KvShare(self, kv, config.snapshot_timeout_s)
        #: asks siblings for the stored responses they hold (``responses``' remote stores,
        #: given to it by the daemon), and answers for ``responses``
        self.stored = None if responses is None else ResponseRpc(self, responses)
        self.session = NatsSession(config, self.replica, lost=self._disconnected,
                                   back=self._reconnected)
        self.peers = PeerLoads(config.peer_timeout_s)
        self.connected = False
        self.warm = "not asked"  # how the KV index started: from whom, or why not
        self.counts = {"received": 0, "malformed": 0, "faults_shared": 0,
                       "faults_acted_on": 0, "snapshots_served": 0, "outages": 0,
                       "responses_served": 0, "responses_fetched": 0,
                       "response_fetches_failed": 0}
        self._nc: Any = None
        self._faults: list[FaultReport] = []
        #: what was placed while the link was down, sent again to each sibling heard anew
        #: until ``_backlog_until`` (NATS keeps nothing for a sibling not yet back)
        self._backlog: list[tuple[str, tuple[int, ...]]] = []
        self._backlog_until = -math.inf
        self._tx, self._rx = trio.open_memory_channel[Inbound](math.inf)
        #: more subjects, each with what hears its messages (:meth:`listen`)
        self._listeners: dict[str, Callable[[bytes], None]] = {}
        self._seq = 0
        self._last_sent: Loads | None = None
        self._last_sent_at = -math.inf
        self._last_change_sent_at = -math.inf  # a report that a change of load woke
        supervisor.fault_listeners.append(self._on_fault)

    # -- the view ---------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """The link is down: routing uses this replica's own state only."""
        return not self.connected

    @property
    def refusal(self) -> str | None:
        """Why this replica does not share over the server it reached (None: it does)."""
        return self.session.refusal

    @property
    def connection(self) -> Any:
        """The NATS client while the link shares over it; None while it is down."""
        return self._nc if self.connected else None

    def status(self) -> JsonValue:
        """The ``replicas`` part of ``GET /fleet``."""
        return {
            "replica": self.replica,
            "nats": self.session.shown,
            "cluster": self.config.cluster,
            "auth": nats_auth_summary(self.config),
            "connected": self.connected,
            "refused": self.refusal,
            "degraded": self.degraded,
            "peers": list(self.peers.replicas),
            "kv_warm_start": self.warm,
            "counts": dict(self.counts),
        }

    # -- data-plane hooks (synchronous: never wait on NATS) ------------------------------

    def _on_fault(self, engine: EngineHandle, error: EngineError) -> None:
        if len(self._faults) < MAX_PENDING_FAULTS:
            self._faults.append(FaultReport.of(self.replica, engine.name, engine.url, error))
            self.news.urgent()

    # -- the task -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, warm the KV index from a sibling, then share until cancelled.

        Started before the engines, so a sibling's snapshot is in place when
        their KV subscriptions start. NATS down at start costs one connect
        timeout; the link keeps trying in the background. A server this
        replica will not share over (:func:`~direct_frontend.control.bus.server_problem`),
        or one that refuses its credentials, stops the start with
        :class:`~direct_frontend.control.bus.NatsRefused`; met later, it is
        logged and the link stays degraded.
        """
        self.session.read_secrets(os.environ)
        try:
            connected = await self._connect(at_start=True)  # a refusal ends it here
            async with trio.open_nursery() as nursery:
                if connected:
                    self.warm = "no KV index" if self.kv_share is None else (
                        await self.kv_share.warm_start(self._nc))
                    await self._subscribe()
                else:
                    self.warm = "NATS unreachable at start"
                    nursery.start_soon(self._connect_later)
                task_status.started()
                nursery.start_soon(self._receive_loop)
                await self._publish_loop()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(GOODBYE_TIMEOUT_S):
                await self._goodbye()

    async def _connect(self, *, at_start: bool = False) -> bool:
        """One connect attempt: True once connected (sharing, or degraded on a server it
        will not use until it changes), False if not (said why)."""
        reached = await self.session.connect(at_start=at_start)
        if reached is None:
            return False
        self._nc, self.connected = reached
        if self.connected:
            log.info("replicas: replica %s sharing over %s (cluster %s)", self.replica,
                     self.session.shown, self.config.cluster)
        return True

    async def _disconnected(self) -> None:
        if self.connected:
            self.counts["outages"] += 1
            log.warning("replicas: lost NATS at %s; routing on local state until it "
                        "is back", self.session.shown)
        self.connected = False
        self.peers.clear()  # their word is stale from now on
        self._apply_peers()

    async def _reconnected(self) -> None:
        self.connected = True
        self._last_sent = None  # resync: everyone hears our whole state at once
        self._keep_backlog()
        log.info("replicas: NATS at %s is back", self.session.shown)

    async def _connect_later(self) -> None:
        connected = False
        while not connected:
            await trio.sleep(RECONNECT_WAIT_S * 4)  # a retry cadence, not a wait for an event
            connected = await self._connect()
        await self._subscribe()
        self._keep_backlog()

    def _keep_backlog(self) -> None:
        """The link is back: what was placed meanwhile goes out now, to the siblings already
        back, and again to each one heard anew within a peer timeout (a sibling heard
        later has been away longer than its word is kept)."""
        self._backlog = self.placements.pending()
        self._backlog_until = time.monotonic() + self.config.peer_timeout_s

    async def _subscribe(self) -> None:
        nc = self._nc
        tx = self._tx

        async def deliver(msg: Any) -> None:  # asyncio side: hand over, decide nothing
            tx.send_nowait((msg.subject, msg.data, msg.reply))

        subscribe = trio_asyncio.aio_as_trio(nc.subscribe)
        for subject in (self.subjects.load, self.subjects.fault, self.subjects.placements,
                        *self._listeners):
            await subscribe(subject, cb=deliver)
        if self.kv_share is not None:
            # a queue group: one sibling answers each late replica
            await subscribe(self.subjects.snapshot, queue="kv-snapshot", cb=deliver)
        if self.stored is not None:
            await subscribe(self.stored.subject, cb=deliver)

    def listen(self, subject: str, hear: Callable[[bytes], None]) -> None:
        """Hand every message on ``subject`` to ``hear``; said before :meth:`run`, which
        subscribes to it (control/rate_share.py's subject)."""
        self._listeners[subject] = hear

    async def publish(self, subject: str, data: bytes) -> bool:
        """Send ``data`` on ``subject``; False if the link is down or the send failed."""
        return await self._publish(subject, data)

    async def _publish(self, subject: str, data: bytes) -> bool:
        if self._nc is None or not self.connected:
            return False
        try:
            await trio_asyncio.aio_as_trio(self._nc.publish)(subject, data)
        except Exception as exc:  # never let the link fail the daemon
            log.debug("replicas: publish on %s failed: %s", subject, exc)
            return False
        return True

    # -- sending --------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        heartbeat = self.config.peer_timeout_s / 3
        while True:
            now = time.monotonic()
            if self.news.take_change():  # this round's report carries every change so far
                self._last_change_sent_at = trio.current_time()
            if now > self._backlog_until:
                self._backlog = []
            if self.peers.expire(now):
                self._apply_peers()
            else:  # the catalog may hold new handles: keep their peer counters current
                apply_peer_loads(self.supervisor.catalog.engines, self.peers.totals())
            loads = local_loads(self.supervisor.catalog.engines)
            due = loads != self._last_sent or now - self._last_sent_at > heartbeat
            if self.connected and due:
                self._seq += 1
                if await self._publish(self.subjects.load,
                                       encode(LoadReport.of(self.replica, self._seq, loads))):
                    self._last_sent, self._last_sent_at = loads, now
            faults, self._faults = self._faults, []
            for fault in faults:
                if await self._publish(self.subjects.fault, encode(fault)):
                    self.counts["faults_shared"] += 1
            placed = self.placements.take() if self.connected else []
            if placed and not await self._publish(
                    self.subjects.placements, encode(Placements.of(self.replica, placed))):
                self.placements.put_back(placed)  # sent when the link is back
            await self._news()

    async def _news(self) -> None:
        """Until there is something to send, or the next tick.

        A placement or a fault goes at once. A change of our load goes at once
        too unless the last one went less than ``publish_interval_s`` ago, else
        at that mark: a sibling placing a request a few milliseconds after ours
        must already count it (else both send new prompts to the same idle
        engine), yet a busy replica sends no more than one report
        per interval.

        Times are Trio's clock and the waits end at a deadline, never after a
        duration: news that wakes the link as its tick passes leaves the tick
        behind us, and a wait until then ends at once.
        """
        interval = self.config.publish_interval_s
        tick = trio.current_time() + interval
        while True:
            if not await self.news.heard(tick):
                return  # the tick
            if self.news.take_urgent():
                await trio.lowlevel.checkpoint()  # the request that placed it books its load
                return
            now = trio.current_time()
            mark = self._last_change_sent_at + interval
            if now >= mark:
                return
            tick = min(tick, mark)

    async def _goodbye(self) -> None:
        nc, self._nc = self._nc, None
        if nc is None:
            return
        if self.connected:
            self._seq += 1
            report = LoadReport.of(self.replica, self._seq, {}, leaving=True)
            try:
                await trio_asyncio.aio_as_trio(nc.publish)(self.subjects.load, encode(report))
                await trio_asyncio.aio_as_trio(nc.flush)(0.5)
            except Exception as exc:
                log.debug("replicas: goodbye not sent: %s", exc)
        self.connected = False
        await close_client(nc)

    # -- receiving ----------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        heard = {  # a sibling's word, each read and acted on at once
            self.subjects.load: self._hear(LoadReport, "load", self._on_load),
            self.subjects.fault: self._hear(FaultReport, "fault", self._on_peer_fault),
            self.subjects.placements: self._hear(Placements, "placements", self._on_placements),
            **self._listeners,
        }
        async for subject, data, reply in self._rx:
            if not self.connected:  # a server this replica refuses: nobody there is a sibling
                continue
            self.counts["received"] += 1
            if (hear := heard.get(subject)) is not None:
                hear(data)
            elif self.kv_share is not None and subject == self.subjects.snapshot:
                await self.kv_share.serve(data, reply)
            elif self.stored is not None and subject == self.stored.subject:
                await self.stored.serve(data, reply)

    def _hear(self, kind: type[_Word], what: str,
              act: Callable[[_Word], None]) -> Callable[[bytes], None]:
        """What reads a sibling's ``kind`` of message: skipped if malformed or our own."""
        def hear(data: bytes) -> None:
            message = decode(kind, data)
            if message is None:
                self.malformed(what)
            elif message.replica != self.replica:
                act(message)

        return hear

    def malformed(self, what: str) -> None:
        """A message from a sibling that could not be read: counted, skipped."""
        self.counts["malformed"] += 1
        log.debug("replicas: a malformed %s message (skipped)", what)

    def _on_load(self, report: LoadReport) -> None:
        if report.leaving:
            self.peers.leave(report.replica)
        else:
            newcomer = report.replica not in self.peers
            self.peers.update(report.replica, report.seq, report.unpacked(), time.monotonic())
            if newcomer:  # it knows nothing of our load yet: tell it now, not at the heartbeat
                self._last_sent = None
                if self._backlog and time.monotonic() < self._backlog_until:
                    self.placements.put_back(self._backlog)  # nor of what we placed offline
                self.news.urgent()
        self._apply_peers()

    def _apply_peers(self) -> None:
        apply_peer_loads(self.supervisor.catalog.engines, self.peers.totals())

    def _on_peer_fault(self, report: FaultReport) -> None:
        error = report.error()
        if error is not None and self.supervisor.report_peer_fault(report.engine, report.url,
                                                                   error):
            self.counts["faults_acted_on"] += 1
            log.info("engine %s: out of rotation, replica %s saw it fail (%s)", report.engine,
                     report.replica, report.message, extra={"engine": report.engine})

    def _on_placements(self, message: Placements) -> None:
        now = time.monotonic()
        for engine, hashes in message.each():
            self.placements.from_peer(engine, hashes, now)
