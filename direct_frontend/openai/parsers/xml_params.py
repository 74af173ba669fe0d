"""One call whose arguments are tagged key/value pairs (GLM-4.5+, MiniMax-M2), typed by schema.

The formats differ only in their tags: a header that names the function,
then pairs whose value is bare text up to a closing tag. A value's JSON type
comes from the tool's parameter schema (:func:`typed_value`; Qwen3-Coder's
values too); values are taken as the model wrote them (these templates write
them on no line of their own). Arguments stream one pair at a time, since a value's type is
known only once it is complete.
"""

from __future__ import annotations

import json
import re
from typing import Any

from direct_frontend.openai.parsers.base import ToolSchemas

#: how much unreadable header text a body waits for before it gives up
HEADER_LIMIT = 256


def typed_value(raw: str, schema: Any) -> Any:
    """The JSON value of a parameter's text, typed by its schema where there is one."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return raw
    return json_or_text(raw)


def parameter_schema(schemas: ToolSchemas | None, function: str | None, key: str) -> Any:
    """The schema of ``function``'s parameter ``key``, if the request gave one."""
    if schemas is None or function is None:
        return None
    tool = schemas.get(function) or {}
    return (tool.get("properties") or {}).get(key)


def json_or_text(raw: str) -> Any:
    """A value the model marked as not a string: its JSON, else the text as it is."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class TypedArguments:
    """A call's arguments as JSON text, built one schema-typed pair at a time.

    A subclass reads the call's text held so far in :meth:`_parse`, from where
    the last complete pair ended; a failed call ignores the rest of its text.
    """

    __slots__ = ("_count", "_pos", "_ready", "_schemas", "_text", "failed", "name")

    def __init__(self, schemas: ToolSchemas | None) -> None:
        self._schemas = schemas
        self._ready: list[str] = []
        self._count = 0
        self.name: str | None = None
        self._text = ""
        self._pos = 0  # parsed up to here
        self.failed = False

    def push(self, text: str) -> int:
        if not self.failed:
            self._text += text
            self._parse()
        return -1

    def _parse(self) -> None:
        raise NotImplementedError

    def _check_opening(self, rest: str, openers: tuple[str, ...]) -> None:
        """Fail the call unless ``rest``, the text after its last pair, may still begin (or
        begins) one of ``openers``."""
        if rest and not any(o.startswith(rest) or rest.startswith(o) for o in openers):
            self.failed = True

    def _add(self, key: str, raw: str, string: str | None = None) -> None:
        """One pair; ``string``: the model's own word on whether the value is text (DSML)."""
        if string is None:
            value = typed_value(raw, parameter_schema(self._schemas, self.name, key))
        else:
            value = raw if string == "true" else json_or_text(raw)
        self._ready.append(("{" if self._count == 0 else ", ") + json.dumps(key, ensure_ascii=False)
                           + ": " + json.dumps(value, ensure_ascii=False))
        self._count += 1

    def take_arguments(self) -> str:
        if self.name is None:
            return ""
        out = "".join(self._ready)
        self._ready = []
        return out

    def _rest(self) -> str:
        """What is left to send once the call closed well: the last pairs and the ``}``."""
        return self.take_arguments() + ("}" if self._count else "{}")


class TaggedParamsBody(TypedArguments):
    """A ``header`` naming the call, then ``pair_open`` value ``value_end`` pairs.

    ``header`` must match only a complete header (group ``name``); ``bare``
    names a call that ends before its header completed (a call without
    arguments, whose name runs to the closing tag). ``pair_open`` (group
    ``key``) matches a complete opening of a pair; ``openers`` are the texts
    a pair may begin with, so a partial tag is waited for and anything else
    fails the call. A ``pair_open`` with a group ``string`` types its values by
    it (``true``: text, else JSON) instead of by the schema.
    """

    __slots__ = ("_bare", "_header", "_openers", "_pair", "_value_end")

    def __init__(self, schemas: ToolSchemas | None, *, header: re.Pattern[str],
                 pair_open: re.Pattern[str], value_end: str, openers: tuple[str, ...],
                 bare: re.Pattern[str] | None = None) -> None:
        super().__init__(schemas)
        self._header = header
        self._pair = pair_open
        self._value_end = value_end
        self._openers = openers
        self._bare = bare

    def _parse(self) -> None:
        text = self._text
        if self.name is None:
            m = self._header.match(text)
            if m is None:
                if len(text) > HEADER_LIMIT:
                    self.failed = True
                return
            self.name = m.group("name").strip()
            if not self.name:
                self.failed = True
                return
            self._pos = m.end()
        while True:
            m = self._pair.match(text, self._pos)
            if m is None:
                self._check_opening(text[self._pos:].lstrip(), self._openers)
                return
            end = text.find(self._value_end, m.end())
            if end == -1:
                return
            self._add(m.group("key").strip(), text[m.end():end], m.groupdict().get("string"))
            self._pos = end + len(self._value_end)

    def close(self) -> str | None:
        if self.failed:
            return None
        if self.name is None:  # no arguments: the header ran to the closing tag
            m = None if self._bare is None else self._bare.fullmatch(self._text)
            if m is None:
                return None
            self.name = m.group("name").strip()
            if not self.name or (self._schemas is not None and self.name not in self._schemas):
                return None
        elif self._text[self._pos:].strip():
            return None  # a pair left open, or text that is not one
        return self._rest()
