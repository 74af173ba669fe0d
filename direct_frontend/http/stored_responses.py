"""``/v1/responses/{id}``: retrieve, delete, cancel and list the input items of a response.

With a database behind the store (``[frontend.responses] backend``), a
response is there before its id is answered, and any process reads it from
there. In memory, a response is held by the process that answered it (its
id says which, openai/response_store.py). One this process does not hold is
asked of that sibling over the replica link, so a client whose follow-up
lands on another worker or replica still finds it; a sibling that is gone
took its responses with it, and the answer is OpenAI's "not found". Every call names the owner
asking (http/identity.py): another owner's response is "not found" too, here
and at the sibling, so existence never leaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec
import trio

from direct_frontend.http.asgi import JSON, Headers, Send, encode_json, log, send_body
from direct_frontend.http.query import list_page
from direct_frontend.openai import lists
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    invalid_request,
    not_cancellable,
    response_not_found,
    store_unavailable,
)
from direct_frontend.openai.response_store import (
    CANCELLED,
    NOT_BACKGROUND,
    DurableResponses,
    Item,
    Lineage,
    RemoteResponses,
    ResponseStore,
    StoredResponse,
    holder_of,
)
from direct_frontend.state.sql import StoreError

#: ``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
RESPONSE_PATH: Final = "/v1/responses/"
INPUT_ITEMS: Final = "/input_items"
#: ``POST /v1/responses/{id}/cancel``
CANCEL: Final = "/cancel"
#: a cancel of a response another process runs asks the database this often whether it ended
CANCEL_WAIT_POLL_S: Final = 0.25


class _ItemId(msgspec.Struct):
    id: str | None = None


_item_id: Final = msgspec.json.Decoder(_ItemId)


def _sibling(store: ResponseStore, response_id: str) -> tuple[RemoteResponses, str] | None:
    """The link to the sibling whose id this is, and its holder tag; None if it is ours."""
    holder = holder_of(response_id)
    if store.remote is None or holder is None or holder == store.holder:
        return None
    return store.remote, holder


def unavailable(exc: StoreError) -> OpenAIHTTPError:
    """The 503 of a database that did not answer; why is logged."""
    log.warning("the store did not answer: %s", exc)
    return store_unavailable()


async def find(store: ResponseStore, response_id: str, owner: str) -> StoredResponse | None:
    """``owner``'s stored response: this process's, else the database's (if the store has
    one), else its holder's (a sibling), else None.

    A cached record is confirmed in the database first (one indexed read,
    however long its history), so a delete by another process is seen.
    """
    durable = store.durable
    if durable is None:
        record = store.get(response_id, owner)
        if record is None and (sibling := _sibling(store, response_id)) is not None:
            remote, holder = sibling
            record = await remote.fetch(holder, response_id, owner)
        return record
    live = None if store.running is None else store.running.record(response_id)
    if live is not None:
        return live if live.owner == owner else None
    try:
        record = store.get(response_id, owner)
        if record is not None:
            if await durable.has(response_id, owner):
                return record
            store.delete(response_id, owner)
            return None
        record = await durable.get(response_id, owner)
    except StoreError as exc:
        raise unavailable(exc) from None
    if record is not None and not record.running:
        store.put(record)
    return record


async def keep(store: ResponseStore, record: StoredResponse, running: bool = False,
               lineage: Lineage | None = None) -> bool:
    """Store ``record`` (``lineage``: where its history came from): committed to the
    database (if the store has one) before this returns, then cached; False when it was not
    stored (the answer must say so)."""
    durable = store.durable
    if durable is None:  # a running record is seen live (store.running), not kept
        return running or store.put(record)
    if not await durable.put(record, running, lineage):
        return False
    if not running:
        store.put(record)  # the cache: a record too large for it is still stored
    return True


async def append_turn(store: ResponseStore, conversation: str | None,
                      items: Sequence[dict[str, Any]], owner: str) -> None:
    """Add a response's input and output ``items`` to ``owner``'s ``conversation`` (if the
    request named one); committed before this returns. A conversation deleted meanwhile
    takes nothing; a database that fails is logged (the response itself is answered)."""
    target = store.conversations
    if conversation is None or target is None:
        return
    try:
        await target.add_items(conversation, owner,
                               [Item(item["id"], encode_json(item)) for item in items])
    except StoreError as exc:
        log.warning("conversation %s: a turn's items were not added: %s", conversation, exc)


async def respond_retrieve(store: ResponseStore, response_id: str, owner: str, send: Send,
                           headers: Headers) -> int:
    record = await find(store, response_id, owner)
    if record is None:
        raise response_not_found(response_id)
    await send_body(send, 200, record.response, JSON, headers)
    return 200


async def respond_delete(store: ResponseStore, response_id: str, owner: str, send: Send,
                         headers: Headers) -> int:
    deleted = store.delete(response_id, owner)
    if store.durable is not None:
        try:
            deleted = await store.durable.delete(response_id, owner) or deleted
        except StoreError as exc:
            raise unavailable(exc) from None
    elif not deleted and (sibling := _sibling(store, response_id)) is not None:
        remote, holder = sibling
        deleted = await remote.delete(holder, response_id, owner)
    if not deleted:
        raise response_not_found(response_id)
    body = b'{"id":%b,"object":"response.deleted","deleted":true}' % msgspec.json.encode(
        response_id)
    await send_body(send, 200, body, JSON, headers)
    return 200


async def respond_cancel(store: ResponseStore, response_id: str, owner: str, send: Send,
                         headers: Headers) -> int:
    """Cancel a background response; the Response as it ended (a second cancel: the same).

    A response that was not run in the background is a 400, as OpenAI's is.
    With a database, one running in another process is asked to stop there
    (its process reads the request as it renews its lease) and answered once
    it has ended, or once its lease ran out: its process died.
    """
    answer = await store.cancel(response_id, owner)
    if answer is None and (sibling := _sibling(store, response_id)) is not None:
        remote, holder = sibling
        answer = await remote.cancel(holder, response_id, owner)
    if answer is None and store.durable is not None:  # not running here
        stored = await find(store, response_id, owner)
        if stored is not None and stored.background and stored.running:
            await _cancel_elsewhere(store, store.durable, response_id, owner)
        if stored is not None:
            answer = CANCELLED if stored.background else NOT_BACKGROUND
    if answer == NOT_BACKGROUND:
        raise not_cancellable(response_id)
    record = None if answer is None else await find(store, response_id, owner)
    if record is None:
        raise response_not_found(response_id)
    await send_body(send, 200, record.response, JSON, headers)
    return 200


async def _cancel_elsewhere(store: ResponseStore, durable: DurableResponses, response_id: str,
                            owner: str) -> None:
    """Ask the process running the response to cancel it, and wait until it has ended (or
    its lease ran out), at most a lease and a few polls."""
    try:
        await durable.request_cancel(response_id, owner)
    except StoreError as exc:
        raise unavailable(exc) from None
    with trio.move_on_after(durable.lease_s + 4 * CANCEL_WAIT_POLL_S):
        while True:
            await trio.sleep(CANCEL_WAIT_POLL_S)  # the runner has no way to wake us
            latest = await find(store, response_id, owner)
            if latest is None or not latest.running:
                return


async def respond_input_items(store: ResponseStore, response_id: str, owner: str,
                              query: bytes, send: Send, headers: Headers) -> int:
    """One page of the items the response answered (earlier turns' included), OpenAI's list."""
    limit, order, after = list_page(query)
    record = await find(store, response_id, owner)
    if record is None:
        raise response_not_found(response_id)
    items = list(record.conversation)
    if order == "desc":
        items.reverse()
    ids = [_item_id.decode(item).id for item in items]
    start = 0
    if after is not None:
        if after not in ids:
            raise invalid_request(f"No input item with id '{after}' in response "
                                  f"'{response_id}'.", "after")
        start = ids.index(after) + 1
    page = list(zip(ids[start:start + limit], items[start:start + limit], strict=True))
    body = lists.list_page(page, start + limit < len(items))
    await send_body(send, 200, body, JSON, headers)
    return 200
