"""The prefill queue's memory of what it sent where (sans-IO)."""

from __future__ import annotations

from direct_frontend.routing.prefill_queue import PrefillQueue

HASHES = (11, 12, 13, 14)


def test_a_queue_nobody_asks_the_depth_of_stays_bounded() -> None:
    """``cache_affinity`` queues every placement and never asks a depth: what is past its
    time goes as the next request is queued, prefilled or not."""
    queue = PrefillQueue()
    for n in range(200):  # a request a second, each prefilled 0.1 s after it is sent
        token = queue.add("a", (n, *HASHES), 5, float(n))
        queue.prefilled("a", token, n + 0.1)
    assert queue.requests("a") == 1  # the last one: the others' prefill ended long ago
    for n in range(200, 400):  # never heard of again (each failed before its first token)
        queue.add("a", (n, *HASHES), 5, float(n))
    assert queue.requests("a") == 61  # those of the last PREFILL_FORGET_S


def test_a_prefilled_requests_unshown_blocks_are_pending_only_for_the_events_lag() -> None:
    queue = PrefillQueue()
    token = queue.add("a", HASHES, 4, 0.0)
    assert queue.pending("a", HASHES, 0.0) == 4  # being prefilled
    queue.prefilled("a", token, 1.0)  # its first token
    assert queue.pending("a", HASHES, 1.1) == 4  # its events may be on their way
    assert queue.pending("a", HASHES, 2.0) == 0  # they would have come: it was never stored
    assert queue.requests("a") == 0
