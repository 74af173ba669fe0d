"""The Trio shell around one engine rank's KV-event sockets.

One :func:`run_kv_subscriber` task per ``(engine, rank)``: a SUB socket on the
engine's PUB, a fresh DEALER per replay request, and a monitor on the SUB so a
dropped connection (an engine restart) fences the index. All decisions are
the sans-IO :class:`~direct_frontend.kv.sequence.SequenceTracker`'s; this module
only moves bytes and carries out its actions.

ZMQ's FD is edge-like (docs/stack.md §6): every socket is read with ``NOBLOCK``
until ``zmq.Again``, ``zmq.EVENTS`` is asked before every wait, and the reader
yields every 64 messages so a flood cannot starve the other Trio tasks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Final

import trio
import zmq
import zmq.utils.monitor

from direct_frontend.kv.events import (
    KvDecodeError,
    decode_payload,
    encode_replay_request,
    parse_replay_reply,
    parse_seq,
)
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.regroup import compatible
from direct_frontend.kv.sequence import (
    Action,
    Apply,
    ClearEngine,
    ClearReason,
    RequestReplay,
    SequenceTracker,
)

__all__ = ["KvSubscription", "run_kv_subscriber"]

log = logging.getLogger(__name__)

_YIELD_EVERY: Final = 64
_RCVHWM: Final = 100_000  # the engines' own default hwm; a deeper queue means fewer gaps


@dataclasses.dataclass(eq=False)
class KvSubscription:
    """What a running subscriber exposes to its owner (``task_status.started`` value)."""

    engine_id: str
    endpoint: str
    replay_endpoint: str | None
    tracker: SequenceTracker[bytes]
    messages: int = 0
    replay_messages: int = 0
    malformed: int = 0
    #: times the publisher started over: it came back after its connection dropped, or its
    #: seq went back (one publisher process only ever counts up)
    publisher_restarts: int = 0
    connected: bool = False
    _resync: Callable[[], None] | None = dataclasses.field(default=None, repr=False)

    def resync(self) -> None:
        """Clear this engine's entries and rebuild them (replay from 0 if possible).

        For fencing the KV stream cannot see: a restart the gRPC side noticed
        (the start an engine reports changed, or it was rediscovered over a new
        connection). Call it from the Trio thread.
        """
        if self._resync is not None:
            self._resync()


async def _read(sock: zmq.Socket[bytes], on_message: Callable[[list[bytes]], bool]) -> None:
    """Hand every message of ``sock`` to ``on_message`` until it returns True.

    A callback rather than an async generator: a cancelled generator would be
    left for the garbage collector to finalise (docs/stack.md §3.1).
    """
    fd = sock.fileno()
    n = 0
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # ask before every wait
                await trio.lowlevel.wait_readable(fd)
            continue
        if on_message(frames):
            return
        n += 1
        if n % _YIELD_EVERY == 0:
            await trio.lowlevel.checkpoint()


def _close(sock: zmq.Socket[bytes]) -> None:
    if sock.closed:
        return
    trio.lowlevel.notify_closing(sock.fileno())
    sock.close(linger=0)


@dataclasses.dataclass(eq=False)
class _Shell:
    """The I/O state of one subscription; every method runs on the Trio thread."""

    sub: KvSubscription
    index: KvIndex
    context: zmq.Context[zmq.Socket[bytes]]
    nursery: trio.Nursery
    replay_timeout: float
    on_malformed: Callable[[str], None]
    on_clear: Callable[[str, ClearReason], None] | None
    on_restart: Callable[[str], None] | None
    on_lag: Callable[[float], None] | None
    replay_scope: trio.CancelScope | None = None
    logged_malformed: bool = False
    dropped: bool = False  # the SUB lost its connection and has not reconnected

    # -- actions -----------------------------------------------------------

    def run(self, actions: list[Action[bytes]], live: int = -1) -> None:
        """Carry out ``actions``; ``live`` is the seq of the live message that caused them.

        Only that message's own batch is live when applied; the others are
        replayed or were held back during a replay (catch-up, not lag).
        """
        for action in actions:
            if isinstance(action, Apply):
                self.apply(action.seq, action.item, action.seq == live)
            elif isinstance(action, ClearEngine):
                self.index.clear_engine(self.sub.engine_id)
                if action.reason not in ("start",):
                    log.info(
                        "kv index cleared for %s (%s)",
                        self.sub.engine_id,
                        action.reason,
                        extra={"engine": self.sub.engine_id, "reason": action.reason},
                    )
                if self.on_clear is not None:
                    self.on_clear(self.sub.engine_id, action.reason)
                if action.reason == "restart" and not self.dropped:
                    self.publisher_restarted()  # (after a drop, the reconnection counts it)
            elif isinstance(action, RequestReplay):
                self.request_replay(action.start_seq, action.attempt)
        if self.replay_scope is not None and self.sub.tracker.state != "replaying":
            # Abandoned (restart, disconnect, give-up) or done: free its DEALER now.
            self.replay_scope.cancel()
            self.replay_scope = None

    def apply(self, seq: int, payload: bytes, live: bool = False) -> None:
        try:
            batch = decode_payload(payload, seq=seq)
        except KvDecodeError as exc:
            self.malformed(str(exc))
            return
        if batch.malformed_events:
            self.malformed(f"{batch.malformed_events} malformed event(s) in batch {seq}")
        self.index.apply(self.sub.engine_id, batch)
        if live and self.on_lag is not None:
            lag = time.time() - batch.ts  # both wall clocks: skew between hosts is in it
            self.on_lag(lag if lag > 0.0 else 0.0)

    def publisher_restarted(self) -> None:
        self.sub.publisher_restarts += 1
        if self.on_restart is not None:
            self.on_restart(self.sub.engine_id)

    def malformed(self, reason: str) -> None:
        """Count it, log the first one loudly, never stop."""
        self.sub.malformed += 1
        self.on_malformed(self.sub.engine_id)
        level = logging.DEBUG if self.logged_malformed else logging.WARNING
        self.logged_malformed = True
        log.log(
            level,
            "malformed KV event message from %s: %s",
            self.sub.engine_id,
            reason,
            extra={"engine": self.sub.engine_id},
        )

    def request_replay(self, start: int, attempt: int) -> None:
        if self.replay_scope is not None:
            self.replay_scope.cancel()  # its task closes its own DEALER
        scope = trio.CancelScope()
        self.replay_scope = scope
        self.nursery.start_soon(self.replay, scope, start, attempt)

    # -- readers -----------------------------------------------------------

    async def live(self, sock: zmq.Socket[bytes]) -> None:
        await _read(sock, self.on_live)

    def on_live(self, frames: list[bytes]) -> bool:
        self.sub.messages += 1
        if len(frames) != 3:
            self.malformed(f"{len(frames)} frames, expected 3")
            return False
        try:
            seq = parse_seq(frames[1])
        except KvDecodeError as exc:
            self.malformed(str(exc))
            return False
        self.run(self.sub.tracker.on_live(seq, frames[2]), seq)
        return False

    async def replay(self, scope: trio.CancelScope, start: int, attempt: int) -> None:
        """One replay attempt on a fresh DEALER, so no stale reply can reach the next one."""
        assert self.sub.replay_endpoint is not None
        tracker = self.sub.tracker
        with scope:
            sock = self.context.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)  # a whole ring buffer may come back at once
                sock.connect(self.sub.replay_endpoint)
                sock.send_multipart(encode_replay_request(start))
                deadline = trio.CancelScope(deadline=trio.current_time() + self.replay_timeout)

                def on_reply(frames: list[bytes]) -> bool:
                    deadline.deadline = trio.current_time() + self.replay_timeout  # inactivity
                    try:
                        reply = parse_replay_reply(frames)
                    except KvDecodeError as exc:
                        self.malformed(f"replay reply: {exc}")
                        return False
                    if reply.is_end:
                        self.run(tracker.on_replay_end(attempt))
                        return True
                    self.sub.replay_messages += 1
                    self.run(tracker.on_replay(attempt, reply.seq, reply.payload))
                    return False

                with deadline:
                    await _read(sock, on_reply)
                if deadline.cancelled_caught:
                    log.warning(
                        "KV replay from %s timed out (attempt %d)",
                        self.sub.replay_endpoint,
                        attempt,
                        extra={"engine": self.sub.engine_id},
                    )
                    self.run(tracker.on_replay_timeout(attempt))
            finally:
                _close(sock)
                if self.replay_scope is scope:
                    self.replay_scope = None

    async def monitor(self, sock: zmq.Socket[bytes]) -> None:
        await _read(sock, self.on_monitor)

    def on_monitor(self, frames: list[bytes]) -> bool:
        """Connection events of the SUB: a drop clears, a reconnect resubscribes.

        A PUB's connection drops only when its process closes it, so one that
        comes back is a new publisher: a restart, whatever its seq says.
        """
        event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            self.sub.connected = True
            if self.dropped:
                self.dropped = False
                self.publisher_restarted()
                self.run(self.sub.tracker.start())
        elif event == zmq.EVENT_DISCONNECTED:
            self.sub.connected = False
            if not self.dropped:
                self.dropped = True
                log.info(
                    "KV event connection to %s dropped",
                    self.sub.endpoint,
                    extra={"engine": self.sub.engine_id},
                )
                self.run(self.sub.tracker.on_disconnected())
        return False


async def run_kv_subscriber(
    engine_id: str,
    endpoint: str,
    replay_endpoint: str | None,
    index: KvIndex,
    block_size: int,
    *,
    on_malformed: Callable[[str], None],
    on_clear: Callable[[str, ClearReason], None] | None = None,
    on_restart: Callable[[str], None] | None = None,
    on_lag: Callable[[float], None] | None = None,
    topic: bytes = b"",
    replay_timeout: float = 5.0,
    max_buffer: int = 100_000,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    warm_next_seq: int | None = None,
    task_status: trio.TaskStatus[KvSubscription] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``index`` in step with one engine rank's KV events until cancelled.

    ``endpoint`` is the rank's PUB (``tcp://host:port``, already offset by the
    rank), ``replay_endpoint`` its ROUTER or None. ``engine_id`` is the index
    key; use a distinct one per rank. ``block_size`` is the rank's page size: the
    index's, or one it can re-cut (kv/regroup.py).
    Malformed messages are reported through ``on_malformed(engine_id)`` and
    skipped; every index clear through ``on_clear(engine_id, reason)``; each time
    the publisher starts over (a new process) through ``on_restart(engine_id)``.
    ``on_lag(seconds)`` gets, for each live batch, how long after the engine
    stamped it the index held it (wall clocks, at least 0): how stale the
    index is. Batches a replay brings, or held back while one ran, are not
    reported: they measure catching up after a gap, which the gap's clear or
    replay already tells.
    Returns only by cancellation; the engine's entries stay in the index (call
    ``index.clear_engine`` or ``remove_engine`` when fencing it). With
    ``warm_next_seq`` the index already holds a sibling's entries for
    ``engine_id`` up to that seq: they are kept and only what follows is
    fetched (:meth:`SequenceTracker.warm`).
    """
    if not compatible(block_size, index.block_size):
        raise ValueError(
            f"page size {block_size} of {engine_id} cannot be re-cut into the index's "
            f"blocks of {index.block_size}"
        )
    if not math.isfinite(replay_timeout) or replay_timeout <= 0:
        raise ValueError("replay_timeout must be a positive number of seconds")
    ctx = context if context is not None else zmq.Context.instance()
    tracker: SequenceTracker[bytes] = SequenceTracker(
        replay=replay_endpoint is not None, max_buffer=max_buffer
    )
    subscription = KvSubscription(engine_id, endpoint, replay_endpoint, tracker)
    sub = ctx.socket(zmq.SUB)
    monitor: zmq.Socket[bytes] | None = None
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, _RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint)
        async with trio.open_nursery() as nursery:
            shell = _Shell(
                subscription, index, ctx, nursery, replay_timeout, on_malformed, on_clear,
                on_restart, on_lag,
            )
            subscription._resync = lambda: shell.run(tracker.start())
            nursery.start_soon(shell.monitor, monitor)
            nursery.start_soon(shell.live, sub)
            shell.run(tracker.start() if warm_next_seq is None
                      else tracker.warm(warm_next_seq))
            task_status.started(subscription)
    finally:
        subscription._resync = None
        if monitor is not None:
            sub.disable_monitor()
            _close(monitor)
        _close(sub)
