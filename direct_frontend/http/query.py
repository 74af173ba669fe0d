"""Numbers in a query string, read without surprises (sans-IO).

``str.isdigit`` is true of characters ``int`` refuses (``²``, other scripts'
digits) and ``int`` refuses strings of more than 4,300 digits: either would
be a 500. A query's number is ASCII digits of bounded length, in its range,
or the caller's 400.
"""

from __future__ import annotations


def query_int(raw: str, low: int, high: int) -> int | None:
    """``raw`` as an integer from ``low`` to ``high``; None if it is not one."""
    text = raw[1:] if raw.startswith("-") else raw
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(max(abs(low), high))):
        return None
    value = int(raw)
    return value if low <= value <= high else None
