"""Rate limits shared between processes: the messages on their own, and two links over a
real nats-server, each taking what the other spent out of its own buckets."""

from __future__ import annotations

import msgspec
import trio

from direct_frontend.control.rate_share import (
    FLOWS_PER_MESSAGE,
    RateShare,
    Spent,
    heard,
    messages,
)
from direct_frontend.fleet.schema import TenantsConfig
from direct_frontend.pipeline.ratelimit import RateLimiter, Refusal, Standing
from tests.control.test_replica_link import _config, _link, _on_loop, password, server
from tests.support.nats import NatsServer
from tests.support.sim import until_trio

__all__ = ["password", "server"]  # the fixtures, shared with the replica link's tests


def test_spending_goes_in_messages_of_a_bounded_number_of_tenants() -> None:
    spent = {f"k{n}": (1, n) for n in range(FLOWS_PER_MESSAGE + 3)}
    sent = [heard(data) for data in messages("w0", spent)]
    assert [len(m.spent) for m in sent if m is not None] == [FLOWS_PER_MESSAGE, 3]
    assert {flow: tuple(v) for m in sent if m is not None for flow, v in m.spent.items()} == spent
    assert list(messages("w0", {})) == []
    assert heard(b"\x01garbage") is None
    wrong = msgspec.msgpack.encode(Spent("w1", {}))[:-1] + b"\xc3"  # spent: not a map
    assert heard(wrong) is None


def test_two_processes_take_what_the_other_spent(server: NatsServer, password: str) -> None:
    tenants = TenantsConfig(requests_per_minute=6, tokens_per_minute=600)

    async def body() -> None:
        config = _config(server, cluster="rl", publish_interval_s=0.02)
        ours, theirs = _link(config, "a"), _link(config, "b")
        here, there = RateLimiter(tenants), RateLimiter(tenants)
        mine = RateShare(here, ours, lambda: tenants)
        sibling = RateShare(there, theirs, lambda: tenants)
        async with trio.open_nursery() as nursery:
            for link in (ours, theirs):
                await nursery.start(link.run)
            for share in (mine, sibling):
                nursery.start_soon(share.run)
            now = trio.current_time()
            for _ in range(4):
                assert isinstance(there.admit("k", 100, now), Standing)
            there.settle("k", 150, now)
            await until_trio(lambda: sibling.counts["sent"] >= 1 and mine.counts["heard"] >= 1,
                             what="the spending told and heard")
            await until_trio(lambda: here.standing("k", trio.current_time()).requests
                             .remaining <= 2, what="all of it heard")
            standing = here.standing("k", trio.current_time())
            assert standing is not None and standing.requests is not None
            assert standing.requests.remaining == 2  # 6 less the sibling's 4 (a refill is 10 s)
            assert standing.tokens is not None and standing.tokens.remaining <= 600 - 550 + 5
            assert isinstance(here.admit("k", 100, trio.current_time()), Refusal)  # 50 left
            assert here.take_spent() == {}  # a refusal spends nothing, and nothing echoes back
            assert mine.counts["sent"] == 0 and sibling.counts["heard"] == 0
            theirs_now = there.standing("k", trio.current_time())
            assert theirs_now is not None and theirs_now.requests is not None
            assert theirs_now.requests.remaining == 2  # its own spending, nothing echoed back
            nursery.cancel_scope.cancel()

    _on_loop(body)
