"""OpenAI's list object, as every ``GET`` of a paged collection answers it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

_encode: Final = msgspec.json.Encoder().encode


def list_page(entries: Sequence[tuple[str | None, bytes]], has_more: bool) -> bytes:
    """``{"object": "list", "data", "first_id", "last_id", "has_more"}`` of ``entries``,
    each an object's id (None: ``null``) and its JSON."""
    return b'{"object":"list","data":[%b],"first_id":%b,"last_id":%b,"has_more":%b}' % (
        b",".join(data for _, data in entries),
        _encode(entries[0][0] if entries else None),
        _encode(entries[-1][0] if entries else None),
        b"true" if has_more else b"false",
    )
