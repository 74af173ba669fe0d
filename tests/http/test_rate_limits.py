"""Rate limits as the client sees them: OpenAI's and Anthropic's headers, and the 429."""

from __future__ import annotations

import json

import pytest

from direct_frontend.fleet.schema import TenantConfig, TenantsConfig
from direct_frontend.http.asgi import Headers
from direct_frontend.http.rate_limits import (
    anthropic_headers,
    duration,
    openai_headers,
    over_limit,
    view,
)
from direct_frontend.openai.errors import error_body
from direct_frontend.openai.messages_api import anthropic_error_body
from direct_frontend.pipeline.ratelimit import RateLimiter, Refusal, Standing, Window


@pytest.mark.parametrize(("seconds", "shown"), [
    (0.0, "0s"), (-1.0, "0s"), (0.0004, "1ms"), (0.02, "20ms"), (0.999, "999ms"),
    (0.9991, "1s"), (1.0, "1s"), (1.5, "1.5s"), (8.64, "8.64s"), (59.9999, "1m0s"),
    (60.0, "1m0s"), (360.0, "6m0s"), (61.25, "1m1.25s"), (3600.0, "1h0m0s"),
    (3725.5, "1h2m5.5s"),
])
def test_durations_are_written_as_openai_writes_them(seconds: float, shown: str) -> None:
    assert duration(seconds) == shown


def _names(headers: Headers) -> dict[str, str]:
    return {name.decode(): value.decode() for name, value in headers}


def test_openai_headers_name_each_limit_the_tenant_has() -> None:
    both = Standing(Window(60, 59, 1.0), Window(150000, 149984, 0.0064))
    assert _names(openai_headers(both)) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s", "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149984", "x-ratelimit-reset-tokens": "7ms",
    }
    assert _names(openai_headers(Standing(None, Window(10, 0, 360.0)))) == {
        "x-ratelimit-limit-tokens": "10", "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6m0s"}


def test_anthropic_headers_give_the_instant_a_limit_is_full_again() -> None:
    standing = Standing(Window(50, 49, 1.2), Window(1000, 1000, 0.0))
    assert _names(anthropic_headers(standing, 1_700_000_000.5)) == {
        "anthropic-ratelimit-requests-limit": "50",
        "anthropic-ratelimit-requests-remaining": "49",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:22Z",  # 1.7e9 + 1.7, rounded up
        "anthropic-ratelimit-tokens-limit": "1000",
        "anthropic-ratelimit-tokens-remaining": "1000",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:21Z",
    }


def test_a_refusal_is_openais_429_with_retry_after_and_the_limits() -> None:
    refusal = Refusal("tokens", 600, 2.25, Standing(Window(10, 9, 6.0), Window(1000, 400, 36.0)))
    err = over_limit(refusal, anthropic=False, wall_now=0.0)
    assert err.status == 429
    body = json.loads(error_body(err))["error"]
    assert (body["type"], body["param"], body["code"]) == ("tokens", None, "rate_limit_exceeded")
    assert body["message"] == (
        "Rate limit reached on tokens per min (TPM): Limit 1000, Remaining 400, Requested 600. "
        "Please try again in 2.25s ([frontend.tenants] tokens_per_minute).")
    headers = _names(list(err.headers))
    assert headers["retry-after"] == "3" and headers["retry-after-ms"] == "2250"
    assert headers["x-ratelimit-remaining-tokens"] == "400"
    assert headers["x-ratelimit-reset-requests"] == "6s"

    on_messages = over_limit(refusal, anthropic=True, wall_now=0.0)
    assert json.loads(anthropic_error_body(on_messages)) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": body["message"]}}
    headers = _names(list(on_messages.headers))
    assert headers["retry-after"] == "3"
    assert headers["anthropic-ratelimit-tokens-reset"] == "1970-01-01T00:00:36Z"
    assert not any(name.startswith("x-ratelimit") for name in headers)


def test_a_prompt_no_minute_can_hold_is_refused_without_a_retry() -> None:
    refusal = Refusal("tokens", 1200, None, Standing(None, Window(1000, 1000, 0.0)))
    err = over_limit(refusal, anthropic=False, wall_now=0.0)
    assert err.type == "tokens" and "retry-after" not in _names(list(err.headers))
    assert err.message.startswith("Request too large on tokens per min (TPM): Limit 1000, "
                                  "Requested 1200.")


def test_fleet_view_shows_each_named_tenants_limits() -> None:
    tenants = TenantsConfig(requests_per_minute=2, tenant=(
        TenantConfig(name="team-a", flow="flow-a"),))
    limiter = RateLimiter(tenants)
    limiter.admit("flow-a", 7, 0.0)
    shown = view(limiter, tenants, 0.0)
    assert shown == {"buckets": 1, "heard": 0, "tenants": {"team-a": {
        "requests": {"limit": 2, "remaining": 1, "reset_s": 30.0}, "tokens": None}}}
