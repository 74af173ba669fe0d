"""A tenant's rate limits over HTTP: OpenAI's ``x-ratelimit-*`` headers (Anthropic's
``anthropic-ratelimit-*`` on the Messages API), and the 429 of a request over them.

The limits themselves are pipeline/ratelimit.py's. A request of a limited
tenant is admitted against them as soon as its prompt is tokenized, before
its admission slot and any engine (pipeline/serve.py); the headers describe
its limits just after it was taken, and go out with its response's head (a
stream's too). All of it is sans-IO: the caller gives the times.
"""

from __future__ import annotations

import datetime
import math

from direct_frontend.fleet.describe import JsonValue
from direct_frontend.fleet.schema import TenantsConfig
from direct_frontend.http.asgi import Headers
from direct_frontend.openai.errors import OpenAIHTTPError, rate_limit_exceeded
from direct_frontend.pipeline.ratelimit import RateLimiter, Refusal, Standing, Window

#: how each limit is named in a refusal's message, as OpenAI names it
_PER_MINUTE = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset headers write it (Go's duration format), rounded up to
    the millisecond: ``0s``, ``20ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h0m0s``."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{whole}" + (f".{fraction:03d}".rstrip("0") if fraction else "") + "s"


def openai_headers(standing: Standing) -> Headers:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (a limit the
    tenant does not have is left out)."""
    out: Headers = []
    for kind, window in (("requests", standing.requests), ("tokens", standing.tokens)):
        if window is not None:
            out += [(b"x-ratelimit-limit-" + kind.encode(), b"%d" % window.limit),
                    (b"x-ratelimit-remaining-" + kind.encode(), b"%d" % window.remaining),
                    (b"x-ratelimit-reset-" + kind.encode(), duration(window.reset_s).encode())]
    return out


def anthropic_headers(standing: Standing, wall_now: float) -> Headers:
    """Anthropic's ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}``; a
    reset is the time (RFC 3339, UTC, to the second) the limit is full again."""
    out: Headers = []
    for kind, window in (("requests", standing.requests), ("tokens", standing.tokens)):
        if window is not None:
            name = b"anthropic-ratelimit-" + kind.encode()
            out += [(name + b"-limit", b"%d" % window.limit),
                    (name + b"-remaining", b"%d" % window.remaining),
                    (name + b"-reset", _instant(wall_now + window.reset_s).encode())]
    return out


def _instant(wall: float) -> str:
    moment = datetime.datetime.fromtimestamp(math.ceil(wall), datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def headers_of(standing: Standing, *, anthropic: bool, wall_now: float) -> Headers:
    return anthropic_headers(standing, wall_now) if anthropic else openai_headers(standing)


def over_limit(refusal: Refusal, *, anthropic: bool, wall_now: float) -> OpenAIHTTPError:
    """The 429 of a request over its tenant's limit: OpenAI's body (Anthropic's
    ``rate_limit_error`` on the Messages API), ``retry-after`` in whole seconds (and
    ``retry-after-ms``, which the ``openai`` client prefers), and the limits' headers."""
    kind = refusal.kind
    window = refusal.standing.requests if kind == "requests" else refusal.standing.tokens
    assert window is not None
    setting = f"[frontend.tenants] {kind}_per_minute"
    headers = headers_of(refusal.standing, anthropic=anthropic, wall_now=wall_now)
    if refusal.retry_after_s is None:
        message = (f"Request too large on {_PER_MINUTE[kind]}: Limit {window.limit}, "
                   f"Requested {refusal.asked}. The prompt alone is more than this tenant's "
                   f"tokens for a minute ({setting}): send a shorter one.")
        return rate_limit_exceeded(message, kind, tuple(headers))
    wait = refusal.retry_after_s
    message = (f"Rate limit reached on {_PER_MINUTE[kind]}: Limit {window.limit}, "
               f"Remaining {window.remaining}, Requested {refusal.asked}. Please try again "
               f"in {duration(wait)} ({setting}).")
    retry = ((b"retry-after", b"%d" % max(1, math.ceil(wait - 1e-6))),
             (b"retry-after-ms", b"%d" % max(1, math.ceil(wait * 1000 - 1e-6))))
    return rate_limit_exceeded(message, kind, (*retry, *headers))


def view(limiter: RateLimiter, tenants: TenantsConfig, now: float) -> dict[str, JsonValue]:
    """``/fleet``'s view of the rate limits: buckets held, and each named tenant's limits
    as this process sees them now (what its siblings spent included, as far as heard)."""
    limiter.configure(tenants)
    named: dict[str, JsonValue] = {
        label: windows_json(limiter.standing(flow, now))
        for flow, label in limiter.table.named().items()}
    return {"buckets": len(limiter), "heard": limiter.heard_count, "tenants": named}


def windows_json(standing: Standing | None) -> JsonValue:
    """A tenant's limits for ``/fleet``: each limit's ``limit``, ``remaining``, ``reset_s``."""
    if standing is None:
        return None

    def one(window: Window | None) -> JsonValue:
        return None if window is None else {"limit": window.limit,
                                            "remaining": window.remaining,
                                            "reset_s": round(window.reset_s, 3)}

    return {"requests": one(standing.requests), "tokens": one(standing.tokens)}
