"""The Conversations API's objects and request bodies (sans-IO).

A conversation is a list of items (messages, function calls and their
outputs, reasoning) that the Responses API reads as history and appends to
(``conversation`` on ``/v1/responses``). Its objects are OpenAI's: the
conversation (``id`` ``conv_…``, ``object: "conversation"``, ``created_at``,
``metadata``), its items as the Responses API lists input items, and cursor
paged lists (``first_id``, ``last_id``, ``has_more``). Every conversation has
an owner (http/identity.py): for anyone else it does not exist. Ids carry
192 bits from the OS's CSPRNG.
"""

from __future__ import annotations

import secrets
from typing import Any, Final

import msgspec

from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.lists import list_page
from direct_frontend.openai.response_store import Item
from direct_frontend.openai.responses_api import check_items, normalized_item

PREFIX: Final = "conv_"
#: items one create or add may carry (OpenAI's limit)
MAX_ITEMS_PER_CALL: Final = 20
#: metadata: at most this many pairs, keys and values at most so long (OpenAI's limits)
MAX_METADATA_PAIRS: Final = 16
MAX_METADATA_KEY: Final = 64
MAX_METADATA_VALUE: Final = 512
#: list pages: OpenAI's default and largest ``limit``
DEFAULT_LIMIT: Final = 20
MAX_LIMIT: Final = 100

_encode: Final = msgspec.json.Encoder().encode


class Conversation(msgspec.Struct, frozen=True):
    """One conversation as stored; ``metadata`` is its JSON object's bytes."""

    id: str
    owner: str
    created_at: int
    metadata: bytes = b"{}"

    def render(self) -> bytes:
        """The conversation object the API answers."""
        return b'{"id":%b,"object":"conversation","created_at":%d,"metadata":%b}' % (
            _encode(self.id), self.created_at, self.metadata)

    def deleted(self) -> bytes:
        return b'{"id":%b,"object":"conversation.deleted","deleted":true}' % _encode(self.id)


def new_conversation_id() -> str:
    return f"{PREFIX}{secrets.token_hex(24)}"


def conversation_not_found(conversation_id: str) -> OpenAIHTTPError:
    """404 for a conversation nobody holds for the caller; OpenAI's wording."""
    return OpenAIHTTPError(404, f"Conversation with id '{conversation_id}' not found.",
                           "invalid_request_error")


def item_not_found(item_id: str) -> OpenAIHTTPError:
    return OpenAIHTTPError(404, f"Item with id '{item_id}' not found.", "invalid_request_error")


def metadata_of(raw: dict[str, Any]) -> bytes | None:
    """``metadata`` checked as OpenAI checks it, as JSON bytes; None when absent."""
    value = raw.get("metadata")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request("Invalid type for 'metadata': expected an object.", "metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise invalid_request(f"Invalid 'metadata': at most {MAX_METADATA_PAIRS} pairs.",
                              "metadata")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid_request(f"Invalid 'metadata': a key is at most {MAX_METADATA_KEY} "
                                  "characters.", "metadata")
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE:
            raise invalid_request(f"Invalid 'metadata': values are strings of at most "
                                  f"{MAX_METADATA_VALUE} characters.", "metadata")
    return _encode(value)


def items_of(raw: dict[str, Any], *, required: bool) -> list[Item]:
    """``items`` normalized as the Responses API lists input items (typed, with ids)."""
    value = raw.get("items")
    if value is None:
        if required:
            raise invalid_request("Missing required parameter: 'items'.", "items")
        return []
    if not isinstance(value, list):
        raise invalid_request("Invalid type for 'items': expected an array.", "items")
    if len(value) > MAX_ITEMS_PER_CALL:
        raise invalid_request(f"Invalid 'items': at most {MAX_ITEMS_PER_CALL} items at once.",
                              "items")
    check_items(value, "items")
    out = []
    for item in value:
        shown = normalized_item(item)
        if not isinstance(shown["id"], str) or not shown["id"]:
            raise invalid_request("Invalid 'items': an item's id is a non-empty string.",
                                  "items")
        out.append(Item(shown["id"], _encode(shown)))
    return out


def conversation_id_of(raw: dict[str, Any]) -> str | None:
    """``conversation`` on a Responses request: an id, or an object with ``id``."""
    value = raw.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise invalid_request("Invalid 'conversation': expected a conversation id or an object "
                              "with 'id'.", "conversation")
    if raw.get("previous_response_id") is not None:
        raise invalid_request("Mutually exclusive parameters: 'previous_response_id' and "
                              "'conversation' cannot be used together.", "conversation")
    return value


def page(items: list[Item], has_more: bool) -> bytes:
    """An OpenAI list of ``items``."""
    return list_page([(item.id, item.data) for item in items], has_more)
