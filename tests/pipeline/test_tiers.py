"""Service tiers and per-tenant limits in the admission queue (sans-IO, under a mock clock)."""

from __future__ import annotations

import collections
import contextlib

import trio
import trio.testing

from direct_frontend.fleet.schema import TenantConfig, TenantsConfig
from direct_frontend.openai.types import Tier
from direct_frontend.pipeline.admission import Admission, AdmissionConfig, Rejected
from direct_frontend.pipeline.shares import Shares
from direct_frontend.pipeline.tenancy import Tenants
from tests.pipeline.test_admission import Heard


def config(slots: int, queue: int = 100, timeout: float = 60, flex_timeout: float = 600,
           reserve: int = 1) -> AdmissionConfig:
    return AdmissionConfig(max_in_flight=slots, max_queue=queue, queue_timeout_s=timeout,
                           flex_queue_timeout_s=flex_timeout, flex_reserve=reserve)


async def test_priority_goes_before_default_and_default_before_flex(
        autojump_clock: trio.testing.MockClock) -> None:
    """One slot, held; a flex, a default and a priority request queue in that order: the slot
    goes to priority, then default, then flex (with no reserve to keep)."""
    admission = Admission(config(1, reserve=0))
    order: list[str] = []

    async def one(tier: Tier) -> None:
        async with admission.slot(1, tier, tier):
            order.append(tier)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "default")
        await trio.testing.wait_all_tasks_blocked()
        for tier in ("flex", "default", "priority"):
            nursery.start_soon(one, tier)
            await trio.testing.wait_all_tasks_blocked()
    assert order == ["default", "priority", "default", "flex"]


async def test_tenants_share_a_tier_fairly(autojump_clock: trio.testing.MockClock) -> None:
    """Within the priority tier a burst of one tenant does not keep another's behind it."""
    admission = Admission(config(1))
    order: list[str] = []

    async def one(flow: str) -> None:
        async with admission.slot(1, flow, "priority"):
            order.append(flow)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(one, "burst")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "quiet")
    assert order[:3] == ["burst", "burst", "quiet"]


async def test_flex_leaves_the_reserve_free_for_interactive_requests(
        autojump_clock: trio.testing.MockClock) -> None:
    """Four slots, a reserve of one: a flex backlog runs three at a time, and an interactive
    request arriving meanwhile starts at once; flex takes a slot only while one stays free."""
    admission = Admission(config(4, reserve=1))
    running: collections.Counter[str] = collections.Counter()
    most: collections.Counter[str] = collections.Counter()
    waits: list[float] = []

    async def one(tier: Tier, seconds: float) -> None:
        asked = trio.current_time()
        async with admission.slot(1, "batch" if tier == "flex" else "app", tier):
            if tier != "flex":
                waits.append(trio.current_time() - asked)
            running[tier] += 1
            most[tier] = max(most[tier], running[tier])
            await trio.sleep(seconds)
            running[tier] -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(one, "flex", 1)
        await trio.sleep(0.5)
        assert admission.in_flight == 3 and admission.waiting == 17
        for _ in range(3):
            await one("default", 0.3)
            await trio.sleep(0.4)
    assert most["flex"] == 3 and waits == [0, 0, 0]


async def test_flex_waits_its_own_longer_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(config(1, timeout=1, flex_timeout=30, reserve=0))
    outcome: dict[str, float | str] = {}

    async def one(tier: Tier) -> None:
        asked = trio.current_time()
        try:
            async with admission.slot(1, "t", tier):
                outcome[tier] = trio.current_time() - asked
        except Rejected as rejected:
            outcome[tier] = rejected.reason

    async def hold() -> None:
        async with admission.slot(1, "t"):
            await trio.sleep(5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "default")
        nursery.start_soon(one, "flex")
    assert outcome["default"] == "timed out waiting for a free slot"
    assert outcome["flex"] == 5


async def test_a_full_queue_pushes_flex_out_first(autojump_clock: trio.testing.MockClock) -> None:
    """Flex fills the queue; its own next request finding it full is refused at once, and a
    default request takes the newest flex place (that one hears a 429 naming why)."""
    heard = Heard()
    admission = Admission(config(1, queue=2, reserve=0), heard)
    outcome: dict[str, str] = {}

    async def one(name: str, tier: Tier, flow: str = "batch") -> None:
        try:
            async with admission.slot(1, flow, tier):
                outcome[name] = "served"
                await trio.sleep(1)
        except Rejected as rejected:
            outcome[name] = rejected.reason

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "first", "flex")  # holds the slot
        await trio.testing.wait_all_tasks_blocked()
        for name in ("older", "newer"):
            nursery.start_soon(one, name, "flex")
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "late flex", "flex")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "app", "default", "app")
        await trio.testing.wait_all_tasks_blocked()
    assert outcome == {
        "first": "served", "older": "served", "app": "served",
        "late flex": "the request queue is full",
        "newer": "the request queue is full, and a request of a higher service tier took "
                 "this one's place",
    }
    assert sorted(heard.refusals) == [("other", "flex", "pushed_out"),
                                      ("other", "flex", "queue_full")]


async def test_a_tenants_queue_cap_refuses_it_alone_and_names_its_limit(
        autojump_clock: trio.testing.MockClock) -> None:
    tenants = TenantsConfig(header="x-team", max_queue=5, tenant=(
        TenantConfig(name="search", flow="h:search", max_queue=2),))
    heard = Heard()
    admission = Admission(config(1), heard, tenants)
    refused: list[str] = []

    async def one(flow: str) -> None:
        try:
            async with admission.slot(1, flow):
                await trio.sleep(1)
        except Rejected as rejected:
            refused.append(rejected.reason)

    async with trio.open_nursery() as nursery:
        for _ in range(4):  # one runs, two wait, the fourth is past its cap
            nursery.start_soon(one, "h:search")
        await trio.testing.wait_all_tasks_blocked()
        assert refused == ["tenant 'search' has 2 requests waiting already, its limit "
                           "([frontend.tenants] max_queue)"]
        for _ in range(5):  # another tenant still queues, to the default cap
            nursery.start_soon(one, "h:ads")
        nursery.start_soon(one, "h:ads")
        await trio.testing.wait_all_tasks_blocked()
    assert refused[1:] == ["tenant 'ads' has 5 requests waiting already, its limit "
                           "([frontend.tenants] max_queue)"]
    assert heard.refusals == [("search", "default", "tenant_queue_full"),
                              ("ads", "default", "tenant_queue_full")]


def test_priority_is_served_to_the_tenants_that_may_have_it() -> None:
    listed = (TenantConfig(api_key_env="GOLD", flow="kgold", priority=True),
              TenantConfig(api_key_env="BRONZE", flow="kbronze", priority=False))
    tenants = Tenants(TenantsConfig(tenant=listed))
    assert [tenants.tier("kgold", asked) for asked in ("priority", "auto", None, "flex")] == [
        "priority", "default", "default", "flex"]
    assert tenants.tier("kbronze", "priority") == "default"
    assert tenants.tier("kanyone", "priority") == "default"  # not listed: the default, no
    everyone = Tenants(TenantsConfig(priority=True, tenant=listed))
    assert everyone.tier("kanyone", "priority") == "priority"
    assert everyone.tier("kbronze", "priority") == "default"


def test_a_cap_is_known_whether_every_tenant_has_it_or_one_listed() -> None:
    listed = (TenantConfig(api_key_env="GOLD", flow="kgold"),)
    assert not Tenants(TenantsConfig(tenant=listed)).any_cap()
    assert Tenants(TenantsConfig(max_in_flight=2, tenant=listed)).any_cap()
    capped = (*listed, TenantConfig(api_key_env="BRONZE", flow="kbronze", max_in_flight=1))
    assert Tenants(TenantsConfig(tenant=capped)).any_cap()


def test_labels_are_names_never_keys_and_bounded() -> None:
    tenants = Tenants(TenantsConfig(header="x-team", max_series=2, tenant=(
        TenantConfig(name="search", flow="h:search"),)))
    labels = [tenants.label(flow) for flow in (
        "h:search", "h:ads", "h:maps", "h:ads", "h:mail", "k0123456789abcdef", "")]
    assert labels == ["search", "ads", "maps", "ads", "other", "other", "anonymous"]
    assert tenants.called("k0123456789abcdef") == "this tenant"
    assert tenants.called("h:ads") == "tenant 'ads'"


def test_the_free_slots_left_for_a_tenant_follow_how_its_count_varies() -> None:
    """Sixty-four slots, two active tenants (a share of 32 each): a tenant holding n is left
    isqrt(n) free slots (at least one), never more than it is short of its share."""
    shares = Shares(64, lambda flow: 1.0)
    shares.saw("quiet", 0)
    shares.saw("flood", 0)
    spare = []
    for held in (0, 1, 4, 9, 16, 31):
        shares.add("quiet", held - shares.held("quiet"))
        spare.append(shares.spare("quiet"))
    assert spare == [1, 1, 2, 3, 4, 1]
    assert shares.active(20) == set() and shares.share("quiet") == 64  # gone idle: alone


async def test_flex_holdings_do_not_count_against_a_tenants_share(
        autojump_clock: trio.testing.MockClock) -> None:
    """A tenant whose batch runs at flex on idle slots still has its share for its
    interactive requests: with seven flex slots held and another tenant active, its next
    interactive request takes the last free slot at once (were flex counted, it would be
    past its share and leave that slot to the other tenant)."""
    admission = Admission(config(8, reserve=1))
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(_hold, admission, "team", "flex")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 7
        async with admission.slot(1, "app"):  # the other tenant is active from here on
            pass
        with trio.fail_after(0.001):
            async with admission.slot(1, "team"):
                assert admission.in_flight == 8
        nursery.cancel_scope.cancel()


async def _hold(admission: Admission, flow: str, tier: Tier) -> None:
    async with admission.slot(1, flow, tier):
        await trio.sleep(100)


async def test_priority_leaves_no_spare_slot_to_default_but_default_leaves_one_to_priority(
        autojump_clock: trio.testing.MockClock) -> None:
    """Four slots. A priority flood takes every slot though a default tenant is active (the
    spare slots are its own tier's); a default flood leaves one free for an active priority
    tenant short of its share, so that one's next request starts at once."""
    admission = Admission(config(4))
    async with trio.open_nursery() as nursery:
        async with admission.slot(1, "default-app"):  # active at default from here on
            pass
        for _ in range(6):
            nursery.start_soon(_hold, admission, "gold", "priority")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 4
        nursery.cancel_scope.cancel()
    admission = Admission(config(4))
    async with trio.open_nursery() as nursery:
        async with admission.slot(1, "gold", "priority"):  # active at priority from here on
            pass
        for _ in range(6):
            nursery.start_soon(_hold, admission, "flood", "default")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 3
        with trio.fail_after(0.001):
            async with admission.slot(1, "gold", "priority"):
                assert admission.in_flight == 4
        nursery.cancel_scope.cancel()


async def test_flex_stays_out_of_what_interactive_requests_held_lately(
        autojump_clock: trio.testing.MockClock) -> None:
    """Eight slots, a reserve of one. Interactive requests held six a moment ago and hold one
    now: flex takes one slot (8 - 1 reserved - 6 lately), not six; once the peak has decayed
    (tens of seconds later) it takes all but the reserve and the one held."""
    admission = Admission(config(8, reserve=1))
    async with trio.open_nursery() as nursery:
        held = trio.CancelScope()

        async def burst() -> None:
            with held:
                async with trio.open_nursery() as inner:
                    for _ in range(5):
                        inner.start_soon(_hold, admission, "app", "default")

        nursery.start_soon(_hold, admission, "app", "default")
        nursery.start_soon(burst)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 6
        held.cancel()
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(10):
            nursery.start_soon(_hold, admission, "batch", "flex")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 2
        await trio.sleep(60)
        assert admission.in_flight == 7
        nursery.cancel_scope.cancel()


async def test_a_full_queue_refuses_no_one_for_a_request_whose_turn_comes_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    """Four slots, two places. The flood runs three requests (one past its share: the fourth
    slot is left to the quiet tenant), fills both places and is refused a sixth; the quiet
    tenant's request takes the slot left free at once, and none of the flood's waiting
    requests loses its place for it."""
    heard = Heard()
    admission = Admission(config(4, queue=2), heard)

    async def flood() -> None:
        with contextlib.suppress(Rejected):
            await _hold(admission, "flood", "default")

    async with trio.open_nursery() as nursery:
        async with admission.slot(1, "quiet"):  # the quiet tenant is active from here on
            pass
        for _ in range(6):
            nursery.start_soon(flood)
        await trio.testing.wait_all_tasks_blocked()
        assert (admission.in_flight, admission.waiting, admission.rejected) == (3, 2, 1)
        async with admission.slot(1, "quiet"):
            assert (admission.in_flight, admission.waiting, admission.rejected) == (4, 2, 1)
        nursery.cancel_scope.cancel()
    assert heard.refusals == [("other", "default", "queue_full")]
    assert [wait for _, _, wait in heard.waits] == [0] * 5


async def test_a_default_flood_leaves_room_to_a_priority_tenant_past_its_share(
        autojump_clock: trio.testing.MockClock) -> None:
    """Eight slots. A priority tenant holds five, past its share of four: a default flood
    still leaves it two free slots (the square root of five), so its next two start at once."""
    admission = Admission(config(8))
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(_hold, admission, "gold", "priority")
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(6):
            nursery.start_soon(_hold, admission, "flood", "default")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 6
        with trio.fail_after(0.001):
            async with admission.slot(1, "gold", "priority"), \
                    admission.slot(1, "gold", "priority"):
                assert admission.in_flight == 8
        nursery.cancel_scope.cancel()


async def test_how_long_flex_stays_out_follows_how_long_flex_requests_hold_their_slots(
        autojump_clock: trio.testing.MockClock) -> None:
    """Flex requests of 50 ms: the interactive peak is remembered for a fraction of a second
    (four holds, at least 250 ms), so two seconds after a burst of six ends flex takes all
    but the reserve and the one slot still held; were it remembered for seconds (as for
    flex requests of a second), it would take three."""
    admission = Admission(config(8, reserve=1))
    for _ in range(40):
        async with admission.slot(1, "batch", "flex"):
            await trio.sleep(0.05)
    async with trio.open_nursery() as nursery:
        burst = trio.CancelScope()

        async def six() -> None:
            with burst:
                async with trio.open_nursery() as inner:
                    for _ in range(5):
                        inner.start_soon(_hold, admission, "app", "default")

        nursery.start_soon(_hold, admission, "app", "default")
        nursery.start_soon(six)
        await trio.testing.wait_all_tasks_blocked()
        burst.cancel()
        await trio.sleep(2)
        for _ in range(10):
            nursery.start_soon(_hold, admission, "batch", "flex")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 7
        nursery.cancel_scope.cancel()
