"""The sans-IO sequence tracker: in order, gaps, replay merging, history loss, restarts."""

from __future__ import annotations

from direct_frontend.kv.sequence import (
    Action,
    Apply,
    ClearEngine,
    RequestReplay,
    SequenceTracker,
)


def applied(actions: list[Action[str]]) -> list[int]:
    return [a.seq for a in actions if isinstance(a, Apply)]


def clears(actions: list[Action[str]]) -> list[str]:
    return [a.reason for a in actions if isinstance(a, ClearEngine)]


def replay_of(actions: list[Action[str]]) -> RequestReplay:
    (request,) = [a for a in actions if isinstance(a, RequestReplay)]
    return request


def live(tracker: SequenceTracker[str], *seqs: int) -> list[Action[str]]:
    out: list[Action[str]] = []
    for seq in seqs:
        out += tracker.on_live(seq, f"b{seq}")
    return out


def replayed(tracker: SequenceTracker[str], attempt: int, *seqs: int) -> list[Action[str]]:
    out: list[Action[str]] = []
    for seq in seqs:
        out += tracker.on_replay(attempt, seq, f"r{seq}")
    return out


def synced(start_next: int = 0) -> tuple[SequenceTracker[str], int]:
    """A replay-capable tracker past its start-up replay (empty history), live at 0."""
    tracker: SequenceTracker[str] = SequenceTracker(replay=True)
    actions = tracker.start()
    assert clears(actions) == ["start"]
    request = replay_of(actions)
    assert request.start_seq == 0
    assert tracker.on_replay_end(request.attempt) == []
    assert tracker.state == "live" and tracker.next_seq == 0
    return tracker, request.attempt


def test_in_order_batches_apply_in_order() -> None:
    tracker, _ = synced()
    actions = live(tracker, 0, 1, 2, 3)
    assert actions == [Apply(i, f"b{i}") for i in range(4)]
    assert tracker.next_seq == 4 and tracker.stats.gaps == 0


def test_startup_replays_the_whole_history_then_merges_live() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=True)
    request = replay_of(tracker.start())
    assert (request.start_seq, tracker.state) == (0, "replaying")
    assert live(tracker, 5, 6) == []  # buffered while replaying
    assert applied(replayed(tracker, request.attempt, 0, 1, 2, 3, 4, 5)) == [0, 1, 2, 3, 4, 5]
    end = tracker.on_replay_end(request.attempt)
    assert end == [Apply(6, "b6")]  # live 5 was a duplicate of replayed 5
    assert tracker.stats.duplicates == 1 and tracker.state == "live"


def test_gap_requests_replay_from_next_and_merges_in_order() -> None:
    tracker, _ = synced()
    live(tracker, 0, 1)
    actions = live(tracker, 4)
    request = replay_of(actions)
    assert request.start_seq == 2 and applied(actions) == []
    assert live(tracker, 5) == []
    merged = replayed(tracker, request.attempt, 2, 3, 4)
    merged += tracker.on_replay_end(request.attempt)
    assert applied(merged) == [2, 3, 4, 5]
    # Replayed 4 won over the buffered live 4 (identical bytes on a real engine).
    assert [a.item for a in merged if isinstance(a, Apply)] == ["r2", "r3", "r4", "b5"]
    assert tracker.stats.gaps == 1 and tracker.stats.clears == 1  # only the start
    assert live(tracker, 6) == [Apply(6, "b6")]


def test_late_live_copies_after_replay_are_dropped_not_restarts() -> None:
    """Replay may overtake the live socket: seq below next but above the last live one."""
    tracker, _ = synced()
    live(tracker, 0)
    request = replay_of(live(tracker, 3))
    replayed(tracker, request.attempt, 1, 2, 3, 4, 5)
    tracker.on_replay_end(request.attempt)
    assert live(tracker, 4, 5) == []
    assert tracker.stats.restarts == 0 and tracker.stats.duplicates == 3  # live 3 (buffer), 4, 5
    assert live(tracker, 6) == [Apply(6, "b6")]


def test_gap_without_replay_clears_and_restarts_from_the_message() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=False)
    assert clears(tracker.start()) == ["start"] and tracker.state == "idle"
    assert applied(live(tracker, 7)) == [7]  # the first message anchors
    actions = live(tracker, 8, 11)
    assert applied(actions) == [8, 11] and clears(actions) == ["gap"]
    assert tracker.next_seq == 12


def test_history_lost_when_first_replayed_seq_is_above_the_start() -> None:
    tracker, _ = synced()
    live(tracker, 0)
    request = replay_of(live(tracker, 10))
    actions = replayed(tracker, request.attempt, 8, 9, 10)
    assert clears(actions) == ["history_lost"] and applied(actions) == [8, 9, 10]
    assert tracker.on_replay_end(request.attempt) == []  # buffered 10 is a duplicate
    assert tracker.stats.history_lost == 1 and tracker.next_seq == 11


def test_history_lost_when_replay_ends_before_what_was_already_published() -> None:
    tracker, _ = synced()
    live(tracker, 0)
    request = replay_of(live(tracker, 10))
    actions = tracker.on_replay_end(request.attempt)  # END at once: 1..9 are gone
    assert clears(actions) == ["history_lost"] and applied(actions) == [10]
    assert tracker.state == "live" and tracker.next_seq == 11


def test_a_gap_after_the_replay_window_asks_again_instead_of_clearing() -> None:
    """Live messages that arrived after the request may legitimately be newer than the replay."""
    tracker, _ = synced()
    live(tracker, 0)
    first = replay_of(live(tracker, 3))
    live(tracker, 9)  # arrived after the request: published after the replay snapshot
    actions = replayed(tracker, first.attempt, 1, 2, 3)
    actions += tracker.on_replay_end(first.attempt)
    second = replay_of(actions)
    assert clears(actions) == [] and applied(actions) == [1, 2, 3]
    assert second.start_seq == 4 and second.attempt > first.attempt
    merged = replayed(tracker, second.attempt, 4, 5, 6, 7, 8, 9)
    merged += tracker.on_replay_end(second.attempt)
    assert applied(merged) == [4, 5, 6, 7, 8, 9] and tracker.next_seq == 10


def test_sequence_reset_means_restart_clear_and_resync() -> None:
    tracker, _ = synced()
    live(tracker, 0, 1, 2)
    actions = live(tracker, 0)
    assert clears(actions) == ["restart"] and applied(actions) == [0]
    assert tracker.stats.restarts == 1 and tracker.next_seq == 1
    # A restart seen above 0 (we missed its first batches): replay them from 0.
    live(tracker, 1, 2, 3)
    actions = live(tracker, 2)
    request = replay_of(actions)
    assert clears(actions) == ["restart"] and request.start_seq == 0
    merged = replayed(tracker, request.attempt, 0, 1, 2)
    merged += tracker.on_replay_end(request.attempt)
    assert applied(merged) == [0, 1, 2] and tracker.stats.history_lost == 0


def test_restart_during_replay_abandons_it() -> None:
    tracker, _ = synced()
    live(tracker, 0, 1)
    old = replay_of(live(tracker, 5))
    actions = live(tracker, 0)  # the publisher restarted mid-replay
    assert clears(actions) == ["restart"] and applied(actions) == [0]
    assert replayed(tracker, old.attempt, 2, 3) == []  # stale replies ignored
    assert tracker.on_replay_end(old.attempt) == []
    assert tracker.stats.stale_replies == 3 and live(tracker, 1) == [Apply(1, "b1")]


def test_replay_timeout_retries_then_gives_up_and_continues_from_buffer() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=True, max_replay_attempts=2)
    tracker.start()
    tracker.on_replay_end(tracker.attempt)
    live(tracker, 0)
    first = replay_of(live(tracker, 3))
    live(tracker, 4)
    retry = replay_of(tracker.on_replay_timeout(first.attempt))
    assert retry.start_seq == 1 and retry.attempt > first.attempt
    assert tracker.on_replay_timeout(first.attempt) == []  # stale timeout
    actions = tracker.on_replay_timeout(retry.attempt)
    assert clears(actions) == ["replay_failed"] and applied(actions) == [3, 4]
    assert tracker.stats.replay_failures == 1 and tracker.state == "live"
    # A later gap tries replay again.
    assert replay_of(live(tracker, 7)).start_seq == 5


def test_progress_resets_the_timeout_budget() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=True, max_replay_attempts=2)
    request = replay_of(tracker.start())
    retry = replay_of(tracker.on_replay_timeout(request.attempt))
    replayed(tracker, retry.attempt, 0)  # the endpoint answers after all
    again = replay_of(tracker.on_replay_timeout(retry.attempt))
    assert again.start_seq == 1  # retried from where it got to, not given up


def test_buffer_overflow_abandons_the_replay() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=True, max_buffer=3)
    tracker.start()
    tracker.on_replay_end(tracker.attempt)
    live(tracker, 0)
    replay_of(live(tracker, 2))
    actions = live(tracker, 3, 4, 5)
    assert clears(actions) == ["replay_failed"] and applied(actions) == [2, 3, 4, 5]
    assert tracker.stats.buffer_overflows == 1 and tracker.buffered == 0


def test_disconnect_clears_and_the_next_message_replays_from_zero() -> None:
    tracker, _ = synced()
    live(tracker, 0, 1, 2)
    assert clears(tracker.on_disconnected()) == ["disconnected"]
    request = replay_of(live(tracker, 3))  # same process after a blip: seq went on
    assert request.start_seq == 0
    merged = replayed(tracker, request.attempt, 0, 1, 2, 3)
    merged += tracker.on_replay_end(request.attempt)
    assert applied(merged) == [0, 1, 2, 3] and clears(merged) == []


def test_duplicates_inside_the_replay_are_dropped() -> None:
    tracker, _ = synced()
    request = replay_of(live(tracker, 2))
    actions = replayed(tracker, request.attempt, 0, 1, 1, 0, 2)
    assert applied(actions) == [0, 1, 2] and tracker.stats.duplicates == 2


def test_a_jump_inside_the_replay_is_a_loss() -> None:
    tracker, _ = synced()
    request = replay_of(live(tracker, 9))
    actions = replayed(tracker, request.attempt, 0, 1, 5)
    assert applied(actions) == [0, 1, 5] and clears(actions) == ["history_lost"]


# -- a late replica warmed from a sibling's snapshot ---------------------------------


def test_warm_start_replays_only_what_followed_the_snapshot() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=True)
    actions = tracker.warm(40)
    assert clears(actions) == []  # the sibling's entries stay
    request = replay_of(actions)
    assert request.start_seq == 40
    assert replayed(tracker, request.attempt, 40, 41) == [Apply(40, "r40"), Apply(41, "r41")]
    assert tracker.on_replay_end(request.attempt) == []
    assert applied(live(tracker, 42)) == [42]


def test_a_stale_snapshot_whose_history_is_gone_is_refused() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=True)
    request = replay_of(tracker.warm(40))
    actions = replayed(tracker, request.attempt, 55)  # the ring buffer moved past 40
    assert clears(actions) == ["history_lost"] and applied(actions) == [55]


def test_a_snapshot_from_before_the_publisher_restarted_is_refused() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=True)
    request = replay_of(tracker.warm(40))
    assert tracker.on_replay_end(request.attempt) == []  # nothing at or past 40
    actions = live(tracker, 3)  # a new process counting from 0
    assert clears(actions) == ["restart"]


def test_warm_start_without_replay_needs_the_very_next_seq() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(replay=False)
    assert tracker.warm(10) == []
    assert applied(live(tracker, 10)) == [10]
    fresh: SequenceTracker[str] = SequenceTracker(replay=False)
    fresh.warm(10)
    assert clears(live(fresh, 12)) == ["gap"]
