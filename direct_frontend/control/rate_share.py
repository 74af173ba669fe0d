"""Rate limits shared between processes: ``--workers`` and replicas over NATS.

Every process keeps its own buckets (pipeline/ratelimit.py) and decides
alone, at once: nothing a request does waits on NATS. What it spends it
tells its siblings on ``<cluster>.ratelimits`` (over the replica link's
connection, control/replicas.py, so the same credentials and namespace: a
worker's on its parent's private server), at most once per ``[frontend.
replicas] publish_interval_s``: the first spending after a quiet spell goes
at once, what follows within the interval waits for its end, all in one
message. A sibling takes what it hears out of its own buckets. Every
process's buckets thus hold the whole service's spending, less what was
spent elsewhere in about the last interval.

Approximate by design (README "Rate limits" says how far over a limit a
burst can get): what a sibling has spent but not yet told is spent again
here. Messages are deltas, not state: one that is lost (the link was down,
a publish failed) is never sent again, as news that old would take from
the buckets' current minute what was spent in an earlier one. While the
link is down each process limits alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import msgspec
import trio

from direct_frontend.control.replicas import ReplicaLink
from direct_frontend.fleet.schema import TenantsConfig
from direct_frontend.pipeline.ratelimit import RateLimiter

log = logging.getLogger("direct_frontend.replicas")

#: tenants per message (a flow is at most ~260 bytes: a message stays far below NATS's 1 MB)
FLOWS_PER_MESSAGE = 512


class Spent(msgspec.Struct, frozen=True):
    """What one process's tenants spent since its last message: (requests, tokens) by flow."""

    replica: str
    spent: dict[str, tuple[int, int]]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Spent).decode


def messages(replica: str, spent: dict[str, tuple[int, int]]) -> Iterator[bytes]:
    """``spent`` as messages of at most :data:`FLOWS_PER_MESSAGE` tenants each."""
    flows = list(spent.items())
    for start in range(0, len(flows), FLOWS_PER_MESSAGE):
        yield _encode(Spent(replica, dict(flows[start:start + FLOWS_PER_MESSAGE])))


def heard(data: bytes) -> Spent | None:
    """A sibling's message; None if it is not one."""
    try:
        return _decode(data)
    except (msgspec.DecodeError, ValueError):
        return None


class RateShare:
    """This process's side: tells what ``limiter`` spent, hears what its siblings spent.

    Made before the link runs (it subscribes to the subject as it connects);
    ``tenants`` reads the limits as they are now (a reload changes them).
    """

    def __init__(self, limiter: RateLimiter, link: ReplicaLink,
                 tenants: Callable[[], TenantsConfig]) -> None:
        self.limiter = limiter
        self.link = link
        self.tenants = tenants
        self.interval_s = link.config.publish_interval_s
        self.subject = f"{link.config.cluster}.ratelimits"
        self.counts = {"sent": 0, "heard": 0, "malformed": 0, "dropped": 0}
        self._wake = trio.Event()
        link.listen(self.subject, self._on_message)
        limiter.on_spend = self._on_spend

    def _on_spend(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Send what was spent, at most once per interval, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            spent = self.limiter.take_spent()
            for data in messages(self.link.replica, spent):
                if await self.link.publish(self.subject, data):
                    self.counts["sent"] += 1
                else:  # the link is down: news this old would be wrong when it is back
                    self.counts["dropped"] += 1
            await trio.sleep(self.interval_s)  # what is spent meanwhile goes in one message

    def _on_message(self, data: bytes) -> None:
        message = heard(data)
        if message is None:
            self.counts["malformed"] += 1
            log.debug("replicas: a malformed rate-limit message (skipped)")
            return
        if message.replica == self.link.replica:
            return
        self.counts["heard"] += 1
        self.limiter.configure(self.tenants())
        self.limiter.heard(message.spent, trio.current_time())
