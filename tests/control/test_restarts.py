"""The sans-IO restart count: one restart per new process, whichever witnesses see it."""

from __future__ import annotations

from direct_frontend.control.restarts import RestartCount


def test_the_first_discovery_is_the_start_not_a_restart() -> None:
    count = RestartCount()
    assert not count.discovered("2026-12-01T10:00:00+00:00", 1)
    assert not count.discovered("", 1) and count.total == 0


def test_a_reported_start_that_changes_is_a_restart_and_one_that_stays_is_not() -> None:
    count = RestartCount()
    count.discovered("t1", 1)
    assert not count.discovered("t1", 2)  # a new connection to the same process
    assert count.total == 0
    assert count.discovered("t2", 2)
    assert count.total == 1


def test_an_engine_reporting_nothing_restarted_when_reached_over_a_new_connection() -> None:
    count = RestartCount()
    count.discovered("", 1)
    assert not count.discovered("", 1)  # back from unhealthy on the same connection
    assert count.discovered("", 2)
    assert count.total == 1


def test_the_connection_guess_does_not_count_when_the_publisher_is_followed() -> None:
    count = RestartCount(follows_publisher=True)
    count.discovered("", 1)
    assert count.discovered("", 2)  # it looks restarted, but only the exact witness counts
    assert count.total == 0
    count.publisher_restarted(0)
    assert count.total == 1


def test_witnesses_of_one_restart_count_it_once() -> None:
    count = RestartCount(follows_publisher=True)
    count.discovered("t1", 1)
    count.publisher_restarted(0)  # the KV stream saw the new process first
    count.discovered("t2", 2)  # then discovery
    assert count.total == 1
    count.discovered("t3", 3)  # a restart the publisher missed (it never reconnected)
    assert count.total == 2


def test_every_rank_of_one_engine_restarts_with_it() -> None:
    count = RestartCount(follows_publisher=True)
    count.discovered("", 1)
    count.publisher_restarted(0)
    count.publisher_restarted(1)
    assert count.total == 1
    count.publisher_restarted(1)
    assert count.total == 2


def test_the_total_never_goes_down_when_the_witnesses_change() -> None:
    count = RestartCount()
    count.discovered("", 1)
    count.discovered("", 2)
    assert count.total == 1
    count.discovered("t1", 3)  # relaunched with a servicer that reports its start
    count.follows_publisher = True
    assert count.total == 2  # not comparable with "": counted by the connection once more
    count.discovered("t1", 4)
    assert count.total == 2


def test_lives_move_at_every_witness_the_guess_included() -> None:
    """Routing fences its memory of the engine by ``lives``: a guess is enough there."""
    count = RestartCount(follows_publisher=True)
    count.discovered("", 1)
    assert count.lives == 0
    assert not count.discovered("", 1)  # back on the same connection: the same process
    assert count.lives == 0
    count.discovered("", 2)  # a new connection: not counted as a restart, but a new life
    assert count.total == 0 and count.lives == 1
    count.publisher_restarted(0)  # the same restart, seen by its exact witness
    assert count.total == 1 and count.lives == 2
