"""Placing a new request, and waiting for an engine while none it may use serves (sans-IO).

A request that finds no engine it may use (to start, retry or migrate)
waits for one, bounded (:class:`EngineWait`), instead of failing at once:
engines restart, and a fleet reload brings new ones. The clock is passed in.
"""

from __future__ import annotations

from direct_frontend.errors import NoEngineAvailable
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    engine_timeout,
    no_engine_available,
    rate_limited,
)
from direct_frontend.pipeline.capable import incapable, none_capable
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.preprocess import PreparedRequest
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.policies import Placement


class EngineWait:
    """Whether a request that finds no engine it may use waits for one, and until when.

    A wait begins when the request finds none (to start, retry or migrate)
    and ends when it is placed; each lasts at most ``faults.wait_for_engine_s``
    of the request's settings (0: it never waits), and never past the
    request's deadline. Sans-IO: the clock is passed in.
    """

    __slots__ = ("deadline", "limit_s", "since", "until", "waits")

    def __init__(self, limit_s: float, deadline: float) -> None:
        self.limit_s = limit_s
        self.deadline = deadline
        self.until: float | None = None  # while a wait is under way: when it ends
        self.since = 0.0  # when it began
        self.waits = 0  # how many began

    def may_wait(self, now: float) -> bool:
        """No engine serves the request at ``now``: whether it waits (on) for one."""
        if self.until is None:
            if self.limit_s <= 0 or now >= self.deadline:
                return False
            self.until = min(now + self.limit_s, self.deadline)
            self.since = now
            self.waits += 1
        return now < self.until

    def placed(self) -> None:
        """The request has an engine: the wait (if any) is over."""
        self.until = None


def timed_out(settings: Settings) -> OpenAIHTTPError:
    """The 504 of a request still unanswered at its ``request_timeout_s``."""
    timeout = settings.frontend.request_timeout_s
    return engine_timeout(f"The request did not finish within {timeout:g} s.")


def all_saturated() -> OpenAIHTTPError:
    """The 429 of a request that every engine it tried refused as overloaded."""
    return rate_limited("Every engine is saturated; retry later.", retry_after=1)


def first_placement(
    dispatcher: Dispatcher, settings: Settings, prepared: PreparedRequest, wait: EngineWait,
    now: float,
) -> Placement | None:
    """Where a new request goes; None: no engine serves, and it waits (``wait.until``).

    A 503 when no engine serves and it may not wait (any more).
    """
    request = prepared.request
    catalog = dispatcher.fleet.catalog
    lacking = incapable(catalog, request)
    try:
        placement = dispatcher.choose(
            settings.policy, prepared.input_ids, request.max_tokens or 0, lacking,
            prepared.routing_key, prepared.media_keys,
        )
    except NoEngineAvailable:
        refusal = none_capable(catalog, lacking)
        if refusal is not None:
            raise refusal from None
        if wait.may_wait(now):
            return None
        raise no_engine_available(request.model) from None
    wait.placed()
    return placement
