"""``/v1/responses/{id}``: retrieve, delete, cancel and list the input items of a response.

A response is held by the process that answered it (its id says which,
openai/response_store.py). One this process does not hold is asked of that
sibling over the replica link, so a client whose follow-up lands on another
worker or replica still finds it; a sibling that is gone took its responses
with it, and the answer is OpenAI's "not found". Every call names the owner
asking (http/identity.py): another owner's response is "not found" too, here
and at the sibling, so existence never leaks.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import parse_qs

import msgspec

from direct_frontend.http.asgi import JSON, Headers, Send, send_body
from direct_frontend.http.query import query_int
from direct_frontend.openai.errors import invalid_request, not_cancellable, response_not_found
from direct_frontend.openai.response_store import (
    NOT_BACKGROUND,
    RemoteResponses,
    ResponseStore,
    StoredResponse,
    holder_of,
)

#: ``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
RESPONSE_PATH: Final = "/v1/responses/"
INPUT_ITEMS: Final = "/input_items"
#: ``POST /v1/responses/{id}/cancel``
CANCEL: Final = "/cancel"
#: ``input_items`` pages: OpenAI's default and largest ``limit``
DEFAULT_LIMIT: Final = 20
MAX_LIMIT: Final = 100


class _ItemId(msgspec.Struct):
    id: str | None = None


_item_id: Final = msgspec.json.Decoder(_ItemId)


def _sibling(store: ResponseStore, response_id: str) -> tuple[RemoteResponses, str] | None:
    """The link to the sibling whose id this is, and its holder tag; None if it is ours."""
    holder = holder_of(response_id)
    if store.remote is None or holder is None or holder == store.holder:
        return None
    return store.remote, holder


async def find(store: ResponseStore, response_id: str, owner: str) -> StoredResponse | None:
    """``owner``'s stored response: this process's, else its holder's (a sibling), else None."""
    record = store.get(response_id, owner)
    if record is None and (sibling := _sibling(store, response_id)) is not None:
        remote, holder = sibling
        record = await remote.fetch(holder, response_id, owner)
    return record


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
    if not deleted and (sibling := _sibling(store, response_id)) is not None:
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
    """
    answer = await store.cancel(response_id, owner)
    if answer is None and (sibling := _sibling(store, response_id)) is not None:
        remote, holder = sibling
        answer = await remote.cancel(holder, response_id, owner)
    if answer == NOT_BACKGROUND:
        raise not_cancellable(response_id)
    record = None if answer is None else await find(store, response_id, owner)
    if record is None:
        raise response_not_found(response_id)
    await send_body(send, 200, record.response, JSON, headers)
    return 200


async def respond_input_items(store: ResponseStore, response_id: str, owner: str,
                              query: bytes, send: Send, headers: Headers) -> int:
    """One page of the items the response answered (earlier turns' included), OpenAI's list."""
    limit, order, after = _page_query(query)
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
    page = items[start:start + limit]
    page_ids = ids[start:start + limit]
    body = b'{"object":"list","data":[%b],"first_id":%b,"last_id":%b,"has_more":%b}' % (
        b",".join(page),
        msgspec.json.encode(page_ids[0] if page_ids else None),
        msgspec.json.encode(page_ids[-1] if page_ids else None),
        b"true" if start + limit < len(items) else b"false",
    )
    await send_body(send, 200, body, JSON, headers)
    return 200


def _page_query(query: bytes) -> tuple[int, str, str | None]:
    """``limit`` (1–100), ``order`` (``asc``/``desc``, newest first by default), ``after``."""
    fields = parse_qs(query.decode("latin-1"))
    limit = DEFAULT_LIMIT
    if "limit" in fields:
        raw = fields["limit"][-1]
        value = query_int(raw, 1, MAX_LIMIT)
        if value is None:
            raise invalid_request(f"Invalid 'limit': {raw[:40]!r} (an integer from 1 to "
                                  f"{MAX_LIMIT}).", "limit")
        limit = value
    order = fields.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        raise invalid_request(f"Invalid 'order': {order!r} ('asc' or 'desc').", "order")
    after = fields.get("after", [None])[-1]
    return limit, order, after
