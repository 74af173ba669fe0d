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
        release.set()
    assert sorted(admitted) == [1, 2, 3] and admitted[-1] == 3
    assert admission.in_flight == 0 and admission.rejected == 1


async def test_queue_timeout() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=5, queue_timeout_s=0.05))
    async with admission.slot():
        with pytest.raises(Rejected, match="timed out"):
            async with admission.slot():
                pass
    assert admission.waiting == 0
