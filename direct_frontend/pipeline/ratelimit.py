"""Per-tenant rate limits: requests and tokens per minute, as token buckets (sans-IO).

A tenant (its admission flow, http/identity.py) with a limit has a bucket per
limit: it holds at most one minute's allowance, and refills continuously at
the limit's rate (a 600-requests-per-minute tenant gets one back every
100 ms). A request takes one from the requests bucket, and its prompt's
tokens from the tokens bucket, when it is admitted (its prompt has just been
tokenized; nothing has reached an engine). Its output is taken when it ends,
whatever its end (streams, cancelled and failed requests included: what was
generated counts), so the tokens bucket can go below zero: the tenant then
owes it, and is refused until the refill has paid the debt back.

Why a token bucket, not a sliding window: its state is two numbers per
tenant, whatever the traffic (a window of timestamps grows with the
requests); what OpenAI's headers say falls out of it directly, ``remaining``
being the level and ``reset`` the time until it is full again; and what a
sibling process spent is simply taken out of it as it is heard (control/
rate_share.py), with no clocks to agree on. A bucket from idle allows a
burst of a whole minute's allowance at once, as OpenAI's limits do.

Every method takes the time (``now``, in seconds of a monotonic clock): the
object keeps no clock and does no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Literal, Protocol

from direct_frontend.fleet.schema import TenantsConfig

Kind = Literal["requests", "tokens"]
#: the metric's label of a tenant the fleet file does not name
UNNAMED = "other"
#: rounding room: a refill that is due may read 0.9999999 of what it is
_EPSILON = 1e-9
#: past this many buckets, those that are full again are dropped (they equal no bucket)
_SWEEP_FROM = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Rates:
    """One tenant's limits per minute (0: none)."""

    requests: int = 0
    tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.requests or self.tokens)


class RateTable:
    """Each tenant's rates by its flow, from ``[frontend.tenants]``: a named tenant's own
    where it gives them, else the defaults every tenant has."""

    def __init__(self, tenants: TenantsConfig) -> None:
        self.default = Rates(tenants.requests_per_minute, tenants.tokens_per_minute)
        self._named: dict[str, Rates] = {}
        self._labels: dict[str, str] = {}
        for tenant in tenants.tenant:
            self._named[tenant.flow] = Rates(
                self.default.requests if tenant.requests_per_minute is None
                else tenant.requests_per_minute,
                self.default.tokens if tenant.tokens_per_minute is None
                else tenant.tokens_per_minute,
            )
            self._labels[tenant.flow] = tenant.name or tenant.api_key_env or UNNAMED
        #: whether any tenant is limited at all (if not, nothing is looked up per request)
        self.limited = bool(self.default) or any(self._named.values())

    def rates(self, flow: str) -> Rates:
        return self._named.get(flow, self.default)

    def label(self, flow: str) -> str:
        """The tenant's name in the fleet file (a metric label: bounded), else ``other``."""
        return self._labels.get(flow, UNNAMED)

    def named(self) -> dict[str, str]:
        """Each named tenant's label by its flow."""
        return dict(self._labels)


@dataclasses.dataclass(slots=True)
class _Bucket:
    level: float
    at: float

    def refill(self, now: float, capacity: int) -> None:
        """Refilled up to ``now`` (``capacity`` a minute), never past ``capacity``."""
        if now > self.at:
            self.level += (now - self.at) * capacity / 60.0
            self.at = now
        self.level = min(self.level, float(capacity))


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """One limit as the headers tell it: the limit, what is left of it now (whole units,
    never below 0), and the seconds until the bucket is full again."""

    limit: int
    remaining: int
    reset_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Standing:
    """A tenant's limits as they stand (``None``: that one is not limited)."""

    requests: Window | None
    tokens: Window | None


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Not admitted: the limit it is over, how much it asked of it (1 request, or its
    prompt's tokens), and when asking again can succeed (``None``: never, the prompt alone
    is more than a minute's tokens)."""

    kind: Kind
    asked: int
    retry_after_s: float | None
    standing: Standing


class RateLimited(Exception):
    """A request over its tenant's limit: the refusal, and the tenant's label (a configured
    name, else ``other``). Its answer (a 429 in the API's shape) is the HTTP shell's."""

    def __init__(self, refusal: Refusal, label: str) -> None:
        super().__init__(f"over the {refusal.kind} limit of {label}")
        self.refusal = refusal
        self.label = label


class Counted(Protocol):
    """A choice's output as it is counted (pipeline/postprocess.py ``OutputProcessor``)."""

    @property
    def completion_tokens(self) -> int: ...


class RateLimiter:
    """Every limited tenant's buckets in this process, and what it spent that its siblings
    have not been told of yet.

    ``configure`` gives it the fleet file's ``[frontend.tenants]`` (a reload
    keeps the buckets: a changed limit applies to the level they have).
    ``on_spend`` hears that something was spent (the sharing task wakes);
    without it nothing is kept for siblings.
    """

    def __init__(self, tenants: TenantsConfig | None = None) -> None:
        self._config = TenantsConfig() if tenants is None else tenants
        self.table = RateTable(self._config)
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        #: spent here since the last :meth:`take_spent`: [requests, tokens] per flow
        self._spent: dict[str, list[int]] = {}
        self._sweep_at = _SWEEP_FROM
        self.on_spend: Callable[[], None] | None = None
        self.heard_count = 0  # sibling reports applied (``/fleet`` shows it)

    def configure(self, tenants: TenantsConfig) -> None:
        """The tenants and their rates from now on (a cheap no-op when unchanged)."""
        if tenants is self._config:
            return
        if tenants != self._config:
            self.table = RateTable(tenants)
        self._config = tenants

    @property
    def limited(self) -> bool:
        return self.table.limited

    def __len__(self) -> int:
        """Buckets held (a tenant with both limits has two)."""
        return len(self._requests) + len(self._tokens)

    # -- deciding --------------------------------------------------------------------------

    def admit(self, flow: str, prompt_tokens: int, now: float) -> Standing | Refusal | None:
        """Take one request and ``prompt_tokens`` from ``flow``'s buckets, if both have them.

        The tokens bucket must hold the prompt, and at least one token (a
        request generates one): a tenant in debt is refused whatever it asks.
        ``None``: the tenant is not limited (nothing is kept for it).
        """
        rates = self.table.rates(flow)
        if not rates:
            return None
        requests = self._bucket(self._requests, flow, rates.requests, now)
        tokens = self._bucket(self._tokens, flow, rates.tokens, now)
        if requests is not None and requests.level + _EPSILON < 1:
            return Refusal("requests", 1, _seconds_to(1 - requests.level, rates.requests),
                           self._standing(flow, rates, now))
        if tokens is not None:
            need = max(prompt_tokens, 1)
            if need > rates.tokens:
                return Refusal("tokens", prompt_tokens, None, self._standing(flow, rates, now))
            if tokens.level + _EPSILON < need:
                return Refusal("tokens", prompt_tokens,
                               _seconds_to(need - tokens.level, rates.tokens),
                               self._standing(flow, rates, now))
        if requests is not None:
            requests.level -= 1
        if tokens is not None:
            tokens.level -= prompt_tokens
        self._spend(flow, 1 if requests is not None else 0,
                    prompt_tokens if tokens is not None else 0)
        return self._standing(flow, rates, now)

    def settle(self, flow: str, output_tokens: int, now: float) -> None:
        """A request of ``flow`` ended having generated ``output_tokens``: they are taken."""
        rates = self.table.rates(flow)
        if output_tokens <= 0 or not rates.tokens:
            return
        bucket = self._bucket(self._tokens, flow, rates.tokens, now)
        assert bucket is not None
        bucket.level -= output_tokens
        self._spend(flow, 0, output_tokens)

    def standing(self, flow: str, now: float) -> Standing | None:
        """``flow``'s limits as they stand now; ``None`` if it has none."""
        rates = self.table.rates(flow)
        return self._standing(flow, rates, now) if rates else None

    # -- sharing with sibling processes (control/rate_share.py) ------------------------------

    def take_spent(self) -> dict[str, tuple[int, int]]:
        """What this process spent since the last call, (requests, tokens) per flow."""
        spent, self._spent = self._spent, {}
        return {flow: (requests, tokens) for flow, (requests, tokens) in spent.items()}

    def heard(self, spent: Mapping[str, tuple[int, int]], now: float) -> None:
        """A sibling spent this: it comes out of our buckets too (never told on)."""
        self.heard_count += 1
        for flow, (requests, tokens) in spent.items():
            rates = self.table.rates(flow)
            if requests > 0 and rates.requests:
                bucket = self._bucket(self._requests, flow, rates.requests, now)
                assert bucket is not None
                bucket.level -= requests
            if tokens > 0 and rates.tokens:
                bucket = self._bucket(self._tokens, flow, rates.tokens, now)
                assert bucket is not None
                bucket.level -= tokens

    # -- the buckets ------------------------------------------------------------------------

    def _spend(self, flow: str, requests: int, tokens: int) -> None:
        """Note what was spent for the siblings (only while something shares it)."""
        if not (requests or tokens) or self.on_spend is None:
            return
        spent = self._spent.get(flow)
        if spent is None:
            self._spent[flow] = [requests, tokens]
        else:
            spent[0] += requests
            spent[1] += tokens
        if self.on_spend is not None:
            self.on_spend()

    def _bucket(self, buckets: dict[str, _Bucket], flow: str, capacity: int,
                now: float) -> _Bucket | None:
        """``flow``'s bucket refilled to ``now`` (a new one is full); ``None`` when
        ``capacity`` is 0 (no limit)."""
        if not capacity:
            return None
        bucket = buckets.get(flow)
        if bucket is None:
            if len(self) >= self._sweep_at:
                self._sweep(now)
            bucket = buckets[flow] = _Bucket(float(capacity), now)
        else:
            bucket.refill(now, capacity)
        return bucket

    def _sweep(self, now: float) -> None:
        """Drop the buckets that are full again (or no longer limited): a full bucket is
        what a new one is, so the buckets kept are the tenants that spent in the last
        minute, and the next sweep waits until there are twice as many."""
        for buckets, kind in ((self._requests, 0), (self._tokens, 1)):
            for flow in list(buckets):
                rates = self.table.rates(flow)
                capacity = rates.requests if kind == 0 else rates.tokens
                bucket = buckets[flow]
                if capacity:
                    bucket.refill(now, capacity)
                if not capacity or bucket.level >= capacity:
                    del buckets[flow]
        self._sweep_at = max(_SWEEP_FROM, 2 * len(self))

    def _standing(self, flow: str, rates: Rates, now: float) -> Standing:
        return Standing(_window(self._requests.get(flow), rates.requests, now),
                        _window(self._tokens.get(flow), rates.tokens, now))


def _window(bucket: _Bucket | None, capacity: int, now: float) -> Window | None:
    if not capacity:
        return None
    if bucket is None:
        return Window(capacity, capacity, 0.0)
    bucket.refill(now, capacity)
    return Window(capacity, max(0, math.floor(bucket.level + _EPSILON)),
                  _seconds_to(capacity - bucket.level, capacity))


def _seconds_to(amount: float, per_minute: int) -> float:
    """Seconds until a bucket of ``per_minute`` refills ``amount`` (0 if nothing is due)."""
    return max(0.0, amount) * 60.0 / per_minute


class Charge:
    """What one admitted request still owes its tenant's tokens limit: the output of each
    of its choices (``watch``), taken once, when it ends (``settle``)."""

    __slots__ = ("_limiter", "_outputs", "_settled", "flow")

    def __init__(self, limiter: RateLimiter, flow: str) -> None:
        self._limiter = limiter
        self.flow = flow
        self._outputs: list[Counted] = []
        self._settled = False

    def watch(self, output: Counted) -> None:
        """Count ``output`` (a choice's, as the relay counts it) when the request ends."""
        self._outputs.append(output)

    def settle(self, now: float) -> int:
        """Take every watched output's tokens from the tenant's bucket (once); how many."""
        if self._settled:
            return 0
        self._settled = True
        tokens = sum(output.completion_tokens for output in self._outputs)
        self._limiter.settle(self.flow, tokens, now)
        return tokens


def take(limiter: RateLimiter, tenants: TenantsConfig, flow: str, prompt_tokens: int,
         now: float) -> tuple[Charge | None, Standing | None]:
    """Admit a request of ``flow`` whose prompt is ``prompt_tokens`` against its limits.

    The :class:`Charge` to settle when it ends and its limits just after it
    was taken; ``(None, None)`` when its tenant has no limit (nothing was
    kept). Raises :class:`RateLimited` when it is over one.
    """
    limiter.configure(tenants)
    if not limiter.limited:
        return None, None
    verdict = limiter.admit(flow, prompt_tokens, now)
    if verdict is None:
        return None, None
    if isinstance(verdict, Refusal):
        raise RateLimited(verdict, limiter.table.label(flow))
    return Charge(limiter, flow), verdict
