"""Structural tags in the simulator: the scripted text where the tag allows it, else text it writes.

A real engine under a structural tag lets the model choose among what the tag
allows (a tool call, or JSON of the response schema); the simulator's "model"
is its script. So a scripted completion the tag accepts is emitted as it is,
and one it does not accept is replaced by text the simulator writes for the
tag, as a grammar would have steered the model away from it. That text takes
the first alternative of every choice, except that an unscripted agent's turn
(calls or a format) calls a tool while the prompt shows no call yet (the text
its calls open with, such as ``<tool_call>``, is not in it) and answers in the
format after, so an agent on the demo fleet runs its tool, then ends.

It reads xgrammar's format (``{"type": "structural_tag", "format": …}``) of
these kinds: ``const_string``, ``json_schema`` (the subset
:mod:`.constraints` writes, checked with the same subset, and its
``max_whitespace_cnt``), ``regex``,
``any_text``, ``sequence``, ``or``, ``tag`` and ``tags_with_separator``.
Anything else, the older ``structures``/``triggers`` form included, is
:class:`~.constraints.Unsupported`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from direct_frontend.simulator.constraints import (
    InvalidConstraint,
    Unsupported,
    regex_text,
    schema_value,
)

_DECODER = json.JSONDecoder()
_WORDS = ("alpha", "beta", "gamma")


def structural_text(tag: str, rng: random.Random, script: str | None, prompt: str = "") -> str:
    """Text the tag allows: ``script`` when it does, else text written for the tag.

    ``prompt`` is the request's prompt as text (where an agent's earlier calls show).
    """
    try:
        spec = json.loads(tag)
    except ValueError as exc:
        raise InvalidConstraint(f"the structural tag is not valid JSON: {exc}") from None
    if not isinstance(spec, dict) or spec.get("type") != "structural_tag" or "format" not in spec:
        raise Unsupported("the simulator reads structural tags of the form "
                          '{"type": "structural_tag", "format": ...} only')
    fmt = spec["format"]
    if script is not None and len(script) in _ends(fmt, script, 0):
        return script
    if script is None and _kind(fmt) == "or":
        for element in fmt["elements"]:
            opening = _calls_opening(element)
            if opening and opening not in prompt:
                return _write(element, rng)
    return _write(fmt, rng)


def _calls_opening(fmt: Any) -> str:
    """The text every call of a list of calls opens with ("": not a list of calls)."""
    if _kind(fmt) == "tag" and _kind(fmt["content"]) == "tags_with_separator":
        begin = fmt["begin"]  # calls in a section: the section's opening
        return begin if isinstance(begin, str) else ""
    if _kind(fmt) != "tags_with_separator" or not fmt["tags"]:
        return ""
    begins: list[str] = [tag["begin"] for tag in fmt["tags"]]
    if not all(isinstance(b, str) for b in begins):
        return ""
    shortest = min(begins, key=len)
    size = next((k for k in range(len(shortest))
                 if any(b[k] != shortest[k] for b in begins)), len(shortest))
    return shortest[:size]


def accepts(tag: str, text: str) -> bool:
    """Whether the structural tag allows exactly ``text``."""
    return len(text) in _ends(json.loads(tag)["format"], text, 0)


def _kind(fmt: Any) -> str:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidConstraint(f"a structural tag format is an object with a type: {fmt!r}")
    kind: str = fmt["type"]
    return kind


def _ends_text(end: Any) -> list[str]:
    return [end] if isinstance(end, str) else list(end)


def _ends(fmt: Any, text: str, at: int) -> set[int]:
    """Every position where ``fmt`` started at ``at`` of ``text`` can end."""
    kind = _kind(fmt)
    ends = _ENDS.get(kind)
    if ends is None:
        raise Unsupported(f"the simulator cannot read the structural tag format '{kind}'")
    return ends(fmt, text, at)


def _const_ends(fmt: dict[str, Any], text: str, at: int) -> set[int]:
    value = fmt["value"]
    return {at + len(value)} if text.startswith(value, at) else set()


def _json_ends(fmt: dict[str, Any], text: str, at: int) -> set[int]:
    """Where the one JSON value at ``at`` ends, if it conforms and its whitespace is in bounds."""
    try:
        value, end = _DECODER.raw_decode(text, at)
    except ValueError:
        return set()
    limit = fmt.get("max_whitespace_cnt")
    if limit is not None and _longest_space(text, at, end) > limit:
        return set()
    return {end} if conforms(value, fmt["json_schema"], fmt["json_schema"]) else set()


def _regex_ends(fmt: dict[str, Any], text: str, at: int) -> set[int]:
    pattern = re.compile(fmt["pattern"])
    return {j for j in range(at, len(text) + 1) if pattern.fullmatch(text, at, j)}


def _sequence_ends(fmt: dict[str, Any], text: str, at: int) -> set[int]:
    positions = {at}
    for element in fmt["elements"]:
        positions = {end for start in positions for end in _ends(element, text, start)}
    return positions


def _tag_ends(fmt: dict[str, Any], text: str, at: int) -> set[int]:
    if not text.startswith(fmt["begin"], at):
        return set()
    inside = _ends(fmt["content"], text, at + len(fmt["begin"]))
    return {k + len(end) for k in inside for end in _ends_text(fmt["end"])
            if text.startswith(end, k)}


def _longest_space(text: str, start: int, end: int) -> int:
    """The longest run of whitespace outside strings in the JSON ``text[start:end]``."""
    longest = run = 0
    inside = escaped = False
    for c in text[start:end]:
        if inside:
            inside = escaped or c != '"'
            escaped = not escaped and c == "\\"
            continue
        inside = c == '"'
        run = run + 1 if c in " \t\n\r" else 0
        longest = max(longest, run)
    return longest


def _tags_ends(fmt: dict[str, Any], text: str, at: int) -> set[int]:
    """One tag or more (none too, without ``at_least_one``), separated, or only the first."""
    found: set[int] = set() if fmt.get("at_least_one") else {at}
    frontier = {end for tag in fmt["tags"] for end in _ends(tag, text, at)}
    separator = fmt.get("separator", "")
    while frontier:
        found |= frontier
        if fmt.get("stop_after_first"):
            break
        frontier = {
            end for k in frontier if text.startswith(separator, k)
            for tag in fmt["tags"] for end in _ends(tag, text, k + len(separator))
        } - found
    return found


def _write(fmt: Any, rng: random.Random) -> str:
    kind = _kind(fmt)
    if kind == "const_string":
        value: str = fmt["value"]
        return value
    if kind == "json_schema":
        return json.dumps(schema_value(fmt["json_schema"], rng))
    if kind == "regex":
        return regex_text(fmt["pattern"], rng)
    if kind == "any_text":
        return rng.choice(_WORDS)
    if kind == "sequence":
        return "".join(_write(element, rng) for element in fmt["elements"])
    if kind == "or":
        return _write(fmt["elements"][0], rng)
    if kind == "tag":
        begin: str = fmt["begin"]
        return begin + _write(fmt["content"], rng) + _ends_text(fmt["end"])[0]
    if kind == "tags_with_separator":
        return _write(fmt["tags"][0], rng) if fmt["tags"] else ""
    raise Unsupported(f"the simulator cannot write text for the structural tag format '{kind}'")


_ENDS: dict[str, Callable[[dict[str, Any], str, int], set[int]]] = {
    "const_string": _const_ends,
    "json_schema": _json_ends,
    "regex": _regex_ends,
    "any_text": lambda fmt, text, at: set(range(at, len(text) + 1)),
    "sequence": _sequence_ends,
    "or": lambda fmt, text, at: {end for element in fmt["elements"]
                                 for end in _ends(element, text, at)},
    "tag": _tag_ends,
    "tags_with_separator": lambda fmt, text, at: _tags_ends(fmt, text, at),
}


# -- JSON schemas, checked -----------------------------------------------------------------

_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
}


def conforms(value: Any, schema: Any, root: Any, depth: int = 0) -> bool:
    """Whether ``value`` satisfies ``schema``, for the keywords :mod:`.constraints` writes."""
    if schema is True or schema == {}:
        return True
    if not isinstance(schema, dict) or depth > 16:
        return False
    if "$ref" in schema:
        node: Any = root
        for part in str(schema["$ref"]).removeprefix("#/").split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        return conforms(value, node, root, depth + 1)
    if not _keywords_hold(value, schema, root, depth):
        return False
    for shape, holds in _SHAPES:
        if isinstance(value, shape):
            return holds(value, schema, root, depth)
    return _number_holds(value, schema)


def _keywords_hold(value: Any, schema: dict[str, Any], root: Any, depth: int) -> bool:
    """``const``, ``enum``, ``anyOf``/``oneOf`` (one branch of each) and ``type``."""
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    for branches in ("anyOf", "oneOf"):
        if branches in schema and not any(conforms(value, sub, root, depth + 1)
                                          for sub in schema[branches]):
            return False
    kinds = schema.get("type")
    if kinds is None:
        return True
    names = kinds if isinstance(kinds, list) else [kinds]
    return any(_is(value, name) for name in names)


def _object_holds(value: dict[str, Any], schema: dict[str, Any], root: Any, depth: int) -> bool:
    properties = schema.get("properties", {})
    if any(name not in value for name in schema.get("required", ())):
        return False
    if schema.get("additionalProperties") is False and set(value) - set(properties):
        return False
    return all(conforms(v, properties[k], root, depth + 1)
               for k, v in value.items() if k in properties)


def _array_holds(value: list[Any], schema: dict[str, Any], root: Any, depth: int) -> bool:
    if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
        return False
    return all(conforms(v, schema.get("items", {}), root, depth + 1) for v in value)


def _string_holds(value: str, schema: dict[str, Any], root: Any, depth: int) -> bool:
    if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        return False
    return "pattern" not in schema or re.search(schema["pattern"], value) is not None


def _number_holds(value: Any, schema: dict[str, Any]) -> bool:
    """A number's bounds; anything else (a bool, null) has none to break."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = schema.get("minimum", value), schema.get("maximum", value)
        return bool(low <= value <= high)
    return True


#: what a value of each JSON shape must satisfy beyond the keywords (numbers: their bounds)
_SHAPES: tuple[tuple[type, Callable[[Any, dict[str, Any], Any, int], bool]], ...] = (
    (dict, _object_holds), (list, _array_holds), (str, _string_holds),
)


def _is(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    kind = _TYPES.get(name)
    return kind is not None and isinstance(value, kind)
