"""Preemption in the admission queue: who gives way to whom, and how often (sans-IO, mock clock).

Each request here is a task that holds its slot for its run and may be asked off its
"engine" the way the relay is (:meth:`Hold.running`): it then waits for a slot again
(:meth:`Admission.requeue`) and runs what it had left.
"""

from __future__ import annotations

import functools
import math

import pytest
import trio
import trio.testing

from direct_frontend.openai.types import Tier
from direct_frontend.pipeline.admission import Admission, AdmissionConfig, Rejected
from direct_frontend.pipeline.preempt import Hold, choose_victim, new_hold, preempt_for
from direct_frontend.pipeline.shares import USAGE_S, Shares


def config(slots: int, preempt: bool = True, max_preemptions: int = 2,
           queue: int = 100) -> AdmissionConfig:
    return AdmissionConfig(max_in_flight=slots, max_queue=queue, queue_timeout_s=60,
                           flex_reserve=0, preempt=preempt, max_preemptions=max_preemptions)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []  # (when, name, what)

    def add(self, name: str, what: str) -> None:
        self.events.append((trio.current_time(), name, what))

    def of(self, what: str) -> list[str]:
        return [name for _, name, w in self.events if w == what]

    def when(self, name: str, what: str) -> float:
        return next(t for t, n, w in self.events if n == name and w == what)


async def run(admission: Admission, log: Log, name: str, flow: str, seconds: float,
              tier: Tier = "default", *, deadline: float = math.inf) -> None:
    """Hold a slot for ``seconds`` of work (its tokens: a thousand a second), preemptible;
    after a preemption wait for a slot again, then do what is left."""
    try:
        async with admission.slot(1, flow, tier) as hold:
            log.add(name, "start")
            left = seconds
            while True:
                began = trio.current_time()
                done = seconds - left
                with trio.CancelScope() as scope:
                    hold.running(lambda: scope.cancel() is None, functools.partial(
                        lambda done, began: int((done + trio.current_time() - began) * 1000),
                        done, began))
                    await trio.sleep(left)
                hold.running(None)
                left -= trio.current_time() - began
                if not scope.cancelled_caught:
                    break
                log.add(name, "preempted")
                if not await admission.requeue(hold, deadline):
                    log.add(name, "expired")
                    return
                log.add(name, "resumed")
            log.add(name, "end")
    except Rejected:
        log.add(name, "refused")


async def flood(nursery: trio.Nursery, admission: Admission, log: Log, count: int,
                flow: str = "flood", tier: Tier = "default", seconds: float = 10.0,
                stagger: float = 0.1) -> None:
    """``count`` requests of ``flow``, one every ``stagger`` s (the last started the
    latest, with the least work done)."""
    for k in range(count):
        nursery.start_soon(run, admission, log, f"{flow}{k}", flow, seconds, tier)
        await trio.sleep(stagger)


async def test_a_quiet_tenant_takes_the_latest_flood_request_off_and_it_resumes_first(
        autojump_clock: trio.testing.MockClock) -> None:
    """Four slots, all the flood's, with more of its requests waiting: the quiet tenant's
    request preempts the flood's latest (fewest tokens) and starts at once; the preempted
    one goes on before the flood's other waiting requests when the next slot frees."""
    admission = Admission(config(4))
    log = Log()
    async with trio.open_nursery() as nursery:
        await flood(nursery, admission, log, 6)
        assert log.of("start") == ["flood0", "flood1", "flood2", "flood3"]
        quiet_at = trio.current_time()
        nursery.start_soon(run, admission, log, "quiet", "quiet", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert log.of("preempted") == ["flood3"]
        assert log.when("quiet", "start") == quiet_at  # no wait
    # the next slot the flood may have goes to the preempted request, not to flood4
    assert log.of("resumed") == ["flood3"]
    assert log.when("flood3", "resumed") == log.when("flood0", "end")
    assert log.when("flood4", "start") > log.when("flood3", "resumed")
    assert admission.in_flight == 0 and admission.waiting == 0


async def test_each_waiting_request_preempts_at_most_one(
        autojump_clock: trio.testing.MockClock) -> None:
    """Eight slots of the flood; the quiet tenant sends two at once: each takes one flood
    request off (two in all, not more), and both start at once."""
    admission = Admission(config(8))
    log = Log()
    async with trio.open_nursery() as nursery:
        await flood(nursery, admission, log, 12)
        nursery.start_soon(run, admission, log, "q1", "quiet", 1.0)
        nursery.start_soon(run, admission, log, "q2", "quiet", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(log.of("preempted")) == ["flood6", "flood7"]
        assert {"q1", "q2"} <= set(log.of("start"))
        nursery.cancel_scope.cancel()


async def test_a_priority_request_never_gives_way_to_a_default_one(
        autojump_clock: trio.testing.MockClock) -> None:
    """Every slot held at priority by a backlogged tenant: a default request of another
    waits its turn instead of preempting one; at default the same tenant gives way, to a
    default request or a priority one."""
    cases: list[tuple[Tier, Tier, list[str]]] = [
        ("priority", "default", []), ("default", "default", ["flood3"]),
        ("default", "priority", ["flood3"])]
    for tier, quiet_tier, preempted in cases:
        admission = Admission(config(4))
        log = Log()
        async with trio.open_nursery() as nursery:
            await flood(nursery, admission, log, 6, tier=tier)
            nursery.start_soon(run, admission, log, "quiet", "quiet", 1.0, quiet_tier)
            await trio.testing.wait_all_tasks_blocked()
            assert log.of("preempted") == preempted, (tier, quiet_tier)
            nursery.cancel_scope.cancel()


async def test_flex_gives_way_to_an_interactive_tenant_even_alone(
        autojump_clock: trio.testing.MockClock) -> None:
    """Every slot held by flex work (a batch on idle capacity) with more of it waiting: an
    interactive request, its tenant the only one at the interactive tiers, takes one flex
    request off its engine and starts at once."""
    admission = Admission(config(4))
    log = Log()
    async with trio.open_nursery() as nursery:
        await flood(nursery, admission, log, 6, "batch", "flex")
        assert len(log.of("start")) == 4
        asked = trio.current_time()
        nursery.start_soon(run, admission, log, "app", "app", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert log.of("preempted") == ["batch3"]
        assert log.when("app", "start") == asked
        nursery.cancel_scope.cancel()


async def test_a_request_gives_way_at_most_max_preemptions_times(
        autojump_clock: trio.testing.MockClock) -> None:
    """One slot, a flood request in it and more waiting; quiet requests arrive one after
    another: the flood request is preempted once (the cap), then quiet waits its turn."""
    admission = Admission(config(1, max_preemptions=1))
    log = Log()
    async with trio.open_nursery() as nursery:
        await flood(nursery, admission, log, 3, seconds=5.0)
        for k in range(3):
            nursery.start_soon(run, admission, log, f"q{k}", "quiet", 0.5)
            await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert log.of("preempted") == ["flood0"]
    assert log.of("start")[:2] == ["flood0", "q0"]
    assert "q1" not in log.of("start")[:3]  # it waited for the flood request to end


async def test_tenants_that_both_use_their_share_never_preempt_each_other(
        autojump_clock: trio.testing.MockClock) -> None:
    """Two backlogged tenants of equal weight share eight slots for a minute, each request
    a second long: neither is ever short of its share by its usage, so none is preempted."""
    admission = Admission(config(8))
    log = Log()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood, nursery, admission, log, 240, "a", "default", 1.0, 0.25)
        nursery.start_soon(flood, nursery, admission, log, 240, "b", "default", 1.0, 0.25)
    assert len(log.of("end")) == 480
    # only while they start (no usage yet to judge by), a handful at most
    assert len(log.of("preempted")) <= 4


async def test_off_no_request_is_preempted(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(config(4, preempt=False))
    log = Log()
    async with trio.open_nursery() as nursery:
        await flood(nursery, admission, log, 6)
        nursery.start_soon(run, admission, log, "quiet", "quiet", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert log.of("preempted") == [] and "quiet" not in log.of("start")
        nursery.cancel_scope.cancel()


async def test_a_preempted_request_waits_no_longer_than_its_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    """Preempted, it waits for a slot again until its own deadline (not the queue's
    timeout), then holds none, and the queue is left as it was."""
    admission = Admission(config(1))
    log = Log()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(run, admission, log, "victim", "flood", 10.0,
                                             deadline=trio.current_time() + 2.0))
        await trio.sleep(0.1)
        nursery.start_soon(run, admission, log, "flood1", "flood", 1.0)
        await trio.sleep(0.1)
        nursery.start_soon(run, admission, log, "quiet", "quiet", 5.0)  # holds the slot 5 s
        await trio.testing.wait_all_tasks_blocked()
        assert log.of("preempted") == ["victim"]
    assert log.when("victim", "expired") == 2.0
    assert log.of("end") == ["quiet", "flood1"]
    assert admission.in_flight == 0 and admission.waiting == 0


def test_the_victim_is_of_the_latest_tier_then_most_over_then_least_work() -> None:
    """The order :func:`choose_victim` takes running requests in, and what it skips."""
    holds = [new_hold(flow, 1, tier, 0.0) for flow, tier in (
        ("a", "default"), ("b", "default"), ("b", "default"), ("c", "flex"),
        ("d", "priority"))]
    work = {id(hold): k * 10 for k, hold in enumerate(holds)}
    for hold in holds:
        hold.running(lambda: True, lambda h=hold: work[id(h)])  # type: ignore[misc]
    over = {"a": 1.0, "b": 2.0, "c": 1.0, "d": 5.0}

    def pick(flow: str, tier: Tier) -> Hold | None:
        return choose_victim(holds, flow, tier, lambda h: over[h.flow], 2)

    assert pick("q", "default") is holds[3]  # flex first
    holds[3].asked = True
    assert pick("q", "default") is holds[1]  # then the most over, the least work of its
    holds[1].preemptions = 2  # capped
    assert pick("q", "default") is holds[2]
    assert pick("b", "default") is holds[0]  # never the waiter's own tenant
    over.update(a=0.0, b=0.0)  # not past their shares
    assert pick("q", "default") is None  # the priority request is not the default's
    assert pick("q", "priority") is holds[4]
    holds[4].running(None)  # off its engine: nothing to preempt
    assert pick("q", "priority") is None


@pytest.mark.parametrize("preempt", [True, False])
async def test_the_quiet_tenant_waits_only_with_preemption_off(
        autojump_clock: trio.testing.MockClock, preempt: bool) -> None:
    """The bench's shape in small: two slots flooded, a quiet request every 3 s for a
    minute; with preemption none of them waits."""
    admission = Admission(config(2, preempt=preempt))
    log = Log()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood, nursery, admission, log, 100, "flood", "default", 1.0, 0.6)
        await trio.sleep(0.05)
        for k in range(20):
            asked = trio.current_time()
            nursery.start_soon(run, admission, log, f"q{k}", "quiet", 0.2)
            await trio.testing.wait_all_tasks_blocked()
            log.add(f"q{k}", "waited" if f"q{k}" not in log.of("start") or
                    log.when(f"q{k}", "start") > asked else "at once")
            await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    waited = log.of("waited")
    assert (waited == []) if preempt else (len(waited) >= 10)


def test_a_tenants_usage_is_what_it_held_averaged_over_the_last_seconds() -> None:
    """Usage follows what a tenant holds with the time constant USAGE_S, and is forgotten
    once it is idle long enough."""
    shares = Shares(8, lambda flow: 1.0)
    shares.add("a", 4, 0.0)
    assert shares.usage("a", 0.0) == 0.0
    assert shares.usage("a", USAGE_S) == pytest.approx(4 * (1 - math.exp(-1)))
    shares.add("a", -4, 100 * USAGE_S)  # long since at 4
    assert shares.usage("a", 100 * USAGE_S) == pytest.approx(4.0)
    assert shares.usage("a", 101 * USAGE_S) == pytest.approx(4 * math.exp(-1))
    shares.add("a", 0, 200 * USAGE_S)
    assert shares.usage("a", 200 * USAGE_S) == 0.0 and not shares._usage


def test_a_request_past_relaying_is_passed_over_for_the_next() -> None:
    """The first choice declines (it is ending by itself): the next is asked, and only one
    is preempted for the waiter."""
    shares = {tier: Shares(4, lambda flow: 1.0) for tier in ("priority", "default")}
    for account in shares.values():
        account.saw("flood", 0.0)
        account.saw("quiet", 0.0)
        account.add("flood", 4, 0.0)
    asked: list[int] = []
    holds = [new_hold("flood", 1, "default", 0.0) for _ in range(4)]
    for k, hold in enumerate(holds):
        hold.running(functools.partial(lambda k: asked.append(k) is None and k != 3, k),
                     functools.partial(lambda k: 10 - k, k))  # the latest has done the least
    chosen = preempt_for(holds, shares, "quiet", "default", 0, lambda flow: 5, 1.0, 2)  # type: ignore[arg-type]
    assert asked == [3, 2] and chosen is holds[2]
    assert [h.asked for h in holds] == [False, False, True, False]


async def test_a_preempted_request_whose_client_leaves_leaves_nothing_behind(
        autojump_clock: trio.testing.MockClock) -> None:
    """Cancelled while it waits for a slot again: out of the queue, no slot given back twice,
    and the next request of its tenant takes the slot in its place."""
    admission = Admission(config(1))
    log = Log()
    client = trio.CancelScope()

    async def victim() -> None:
        with client:
            await run(admission, log, "victim", "flood", 10.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(victim)
        await trio.sleep(0.1)
        nursery.start_soon(run, admission, log, "flood1", "flood", 1.0)
        await trio.sleep(0.1)
        nursery.start_soon(run, admission, log, "quiet", "quiet", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert log.of("preempted") == ["victim"] and admission.waiting == 2
        client.cancel()  # the victim's client leaves while it waits
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting == 1 and admission.in_flight == 1
    assert log.of("end") == ["quiet", "flood1"]
    assert admission.in_flight == 0 and admission.waiting == 0
