"""``/v1/conversations``: create, retrieve, update and delete conversations, and their items.

Conversations live in the durable store (state/shell.py): a database the
``sqlite`` and ``postgres`` backends share between processes, a private
in-memory one with ``memory``. Every call names its owner
(http/identity.py): another owner's conversation, or an item of it, is
OpenAI's 404, as an id nobody made. Each handler reads its body and query
and returns the JSON it answers with; the app sends it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from direct_frontend.http.asgi import Scope
from direct_frontend.http.query import list_page
from direct_frontend.http.stored_responses import unavailable
from direct_frontend.openai.body import read_json_object
from direct_frontend.openai.conversations import (
    Conversation,
    conversation_not_found,
    item_not_found,
    items_of,
    metadata_of,
    new_conversation_id,
    page,
)
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.state.shell import Durable
from direct_frontend.state.sql import InvalidItem, StoreError

PATH: Final = "/v1/conversations"
ITEMS: Final = "items"

_T = TypeVar("_T")

#: one call: the store, the owner, the ids in the path, the query and the body; the answer
Call = Callable[[Durable, str, list[str], bytes, bytes], Awaitable[bytes]]


def route(path: str) -> tuple[dict[str, Call], str] | None:
    """The methods of a ``/v1/conversations`` path and its metrics label; None: no such path."""
    if path == PATH:
        return {"POST": create}, PATH
    parts = path[len(PATH) + 1:].split("/") if path.startswith(PATH + "/") else []
    if not parts or not all(parts):
        return None
    if len(parts) == 1:
        return {"GET": retrieve, "POST": update, "DELETE": delete}, PATH + "/{id}"
    if len(parts) == 2 and parts[1] == ITEMS:
        return {"GET": list_items, "POST": add_items}, PATH + "/{id}/items"
    if len(parts) == 3 and parts[1] == ITEMS:
        return {"GET": get_item, "DELETE": delete_item}, PATH + "/{id}/items/{item_id}"
    return None


def ids_of(path: str) -> list[str]:
    """The conversation's id, then the item's (if the path names one)."""
    parts = path[len(PATH) + 1:].split("/")
    return [parts[0], *parts[2:3]]


async def create(durable: Durable, owner: str, ids: list[str], query: bytes,
                 body: bytes) -> bytes:
    raw = read_json_object(body) if body.strip() else {}
    items = items_of(raw, required=False)
    conversation = Conversation(new_conversation_id(), owner, int(time.time()),
                                metadata_of(raw) or b"{}")
    try:
        await durable.create_conversation(conversation, items)
    except InvalidItem as exc:
        raise invalid_request(f"Invalid 'items': {exc}.", "items") from None
    return conversation.render()


async def retrieve(durable: Durable, owner: str, ids: list[str], query: bytes,
                   body: bytes) -> bytes:
    conversation = await durable.get_conversation(ids[0], owner)
    if conversation is None:
        raise conversation_not_found(ids[0])
    return conversation.render()


async def update(durable: Durable, owner: str, ids: list[str], query: bytes,
                 body: bytes) -> bytes:
    metadata = metadata_of(read_json_object(body))
    if metadata is None:
        raise invalid_request("Missing required parameter: 'metadata'.", "metadata")
    conversation = await durable.update_conversation(ids[0], owner, metadata)
    if conversation is None:
        raise conversation_not_found(ids[0])
    return conversation.render()


async def delete(durable: Durable, owner: str, ids: list[str], query: bytes,
                 body: bytes) -> bytes:
    conversation = Conversation(ids[0], owner, 0)
    if not await durable.delete_conversation(ids[0], owner):
        raise conversation_not_found(ids[0])
    return conversation.deleted()


async def list_items(durable: Durable, owner: str, ids: list[str], query: bytes,
                     body: bytes) -> bytes:
    """One page of the items, newest first unless ``order=asc``, after the item ``after``."""
    limit, order, after = list_page(query)
    try:
        found = await durable.list_items(ids[0], owner, after, limit, order)
    except KeyError:
        raise invalid_request(f"No item with id '{after}' in conversation '{ids[0]}'.",
                              "after") from None
    if found is None:
        raise conversation_not_found(ids[0])
    return page(*found)


async def add_items(durable: Durable, owner: str, ids: list[str], query: bytes,
                    body: bytes) -> bytes:
    items = items_of(read_json_object(body), required=True)
    try:
        added = await durable.add_items(ids[0], owner, items)
    except InvalidItem as exc:
        raise invalid_request(f"Invalid 'items': {exc}.", "items") from None
    if not added:
        raise conversation_not_found(ids[0])
    return page(items, False)


async def get_item(durable: Durable, owner: str, ids: list[str], query: bytes,
                   body: bytes) -> bytes:
    return _item_found(await durable.get_item(ids[0], owner, ids[1]), ids).data


async def delete_item(durable: Durable, owner: str, ids: list[str], query: bytes,
                      body: bytes) -> bytes:
    """Drop the item; the conversation, as OpenAI answers."""
    return _item_found(await durable.delete_item(ids[0], owner, ids[1]), ids).render()


def _item_found(found: _T | bool | None, ids: list[str]) -> _T:
    """What the store found for an item: False, a conversation not the caller's (or none);
    None, no such item in it. Each is a 404 naming what is missing."""
    if found is False:
        raise conversation_not_found(ids[0])
    if found is None or found is True:
        raise item_not_found(ids[1])
    return found


def no_store() -> OpenAIHTTPError:
    return invalid_request("Conversations are stored, and this server keeps nothing "
                           "([frontend.responses] store = false).")


async def answer(call: Call, durable: Durable | None, owner: str, scope: Scope,
                 body: bytes) -> bytes:
    """``call`` for ``owner`` on the request's path; a database that fails is a 503."""
    if durable is None:
        raise no_store()
    try:
        return await call(durable, owner, ids_of(scope["path"]),
                          scope.get("query_string", b""), body)
    except StoreError as exc:
        raise unavailable(exc) from None


async def history(durable: Durable | None, conversation: str,
                  owner: str) -> tuple[int, tuple[bytes, ...]]:
    """The items of ``owner``'s conversation a Responses request continues, and the number
    its next item will get."""
    if durable is None:
        raise no_store()
    try:
        found = await durable.history(conversation, owner)
    except StoreError as exc:
        raise unavailable(exc) from None
    if found is None:
        raise conversation_not_found(conversation)
    return found
