"""A late replica's KV index from a sibling, and ours for a sibling that starts late.

A replica that starts while its siblings run asks one of them (a queue
group picks it) for its KV index before its engines start, and loads it
(control/kv_plane.py ``offer``): its first requests route on what the
engines already cache instead of starting cold. The sibling says yes, then
sends the index to the asker's inbox in chunks (kv/snapshot.py).
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # before nats, see cli.py

# isort: split
import logging
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from direct_frontend.control.bus import ChunkInbox, Link
from direct_frontend.kv.snapshot import decode_snapshot, encode_snapshot, split

if TYPE_CHECKING:
    from direct_frontend.control.kv_plane import KvPlane

log = logging.getLogger("direct_frontend.replicas")


class KvShare:
    """One replica's side of sharing ``kv``'s index with its siblings over ``link``;
    a late replica waits ``timeout_s`` at the most for a sibling's index."""

    def __init__(self, link: Link, kv: KvPlane, timeout_s: float) -> None:
        self.link = link
        self.kv = kv
        self.timeout_s = timeout_s

    async def serve(self, inbox: bytes, reply: str) -> None:
        """A late sibling asks: say yes, then send our index to its inbox in chunks."""
        if not reply:
            return
        data = encode_snapshot(self.kv.snapshot(self.link.replica))  # one synchronous look
        await self.link.publish(reply, b"ok")
        target = inbox.decode(errors="replace")
        for chunk in split(data):
            await self.link.publish(target, chunk)
        self.link.counts["snapshots_served"] += 1

    async def warm_start(self, nc: Any) -> str:
        """Ask one sibling over ``nc`` for its KV index and load it: how the index
        started (from whom), or why it starts cold."""
        import nats.errors

        timeout = self.timeout_s
        inbox = await ChunkInbox.open(nc)
        try:
            with trio.move_on_after(timeout) as scope:
                try:
                    await trio_asyncio.aio_as_trio(nc.request)(
                        self.link.subjects.snapshot, inbox.subject.encode(), timeout=timeout
                    )
                except nats.errors.NoRespondersError:
                    return "cold: no sibling to ask"
                except nats.errors.TimeoutError:
                    return "cold: no sibling answered"
                snapshot = decode_snapshot(await inbox.reassembled())
            if scope.cancelled_caught:
                return f"cold: the snapshot did not arrive within {timeout:g}s"
        except (ValueError, msgspec.DecodeError) as exc:
            return f"cold: a malformed snapshot ({exc})"
        finally:
            await inbox.close()
        refused = self.kv.offer(snapshot)
        if refused is not None:
            warm = f"refused {snapshot.replica}'s snapshot: {refused}"
            log.warning("replicas: %s", warm)
            return warm
        blocks = sum(len(rank) for rank in snapshot.ranks)
        warm = f"from {snapshot.replica}: {len(snapshot.ranks)} rank(s), {blocks} blocks"
        log.info("replicas: KV index warm %s", warm)
        return warm
