"""The rate limiter on its own: plain values, and time as a number the test moves."""

from __future__ import annotations

import dataclasses

import pytest

from direct_frontend.fleet.schema import TenantConfig, TenantsConfig
from direct_frontend.pipeline.ratelimit import (
    Charge,
    RateLimited,
    RateLimiter,
    Refusal,
    Standing,
    Window,
    take,
)


def limiter(requests: int = 0, tokens: int = 0, *named: TenantConfig) -> RateLimiter:
    return RateLimiter(TenantsConfig(requests_per_minute=requests, tokens_per_minute=tokens,
                                     tenant=named))


def admitted(verdict: Standing | Refusal | None) -> Standing:
    assert isinstance(verdict, Standing), verdict
    return verdict


def refused(verdict: Standing | Refusal | None) -> Refusal:
    assert isinstance(verdict, Refusal), verdict
    return verdict


def test_a_tenant_without_limits_is_not_kept() -> None:
    rates = limiter()
    assert not rates.limited
    assert rates.admit("a", 10_000, 0.0) is None
    rates.settle("a", 10_000, 0.0)
    assert len(rates) == 0 and rates.take_spent() == {}


def test_requests_per_minute_admit_a_minutes_worth_then_refill_one_at_a_time() -> None:
    rates = limiter(requests=60)
    for k in range(60):
        standing = admitted(rates.admit("a", 5, 0.0))
        assert standing.requests == Window(60, 59 - k, (k + 1) * 1.0)
        assert standing.tokens is None  # not limited: not told
    over = refused(rates.admit("a", 5, 0.0))
    assert (over.kind, over.asked, over.retry_after_s) == ("requests", 1, 1.0)
    assert over.standing.requests == Window(60, 0, 60.0)
    assert isinstance(rates.admit("a", 5, 0.5), Refusal)  # half a request back: not enough
    assert admitted(rates.admit("a", 5, 1.0)).requests == Window(60, 0, 60.0)
    assert isinstance(rates.admit("a", 5, 1.0), Refusal)
    # another tenant has buckets of its own
    assert admitted(rates.admit("b", 5, 1.0)).requests == Window(60, 59, 1.0)


def test_the_prompt_is_taken_at_admission_and_the_output_when_it_ends() -> None:
    rates = limiter(tokens=600)  # 10 tokens a second
    assert admitted(rates.admit("a", 100, 0.0)).tokens == Window(600, 500, 10.0)
    rates.settle("a", 450, 0.0)
    assert rates.standing("a", 0.0) == Standing(None, Window(600, 50, 55.0))
    over = refused(rates.admit("a", 60, 0.0))  # 50 left, 60 asked: 1 s of refill short
    assert (over.kind, over.asked, over.retry_after_s) == ("tokens", 60, 1.0)
    assert admitted(rates.admit("a", 60, 1.0)).tokens == Window(600, 0, 60.0)


def test_output_beyond_what_is_left_is_a_debt_that_refuses_until_repaid() -> None:
    rates = limiter(tokens=600)
    admitted(rates.admit("a", 100, 0.0))
    rates.settle("a", 800, 0.0)  # 300 more than the bucket held
    debt = refused(rates.admit("a", 0, 0.0))  # a request generates one token at least
    assert debt.retry_after_s == pytest.approx(30.1)
    assert debt.standing.tokens == Window(600, 0, 90.0)
    assert isinstance(rates.admit("a", 0, 30.0), Refusal)
    assert admitted(rates.admit("a", 0, 30.1)).tokens == Window(600, 1, 59.9)


def test_a_prompt_larger_than_a_minute_of_tokens_is_refused_for_good() -> None:
    rates = limiter(tokens=100)
    never = refused(rates.admit("a", 101, 0.0))
    assert (never.kind, never.asked, never.retry_after_s) == ("tokens", 101, None)
    assert admitted(rates.admit("a", 100, 0.0)).tokens == Window(100, 0, 60.0)


def test_both_limits_must_have_room_and_a_refusal_takes_nothing() -> None:
    rates = limiter(requests=2, tokens=100)
    admitted(rates.admit("a", 90, 0.0))
    assert refused(rates.admit("a", 20, 0.0)).kind == "tokens"
    assert refused(rates.admit("a", 20, 0.0)).standing == Standing(
        Window(2, 1, 30.0), Window(100, 10, 54.0))
    admitted(rates.admit("a", 10, 0.0))
    assert refused(rates.admit("a", 0, 0.0)).kind == "requests"
    assert rates.take_spent() == {}  # nobody shares it: nothing is kept for siblings


def test_a_named_tenant_has_its_own_limits_and_zero_lifts_the_default() -> None:
    vip = TenantConfig(name="vip", flow="h:vip", requests_per_minute=0, tokens_per_minute=50)
    batch = TenantConfig(name="batch", flow="h:batch")
    rates = limiter(1, 0, vip, batch)
    assert admitted(rates.admit("h:vip", 10, 0.0)).requests is None
    assert admitted(rates.admit("h:vip", 10, 0.0)).tokens == Window(50, 30, 24.0)
    admitted(rates.admit("h:batch", 10, 0.0))  # the defaults: one request a minute
    assert refused(rates.admit("h:batch", 10, 0.0)).kind == "requests"
    assert rates.table.label("h:vip") == "vip" and rates.table.label("h:else") == "other"


def test_a_reload_keeps_the_levels_and_applies_the_new_limits_to_them() -> None:
    rates = limiter(requests=10)
    for _ in range(8):
        admitted(rates.admit("a", 1, 0.0))
    rates.configure(TenantsConfig(requests_per_minute=4))
    assert rates.standing("a", 0.0) == Standing(Window(4, 2, 30.0), None)
    rates.configure(TenantsConfig(requests_per_minute=100))  # a higher limit refills faster
    assert rates.standing("a", 0.6) == Standing(Window(100, 3, 58.2), None)
    rates.configure(TenantsConfig())
    assert rates.admit("a", 1, 1.0) is None


def test_what_a_sibling_spent_comes_out_of_our_buckets_and_is_not_told_on() -> None:
    here, there = limiter(requests=10, tokens=1000), limiter(requests=10, tokens=1000)
    woken: list[int] = []
    here.on_spend = there.on_spend = lambda: woken.append(1)
    for _ in range(6):
        admitted(there.admit("a", 100, 0.0))
    there.settle("a", 50, 0.0)
    assert len(woken) == 7
    spent = there.take_spent()
    assert spent == {"a": (6, 650)} and there.take_spent() == {}
    here.heard(spent, 0.0)
    assert here.standing("a", 0.0) == Standing(Window(10, 4, 36.0), Window(1000, 350, 39.0))
    assert here.take_spent() == {}  # heard, not spent here: never echoed back
    assert refused(here.admit("a", 400, 0.0)).kind == "tokens"
    here.heard({"b": (0, 0), "c": (-5, -5)}, 0.0)  # nothing, or nonsense: no bucket
    assert here.standing("c", 0.0) == Standing(Window(10, 10, 0.0), Window(1000, 1000, 0.0))


def test_buckets_full_again_are_dropped_once_there_are_many() -> None:
    rates = limiter(requests=60)
    for k in range(64):
        admitted(rates.admit(f"t{k}", 1, 0.0))
    assert len(rates) == 64
    admitted(rates.admit("late", 1, 0.5))  # the others are not full yet: all kept
    assert len(rates) == 65
    for k in range(65, 130):
        admitted(rates.admit(f"t{k}", 1, 10.0))  # the first 65 are full again by 1.5
    assert len(rates) == 65  # swept once at 128: only the 65 that spent at 10.0 remain
    assert rates.standing("t0", 10.0) == Standing(Window(60, 60, 0.0), None)


def test_a_charge_settles_every_choice_once() -> None:
    @dataclasses.dataclass
    class Output:
        completion_tokens: int

    rates = limiter(tokens=600)
    admitted(rates.admit("a", 100, 0.0))
    charge = Charge(rates, "a")
    first, second = Output(0), Output(0)
    charge.watch(first)
    charge.watch(second)
    first.completion_tokens, second.completion_tokens = 30, 20  # counted as they come
    assert charge.settle(0.0) == 50
    assert charge.settle(0.0) == 0
    assert rates.standing("a", 0.0) == Standing(None, Window(600, 450, 15.0))


def test_take_charges_a_limited_tenant_and_raises_over_its_limit() -> None:
    tenants = TenantsConfig(requests_per_minute=2)
    rates = RateLimiter()
    charge, standing = take(rates, tenants, "k1", 7, 0.0)
    assert isinstance(charge, Charge) and charge.flow == "k1"
    assert standing is not None and standing.requests == Window(2, 1, 30.0)
    take(rates, tenants, "k1", 7, 0.0)
    with pytest.raises(RateLimited) as over:
        take(rates, tenants, "k1", 7, 0.0)
    assert over.value.label == "other" and over.value.refusal.kind == "requests"
    assert over.value.refusal.retry_after_s == 30.0
    # a tenant without limits: nothing kept
    assert take(rates, TenantsConfig(), "k1", 7, 0.0) == (None, None)
    assert len(rates) == 1
