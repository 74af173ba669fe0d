"""Sequence tracking and replay fencing for one KV-event publisher (sans-IO).

One :class:`SequenceTracker` per ``(engine, rank)``. The I/O shell feeds it what
arrives (live messages, replay replies, the end marker, timeouts, a lost
connection) and carries out the actions it returns, in order:

- :class:`Apply` — decode the item and apply it to the index;
- :class:`RequestReplay` — ask the replay endpoint for every batch from
  ``start_seq`` on (replies of older attempts must be discarded);
- :class:`ClearEngine` — drop everything the index holds for this publisher.

The rules are docs/kv-events.md §8: apply in order; on a gap, buffer live messages
and replay (or clear and restart from the message when there is no replay
endpoint); merge replayed and buffered batches by seq, dropping duplicates; a
first replayed seq above the one asked for, or an end marker that leaves a gap
before batches that were already published when we asked, means the history is
lost: clear and continue. A live seq that does not exceed the last live seq
means the publisher restarted: clear and resync. A replay timeout means
"unknown", so it is retried before we give up and clear.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, Literal, TypeAlias, TypeVar

__all__ = [
    "Action",
    "Apply",
    "ClearEngine",
    "ClearReason",
    "RequestReplay",
    "SequenceStats",
    "SequenceTracker",
]

T = TypeVar("T")

ClearReason = Literal[
    "start",  # (re)subscribing: whatever we held may be stale
    "gap",  # a gap and no replay endpoint
    "history_lost",  # the replay buffer no longer holds what we missed
    "restart",  # the publisher's seq went back: a new process
    "replay_failed",  # replay timed out repeatedly, or the live buffer overflowed
    "disconnected",  # the connection to the publisher dropped
]


@dataclasses.dataclass(frozen=True, slots=True)
class Apply(Generic[T]):
    """Apply this batch to the index now."""

    seq: int
    item: T


@dataclasses.dataclass(frozen=True, slots=True)
class RequestReplay:
    """Ask for every buffered batch with ``seq >= start_seq``; tag replies with ``attempt``."""

    start_seq: int
    attempt: int


@dataclasses.dataclass(frozen=True, slots=True)
class ClearEngine:
    """Forget every index entry of this publisher."""

    reason: ClearReason


Action: TypeAlias = Apply[T] | RequestReplay | ClearEngine


@dataclasses.dataclass(slots=True)
class SequenceStats:
    """Counters for metrics and tests."""

    applied: int = 0
    gaps: int = 0
    replays_requested: int = 0
    replay_timeouts: int = 0
    replay_failures: int = 0
    history_lost: int = 0
    restarts: int = 0
    duplicates: int = 0
    stale_replies: int = 0
    buffer_overflows: int = 0
    clears: int = 0


_State = Literal["idle", "live", "replaying"]


class SequenceTracker(Generic[T]):
    """The in-order / gap / replay / restart state machine of one publisher.

    ``replay`` says whether a replay endpoint exists. ``max_buffer`` bounds the
    live messages held during a replay; past it the replay is abandoned (clear,
    then continue from the buffered messages). ``max_replay_attempts`` is how
    many timeouts in a row one gap may cost before we give up.
    """

    def __init__(
        self, *, replay: bool, max_buffer: int = 100_000, max_replay_attempts: int = 3
    ) -> None:
        if max_buffer < 1 or max_replay_attempts < 1:
            raise ValueError("max_buffer and max_replay_attempts must be at least 1")
        self.replay = replay
        self.max_buffer = max_buffer
        self.max_replay_attempts = max_replay_attempts
        self.stats = SequenceStats()
        self._state: _State = "idle"
        self._next = 0
        self._last_live: int | None = None
        self._buffer: list[tuple[int, T]] = []
        self._covered = 0  # leading buffered messages published before the replay request
        self._attempt = 0
        self._tries = 0
        self._anchor_freely = False  # after giving up: take the next live seq as it comes

    # -- observation -------------------------------------------------------

    @property
    def state(self) -> _State:
        """``idle`` (no position yet), ``live`` or ``replaying``."""
        return self._state

    @property
    def next_seq(self) -> int | None:
        """The seq we expect to apply next (None while idle)."""
        return None if self._state == "idle" else self._next

    @property
    def attempt(self) -> int:
        """The current replay attempt; replies tagged with another one are stale."""
        return self._attempt

    @property
    def buffered(self) -> int:
        """Live messages held back while a replay runs."""
        return len(self._buffer)

    # -- inputs ------------------------------------------------------------

    def start(self) -> list[Action[T]]:
        """(Re)subscribe: clear, then replay the publisher's whole buffer if we can.

        Replaying from 0 at once matters for an idle engine with a warm cache:
        no live message would ever tell us what it holds.
        """
        self._last_live = None
        self._buffer.clear()
        self._anchor_freely = False
        actions: list[Action[T]] = [self._clear("start")]
        if self.replay:
            actions.append(self._request(0))
        else:
            self._state = "idle"
        return actions

    def warm(self, next_seq: int) -> list[Action[T]]:
        """Continue from a sibling's snapshot, already loaded, that applied up to ``next_seq - 1``.

        Nothing is cleared. The gap since the snapshot is replayed from
        ``next_seq`` (or, without replay, the next live seq must be exactly
        ``next_seq``), so the usual fencing refuses a stale snapshot: a replay
        that starts later is lost history, and a live seq at or below the
        snapshot's last is a publisher that restarted since.
        """
        self._buffer.clear()
        self._anchor_freely = False
        self._last_live = next_seq - 1 if next_seq > 0 else None
        if self.replay:
            return [self._request(next_seq)]
        self._state = "live"
        self._next = next_seq
        return []

    def on_disconnected(self) -> list[Action[T]]:
        """The connection dropped: the engine may be gone with its cache; clear.

        Nothing is requested now (the engine may be down); the next live
        message triggers a replay from 0, which also covers a restart whose
        seq went past ours while we were away.
        """
        self._buffer.clear()
        self._state = "idle"
        self._anchor_freely = False
        self._attempt += 1  # replies of a replay in flight are now stale
        return [self._clear("disconnected")]

    def on_live(self, seq: int, item: T) -> list[Action[T]]:
        """A message from the SUB socket."""
        actions: list[Action[T]] = []
        last = self._last_live
        self._last_live = seq
        if last is not None and seq <= last:
            # One process publishes strictly increasing seqs: this is a new one.
            self.stats.restarts += 1
            self._buffer.clear()
            self._state = "idle"
            self._anchor_freely = False
            self._attempt += 1
            actions.append(self._clear("restart"))
        if self._state == "replaying":
            self._buffer.append((seq, item))
            if len(self._buffer) > self.max_buffer:
                self.stats.buffer_overflows += 1
                actions.extend(self._give_up())
            return actions
        self._accept(seq, item, actions)
        return actions

    def on_replay(self, attempt: int, seq: int, item: T) -> list[Action[T]]:
        """One replayed batch (not the end marker)."""
        if attempt != self._attempt or self._state != "replaying":
            self.stats.stale_replies += 1
            return []
        self._tries = 0  # progress: the endpoint answers
        if seq < self._next:
            self.stats.duplicates += 1
            return []
        actions: list[Action[T]] = []
        if seq > self._next:
            # The ring buffer moved past what we asked for.
            self.stats.history_lost += 1
            actions.append(self._clear("history_lost"))
        self._apply(seq, item, actions)
        return actions

    def on_replay_end(self, attempt: int) -> list[Action[T]]:
        """The end marker: merge the buffered live messages and go live."""
        if attempt != self._attempt or self._state != "replaying":
            self.stats.stale_replies += 1
            return []
        self._tries = 0
        self._state = "live"
        buffered, covered = self._buffer, self._covered
        self._buffer = []
        self._covered = 0
        actions: list[Action[T]] = []
        for i, (seq, item) in enumerate(buffered):
            if self._replaying():  # a new gap below asked for another replay
                self._buffer.append((seq, item))
                continue
            if i < covered and seq > self._next:
                # Published before we asked, yet not replayed: that history is gone.
                self.stats.history_lost += 1
                actions.append(self._clear("history_lost"))
                self._apply(seq, item, actions)
            else:
                self._accept(seq, item, actions)
        if self._replaying():
            self._covered = len(self._buffer)  # all of them were in before the new request
        return actions

    def on_replay_timeout(self, attempt: int) -> list[Action[T]]:
        """No reply for a while. Unknown, not lost: retry, then give up and clear."""
        if attempt != self._attempt or self._state != "replaying":
            return []
        self.stats.replay_timeouts += 1
        self._tries += 1
        if self._tries < self.max_replay_attempts:
            covered = len(self._buffer)
            request = self._request(self._next)
            self._covered = covered
            return [request]
        return self._give_up()

    # -- internals ---------------------------------------------------------

    def _accept(self, seq: int, item: T, actions: list[Action[T]]) -> None:
        """A live message outside a replay (or merged after one)."""
        if self._state == "idle":
            if self.replay and seq != 0 and not self._anchor_freely:
                # We do not know what came before: fetch it.
                self._buffer.append((seq, item))
                actions.append(self._request(0))
                self._covered = 1
                return
            self._anchor_freely = False
            self._apply(seq, item, actions)
            return
        if seq < self._next:
            self.stats.duplicates += 1  # e.g. a live copy of a batch replay delivered
            return
        if seq == self._next:
            self._apply(seq, item, actions)
            return
        self.stats.gaps += 1
        if self.replay:
            self._buffer.append((seq, item))
            actions.append(self._request(self._next))
            self._covered = 1
            return
        actions.append(self._clear("gap"))
        self._apply(seq, item, actions)

    def _apply(self, seq: int, item: T, actions: list[Action[T]]) -> None:
        self._next = seq + 1
        if self._state == "idle":
            self._state = "live"
        self.stats.applied += 1
        actions.append(Apply(seq, item))

    def _request(self, start: int) -> RequestReplay:
        self._attempt += 1
        self._state = "replaying"
        self._next = start
        self._covered = 0
        self.stats.replays_requested += 1
        return RequestReplay(start, self._attempt)

    def _give_up(self) -> list[Action[T]]:
        """Abandon the replay: clear, then continue from the buffered live messages."""
        self.stats.replay_failures += 1
        self._tries = 0
        self._attempt += 1
        self._state = "idle"
        self._anchor_freely = True
        buffered = self._buffer
        self._buffer = []
        self._covered = 0
        actions: list[Action[T]] = [self._clear("replay_failed")]
        for seq, item in buffered:
            if self._replaying():
                self._buffer.append((seq, item))
            else:
                self._accept(seq, item, actions)
        if self._replaying():
            self._covered = len(self._buffer)
        return actions

    def _replaying(self) -> bool:
        # A method, not an inline comparison: _accept may change the state mid-loop.
        return self._state == "replaying"

    def _clear(self, reason: ClearReason) -> ClearEngine:
        self.stats.clears += 1
        return ClearEngine(reason)
