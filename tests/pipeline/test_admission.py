"""Admission control under Trio: cap, FIFO queue, timeouts."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from direct_frontend.pipeline.admission import Admission, AdmissionConfig, Rejected


async def test_cap_queue_and_rejection() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=2, max_queue=1, queue_timeout_s=5))
    release = trio.Event()
    admitted: list[int] = []

    async def hold(i: int) -> None:
        async with admission.slot():
            admitted.append(i)
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, 1)
        nursery.start_soon(hold, 2)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, 3)  # queued
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(admitted) == [1, 2] and admission.waiting == 1 and admission.in_flight == 2
        with pytest.raises(Rejected, match="queue is full"):
            async with admission.slot():
                pass
        with pytest.raises(Rejected, match="queue is full"):  # what a background one hears
            admission.refuse_if_full()
        release.set()
    assert sorted(admitted) == [1, 2, 3] and admitted[-1] == 3
    assert admission.in_flight == 0 and admission.rejected == 2
    admission.refuse_if_full()  # room again: nothing raised


async def test_queue_timeout() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=5, queue_timeout_s=0.05))
    async with admission.slot():
        with pytest.raises(Rejected, match="timed out"):
            async with admission.slot():
                pass
    assert admission.waiting == 0


async def test_a_request_of_several_choices_holds_one_slot_each(
        autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(AdmissionConfig(max_in_flight=4, max_queue=4, queue_timeout_s=5))
    release = trio.Event()
    admitted: list[str] = []

    async def hold(name: str, count: int) -> None:
        async with admission.slot(count):
            admitted.append(name)
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, "three", 3)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 3
        nursery.start_soon(hold, "two", 2)  # one slot is free: it waits, its turn kept
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == ["three"] and admission.waiting == 1 and admission.in_flight == 3
        with pytest.raises(trio.TooSlowError), trio.fail_after(1):  # nobody passes it by
            async with admission.slot(1):
                pass
        release.set()
    assert admitted == ["three", "two"] and admission.in_flight == 0


async def test_two_gathering_requests_never_deadlock() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=3, max_queue=4, queue_timeout_s=5))
    done: list[str] = []

    async def hold(name: str, count: int) -> None:
        async with admission.slot(count):
            await trio.sleep(0.01)
            done.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, "one", 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, "a", 3)  # each needs every slot: served in turn
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, "b", 3)
    assert done == ["one", "a", "b"] and admission.in_flight == 0


async def test_more_choices_than_slots_take_every_slot() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=2, max_queue=1, queue_timeout_s=5))
    async with admission.slot(128):
        assert admission.in_flight == 2


async def test_a_gathering_that_times_out_gives_its_slots_back() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=3, max_queue=2, queue_timeout_s=0.05))
    async with admission.slot(2):
        with pytest.raises(Rejected, match="timed out"):
            async with admission.slot(2):
                pass
        assert admission.in_flight == 2
    assert admission.in_flight == 0


async def test_background_work_holds_at_most_half_the_slots(
        autojump_clock: trio.testing.MockClock) -> None:
    """However much background work waits, a foreground request finds a slot at once, and
    background work waiting past the queue's timeout is refused."""
    admission = Admission(AdmissionConfig(max_in_flight=4, max_queue=100, queue_timeout_s=5))
    release = trio.Event()
    running: list[str] = []
    refused: list[str] = []

    async def background(name: str) -> None:
        try:
            async with admission.background_slot():
                running.append(name)
                await release.wait()
        except Rejected:
            refused.append(name)

    async with trio.open_nursery() as nursery:
        for n in range(10):
            nursery.start_soon(background, f"bg{n}")
        await trio.testing.wait_all_tasks_blocked()
        assert len(running) == 2 and admission.in_flight == 2
        with trio.fail_after(0.001):  # the other half is the foreground's, with no wait
            async with admission.slot(2):
                assert admission.in_flight == 4
        await trio.sleep(6)
        assert len(refused) == 8 and admission.rejected == 8
        release.set()
    assert len(running) == 2 and admission.in_flight == 0


class Heard:
    """What an admission observer hears: each admission's (tenant, tier, wait), each refusal."""

    def __init__(self) -> None:
        self.waits: list[tuple[str, str, float]] = []
        self.refusals: list[tuple[str, str, str]] = []

    def admitted(self, tenant: str, tier: str, waited: float) -> None:
        self.waits.append((tenant, tier, waited))

    def refused(self, tenant: str, tier: str, reason: str) -> None:
        self.refusals.append((tenant, tier, reason))


async def test_each_admitted_request_reports_its_wait(
        autojump_clock: trio.testing.MockClock) -> None:
    heard = Heard()
    admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=4, queue_timeout_s=10),
                          heard)

    async def hold(seconds: float) -> None:
        async with admission.slot():
            await trio.sleep(seconds)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, 3)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, 1)
    assert heard.waits == [("anonymous", "default", 0), ("anonymous", "default", 3)]
