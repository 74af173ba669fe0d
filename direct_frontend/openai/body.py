"""A request body read from JSON, or a 400 naming what is wrong with it.

msgspec decodes a body typed (its wire struct) in one pass; its validation
errors become OpenAI-shaped 400s naming the parameter. A body nested deeper
than :data:`MAX_JSON_DEPTH` is refused before it becomes a request, so no
client can make a chat template or the code after it recurse without end.
"""

from __future__ import annotations

import gc
import re
from typing import Any, Final, TypeVar

import msgspec

from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.types import ROLES, SERVICE_TIERS

#: how deeply a body's arrays and objects may nest (a real request needs about 10)
MAX_JSON_DEPTH: Final = 64

_W = TypeVar("_W", bound=msgspec.Struct | dict[str, Any])

_MISSING_FIELD = re.compile(r"Object missing required field `([^`]*)`")


def _lower_first(text: str) -> str:
    """msgspec's sentence, continued after a colon: "Expected…" → "expected…", "JSON…" stays."""
    if text[1:2].isupper():  # an acronym
        return text
    return text[:1].lower() + text[1:]


def _from_validation_error(exc: msgspec.ValidationError) -> OpenAIHTTPError:
    """Turn msgspec's ``"<detail> - at `$.a[0].b`"`` into a message and an OpenAI param."""
    detail, sep, where = str(exc).rpartition(" - at `")
    if not sep:
        detail, where = str(exc), "$`"
    path = where.rstrip("`")
    param: str | None = path[2:] if path.startswith("$.") else None
    missing = _MISSING_FIELD.fullmatch(detail)
    if missing is not None:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        return invalid_request(f"Missing required parameter: '{param}'.", param)
    if param is None:
        return invalid_request(f"The request body must be a JSON object: {_lower_first(detail)}.")
    if detail.startswith("Invalid enum value") and param.endswith(".role"):
        detail += f"; expected one of {', '.join(ROLES)}"
    if detail.startswith("Invalid enum value") and param == "service_tier":
        detail += f"; expected one of {', '.join(SERVICE_TIERS)}"
    kind = "type" if ", got `" in detail else "value"
    return invalid_request(f"Invalid {kind} for '{param}': {_lower_first(detail)}.", param)


def nested_deeper_than(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether decoded JSON ``value`` nests arrays and objects deeper than ``limit`` (the
    outermost one is level 1).

    Walks level by level with ``gc.get_referents``, which lists in C what every object of
    a level holds (a string-keyed dict's values, a list's items) and nothing for strings
    and numbers: level k + 1 holds the children of level k's containers, so the value nests
    deeper than ``limit`` exactly when level ``limit`` + 1 still holds a container. Its cost
    grows with a body's arrays and objects and their items, never with the length of its
    strings, and no Python code runs per item but over level ``limit`` + 1 (≈ 4 µs for a
    72-message conversation). A level's list and the call's copy of it hold a reference
    per item (at most 16 bytes per byte of body), and each level is one call holding the
    GIL, as the decoding before it is. It relies on CPython's traversal of exact dicts and
    lists; the property test over decoded bodies guards it.
    """
    level = [value]
    for _ in range(limit):
        level = gc.get_referents(*level)
        if not level:
            return False
    return any(type(x) is dict or type(x) is list for x in level)


_object_decoder: Final = msgspec.json.Decoder(dict[str, Any])
#: any JSON as Python values; the second reads a number beyond a double as ±inf (for the
#: depth check only: the typed decode then refuses it where a field keeps it)
_plain_decoder: Final = msgspec.json.Decoder()
_plain_inf_decoder: Final = msgspec.json.Decoder(float_hook=float)


def read_json_object(body: bytes) -> dict[str, Any]:
    """A body as a JSON object, for the APIs read into a chat body (Responses, Messages)."""
    return decode_body(_object_decoder, body)


def _too_deep() -> OpenAIHTTPError:
    return invalid_request(
        f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep."
    )


def _decode_nested(decoder: msgspec.json.Decoder[_W], body: bytes) -> _W:
    """A body with many arrays and objects: read as plain JSON, its depth checked, then
    converted to ``decoder``'s type (about as fast as decoding it typed, which would skip
    unknown fields unchecked). msgspec bounds its own recursion by the interpreter's
    limit, a depth far beyond ours: a RecursionError is the same refusal."""
    beyond_double = False
    try:
        try:
            value = _plain_decoder.decode(body)
        except msgspec.ValidationError:  # a number beyond a double
            value, beyond_double = _plain_inf_decoder.decode(body), True
    except RecursionError:
        raise _too_deep() from None
    if nested_deeper_than(value):
        raise _too_deep()
    if beyond_double:  # refused, naming its field, where one keeps it (±inf fits Any)
        return decoder.decode(body)
    request: _W = msgspec.convert(value, decoder.type)
    return request


#: below this size a body's brackets are counted in two passes (cheaper there than finding
#: them one by one)
_COUNT_BELOW_BYTES: Final = 4 << 10


def few_brackets(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` holds at most ``limit`` ``[`` and ``{`` together (brackets in strings
    included): then it cannot nest deeper than ``limit``.

    A large body is searched bracket by bracket (memchr), stopping past ``limit``:
    at most two passes of memchr (≈ 20 µs per MB), where counting every bracket
    would pass over all of it (≈ 0.5 ms per MB for each kind).
    """
    if len(body) < _COUNT_BELOW_BYTES:
        return body.count(b"[") + body.count(b"{") <= limit
    left = limit
    for bracket in (b"{", b"["):  # (objects first: most bodies hold more of them)
        at = body.find(bracket)
        while at != -1:
            left -= 1
            if left < 0:
                return False
            at = body.find(bracket, at + 1)
    return True


def decode_body(decoder: msgspec.json.Decoder[_W], body: bytes) -> _W:
    """``body`` as ``decoder``'s type, or a 400 naming what is wrong with it.

    A body with no more arrays and objects than :data:`MAX_JSON_DEPTH`
    (:func:`few_brackets`) cannot nest deeper and is decoded typed in one pass.
    """
    try:
        if few_brackets(body):
            return decoder.decode(body)
        return _decode_nested(decoder, body)
    except msgspec.ValidationError as exc:
        raise _from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        if not body.strip():
            raise invalid_request("The request body is empty; expected a JSON object.") from None
        raise invalid_request(
            f"The request body is not valid JSON: {_lower_first(str(exc))}."
        ) from None
