"""The durable store's Trio shell: database calls on worker threads, and what this process caches.

Every call runs :mod:`.sql`'s blocking method on a worker thread under one
capacity limiter (as many threads as the store has connections), so the
event loop never waits on the database and the database never sees more
connections than that from this process. A call is not abandoned when its
caller is cancelled: a write that started commits, or fails, before the
caller hears of it.

:class:`Durable` is what the HTTP shell's stored responses and
conversations go through. A conversation's items this process has read or
written are cached with the number its next item gets, so a follow-up
reads only what others added since (nothing, on the common path), however
long the conversation is.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final, TypeVar

import msgspec
import trio

from direct_frontend.openai.conversations import Conversation
from direct_frontend.openai.response_store import Item, Lineage, StoredResponse
from direct_frontend.state.sql import Order, SqlStore, StoreError

log = logging.getLogger("direct_frontend.state")

_T = TypeVar("_T")
#: conversations whose items this process keeps in memory, the most recently used
CACHED_CONVERSATIONS: Final = 1024
_json: Final = msgspec.json.Decoder(dict[str, Any])
_encode: Final = msgspec.json.Encoder().encode


class Durable:
    """Stored responses and conversations in a database (see the module's text).

    ``ttl_s``: how long a response is kept; ``lease_s``: how long a running
    background response's row is believed without its process renewing it
    (then it is read as failed: its process died).
    """

    def __init__(self, sql: SqlStore[Any], *, ttl_s: float, lease_s: float,
                 conversation_ttl_s: float | None = None,
                 max_bytes_per_owner: int | None = None) -> None:
        self.sql = sql
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self.conversation_ttl_s = conversation_ttl_s
        self.max_bytes_per_owner = max_bytes_per_owner
        self.limiter = trio.CapacityLimiter(sql.connections)
        #: conversation id -> (owner, the number its next item gets, its items)
        self._items: OrderedDict[str, tuple[str, int, tuple[bytes, ...]]] = OrderedDict()

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await trio.to_thread.run_sync(partial(fn, *args), limiter=self.limiter)

    async def open(self) -> int:
        """Migrate the schema; the version it was at."""
        return await self._call(self.sql.migrate)

    async def close(self) -> None:
        await self._call(self.sql.close)

    # -- responses ------------------------------------------------------------------------
    async def put(self, record: StoredResponse, running: bool = False,
                  lineage: Lineage | None = None) -> bool:
        """Commit ``record`` (with its ``lineage``: only what it adds); False (logged) when
        the database refused it."""
        try:
            await self._call(self.sql.put_response, record, self.ttl_s,
                             self.lease_s if running else None, lineage)
        except StoreError as exc:
            log.warning("response %s not stored: %s", record.id, exc)
            return False
        return True

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """``owner``'s response; a running one whose process died reads as failed.

        Raises StoreError when the database cannot answer.
        """
        found = await self._call(self.sql.get_response, response_id, owner)
        if found is None:
            return None
        record, lost = found
        return lost_record(record) if lost else record

    async def has(self, response_id: str, owner: str) -> bool:
        return await self._call(self.sql.has_response, response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._call(self.sql.delete_response, response_id, owner)

    async def renew(self, response_ids: Sequence[str],
                    progress: Sequence[StoredResponse] = ()) -> list[str]:
        """Renew the leases of the background responses this process runs, writing the
        ``progress`` of some; those of them another process was asked to cancel."""
        if not response_ids:
            return []
        return await self._call(self.sql.renew, list(response_ids), self.lease_s,
                                list(progress))

    async def request_cancel(self, response_id: str, owner: str) -> bool:
        """Ask whichever process runs ``owner``'s background response to cancel it."""
        return await self._call(self.sql.request_cancel, response_id, owner)

    async def sweep(self) -> int:
        """One retention pass (see :meth:`SqlStore.sweep`)."""
        return await self._call(self.sql.sweep, self.conversation_ttl_s,
                                self.max_bytes_per_owner)

    # -- conversations --------------------------------------------------------------------
    async def create_conversation(self, conversation: Conversation,
                                  items: Sequence[Item]) -> None:
        await self._call(self.sql.create_conversation, conversation, items)
        self._remember(conversation.id, conversation.owner, len(items),
                       tuple(i.data for i in items))

    async def get_conversation(self, conversation_id: str, owner: str) -> Conversation | None:
        return await self._call(self.sql.get_conversation, conversation_id, owner)

    async def update_conversation(self, conversation_id: str, owner: str,
                                  metadata: bytes) -> Conversation | None:
        return await self._call(self.sql.update_conversation, conversation_id, owner, metadata)

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        self._items.pop(conversation_id, None)
        return await self._call(self.sql.delete_conversation, conversation_id, owner)

    async def add_items(self, conversation_id: str, owner: str,
                        items: Sequence[Item]) -> bool:
        """Append ``items``; False when the conversation is not ``owner``'s."""
        after = await self._call(self.sql.add_items, conversation_id, owner, items)
        if after is None:
            return False
        cached = self._items.get(conversation_id)
        if cached is not None and cached[0] == owner and cached[1] == after - len(items):
            self._remember(conversation_id, owner, after,
                           cached[2] + tuple(i.data for i in items))
        return True

    async def list_items(self, conversation_id: str, owner: str, after: str | None,
                         limit: int, order: Order) -> tuple[list[Item], bool] | None:
        return await self._call(self.sql.list_items, conversation_id, owner, after, limit,
                                order)

    async def get_item(self, conversation_id: str, owner: str,
                       item_id: str) -> Item | bool | None:
        return await self._call(self.sql.get_item, conversation_id, owner, item_id)

    async def delete_item(self, conversation_id: str, owner: str,
                          item_id: str) -> Conversation | bool | None:
        return await self._call(self.sql.delete_item, conversation_id, owner, item_id)

    async def history(self, conversation_id: str,
                      owner: str) -> tuple[int, tuple[bytes, ...]] | None:
        """All of ``owner``'s conversation's items, in order, and the number its next item
        will get; None: not ``owner``'s.

        What this process holds already is not read again: only items numbered
        from its cached count on, and all of them only when one was deleted.
        """
        cached = self._items.get(conversation_id)
        start = cached[1] if cached is not None and cached[0] == owner else 0
        found = await self._call(self.sql.items_since, conversation_id, owner, start)
        if found is None:
            self._items.pop(conversation_id, None)
            return None
        after, rows = found
        if start and [seq for seq, _ in rows] == list(range(start, after)):
            assert cached is not None
            items = cached[2] + tuple(data for _, data in rows) if rows else cached[2]
        elif start:  # an item left: read them all again
            found = await self._call(self.sql.items_since, conversation_id, owner, 0)
            if found is None:
                return None
            after, rows = found
            items = tuple(data for _, data in rows)
        else:
            items = tuple(data for _, data in rows)
        self._remember(conversation_id, owner, after, items)
        return after, items

    def _remember(self, conversation_id: str, owner: str, after: int,
                  items: tuple[bytes, ...]) -> None:
        self._items[conversation_id] = (owner, after, items)
        self._items.move_to_end(conversation_id)
        while len(self._items) > CACHED_CONVERSATIONS:
            self._items.popitem(last=False)


def lost_record(record: StoredResponse) -> StoredResponse:
    """A running background response whose process died, as it is read: failed."""
    response = _json.decode(record.response)
    response["status"] = "failed"
    response["error"] = {"code": "response_lost",
                         "message": "The process running this response stopped before it "
                                    "ended."}
    return msgspec.structs.replace(record, response=_encode(response), status="failed")
