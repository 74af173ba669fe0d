"""Numbers in a query string, read without surprises (sans-IO).

``str.isdigit`` is true of characters ``int`` refuses (``²``, other scripts'
digits) and ``int`` refuses strings of more than 4,300 digits: either would
be a 500. A query's number is ASCII digits of bounded length, in its range,
or the caller's 400.
"""

from __future__ import annotations

from typing import Final, Literal
from urllib.parse import parse_qs

from direct_frontend.openai.errors import invalid_request

#: a list's page: OpenAI's default and largest ``limit``
DEFAULT_LIMIT: Final = 20
MAX_LIMIT: Final = 100


def query_int(raw: str, low: int, high: int) -> int | None:
    """``raw`` as an integer from ``low`` to ``high``; None if it is not one."""
    text = raw[1:] if raw.startswith("-") else raw
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(max(abs(low), high))):
        return None
    value = int(raw)
    return value if low <= value <= high else None


def list_page(query: bytes, *, default: int = DEFAULT_LIMIT,
              most: int = MAX_LIMIT) -> tuple[int, Literal["asc", "desc"], str | None]:
    """OpenAI's list query: ``limit`` (1–``most``, ``default`` when absent), ``order``
    (``desc``, newest first, by default) and ``after`` (the cursor); a bad one is the 400
    naming it."""
    fields = parse_qs(query.decode("latin-1"))
    limit = default
    if "limit" in fields:
        raw = fields["limit"][-1]
        value = query_int(raw, 1, most)
        if value is None:
            raise invalid_request(f"Invalid 'limit': {raw[:40]!r} (an integer from 1 to "
                                  f"{most}).", "limit")
        limit = value
    order = fields.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        raise invalid_request(f"Invalid 'order': {order[:40]!r} ('asc' or 'desc').", "order")
    return limit, "asc" if order == "asc" else "desc", fields.get("after", [None])[-1]
