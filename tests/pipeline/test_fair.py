"""The fair order between tenants' waiting requests (sans-IO) and the admission it drives."""

from __future__ import annotations

import collections

import trio
import trio.testing

from direct_frontend.fleet.schema import TenantConfig, TenantsConfig
from direct_frontend.pipeline.admission import Admission, AdmissionConfig, Rejected
from direct_frontend.pipeline.fair import FairQueue


def drain(queue: FairQueue) -> list[str]:
    order = []
    while (waiter := queue.next()) is not None:
        queue.pop(waiter)
        order.append(waiter.flow)
    return order


def test_one_flow_is_first_come_first_served() -> None:
    queue = FairQueue(lambda flow: 1.0)
    pushed = [queue.push("", 1) for _ in range(5)]
    order = []
    while (waiter := queue.next()) is not None:
        queue.pop(waiter)
        order.append(waiter)
    assert order == pushed


def test_a_burst_does_not_keep_a_quiet_flow_behind_it() -> None:
    queue = FairQueue(lambda flow: 1.0)
    for _ in range(50):
        queue.push("flood", 1)
    queue.push("quiet", 1)
    assert drain(queue)[:2] == ["flood", "quiet"]  # the quiet one's turn comes at once


def test_flows_are_served_in_proportion_to_their_weights() -> None:
    queue = FairQueue({"a": 3.0, "b": 1.0}.get)  # type: ignore[arg-type]
    for _ in range(40):
        queue.push("a", 1)
        queue.push("b", 1)
    first = collections.Counter(drain(queue)[:40])
    assert first == {"a": 30, "b": 10}


def test_an_idle_flow_banks_no_credit() -> None:
    queue = FairQueue(lambda flow: 1.0)
    for _ in range(10):
        queue.push("busy", 1)
    for _ in range(5):
        queue.pop(queue.next())  # type: ignore[arg-type]
    for _ in range(5):  # "late" was idle all along: it shares from now on, not from the start
        queue.push("late", 1)
    assert drain(queue) == ["late", "busy"] * 5  # alternating: not five of its own first


def test_a_cancelled_request_costs_its_flow_nothing() -> None:
    queue = FairQueue(lambda flow: 1.0)
    queue.push("a", 1)
    gone = queue.push("a", 1)
    queue.cancel(gone)
    queue.push("b", 1)
    queue.push("a", 1)
    assert drain(queue) == ["a", "b", "a"] and len(queue) == 0


def test_a_flow_at_its_cap_is_passed_over() -> None:
    queue = FairQueue(lambda flow: 1.0)
    queue.push("capped", 1)
    queue.push("other", 1)
    waiter = queue.next(lambda w: w.flow != "capped")
    assert waiter is not None and waiter.flow == "other"


async def test_a_quiet_tenant_waits_only_for_its_turn_not_the_floods_backlog(
        autojump_clock: trio.testing.MockClock) -> None:
    """Two slots, each request 1 s: the flood queues 40 requests, the quiet tenant sends one
    at a time; each quiet request waits at most one request's time, not the flood's 20 s."""
    admission = Admission(AdmissionConfig(max_in_flight=2, max_queue=100, queue_timeout_s=60))
    waits: list[float] = []

    async def one(flow: str, into: list[float] | None = None) -> None:
        asked = trio.current_time()
        async with admission.slot(1, flow):
            if into is not None:
                into.append(trio.current_time() - asked)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for _ in range(40):
            nursery.start_soon(one, "flood")
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(5):
            await one("quiet", waits)
    assert max(waits) <= 1.0 and admission.in_flight == 0 and admission.waiting == 0


async def test_the_slots_split_by_weight_under_load(
        autojump_clock: trio.testing.MockClock) -> None:
    tenants = TenantsConfig(tenant=(TenantConfig(name="a", weight=3, flow="a"),
                                    TenantConfig(name="b", weight=1, flow="b")))
    admission = Admission(AdmissionConfig(max_in_flight=4, max_queue=1000, queue_timeout_s=600),
                          tenants=tenants)
    served: collections.Counter[str] = collections.Counter()

    async def one(flow: str) -> None:
        async with admission.slot(1, flow):
            await trio.sleep(1)
            served[flow] += 1

    with trio.move_on_after(40):
        async with trio.open_nursery() as nursery:
            for _ in range(200):
                nursery.start_soon(one, "a")
                nursery.start_soon(one, "b")
    assert abs(served["a"] / served["b"] - 3) < 0.3, served


async def test_a_tenant_at_its_cap_waits_while_the_others_go_by(
        autojump_clock: trio.testing.MockClock) -> None:
    tenants = TenantsConfig(max_in_flight=1, tenant=(TenantConfig(name="big", max_in_flight=3,
                                                                  flow="big"),))
    admission = Admission(AdmissionConfig(max_in_flight=8, max_queue=100, queue_timeout_s=60),
                          tenants=tenants)
    held: collections.Counter[str] = collections.Counter()
    most: collections.Counter[str] = collections.Counter()

    async def one(flow: str) -> None:
        async with admission.slot(1, flow):
            held[flow] += 1
            most[flow] = max(most[flow], held[flow])
            await trio.sleep(1)
            held[flow] -= 1

    async with trio.open_nursery() as nursery:
        for flow in ("big", "small", "other"):
            for _ in range(6):
                nursery.start_soon(one, flow)
    assert most == {"big": 3, "small": 1, "other": 1}


async def test_a_full_queue_refuses_the_flood_not_a_quieter_tenant(
        autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=4, queue_timeout_s=60))
    outcome: dict[str, list[str]] = collections.defaultdict(list)

    async def one(flow: str, seconds: float = 1) -> None:
        try:
            async with admission.slot(1, flow):
                outcome[flow].append("served")
                await trio.sleep(seconds)
        except Rejected as rejected:
            outcome[flow].append(rejected.reason)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "flood", 1)  # holds the one slot
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(4):  # and every place in the queue
            nursery.start_soon(one, "flood")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "flood")  # the queue is full: the flood's own is refused
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "quiet")  # the flood's newest gives way
        await trio.testing.wait_all_tasks_blocked()
        assert outcome["flood"] == ["served", "the request queue is full",
                                    "the request queue is full, and this tenant holds the "
                                    "most of it"]
    assert outcome["quiet"] == ["served"] and outcome["flood"].count("served") == 4


async def test_a_tenant_past_its_share_leaves_a_slot_free_for_an_active_other(
        autojump_clock: trio.testing.MockClock) -> None:
    """The flood may fill every slot alone; once another tenant is active, a flood past its
    share leaves that one a free slot, so its next request starts at once."""
    admission = Admission(AdmissionConfig(max_in_flight=8, max_queue=100, queue_timeout_s=60))
    started: list[float] = []

    async def one(flow: str, seconds: float, into: list[float] | None = None) -> None:
        asked = trio.current_time()
        async with admission.slot(1, flow):
            if into is not None:
                into.append(trio.current_time() - asked)
            await trio.sleep(seconds)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(one, "flood", 1)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 8  # alone: every slot
        await one("quiet", 0.1, started)  # waits for a flood request to end...
        for _ in range(20):
            nursery.start_soon(one, "flood", 1)
        await trio.sleep(1.5)
        assert admission.in_flight == 7  # ...but from then on one stays free for it
        await one("quiet", 0.1, started)
    assert started[0] > 0 and started[1] == 0
