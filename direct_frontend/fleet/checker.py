"""The generic half of the fleet-file checker: typed reads that report instead of raising.

A :class:`Checker` walks parsed TOML and records every problem with its line
(found by :class:`~direct_frontend.fleet.locate.Locator`) instead of stopping
at the first, so an operator fixes a file in one pass; a value that is absent
or wrong reads as ``None`` and its default stands in, so later checks still
run. :meth:`Checker.fields` reads a :mod:`~direct_frontend.fleet.schema`
dataclass by its fields alone: keys, types, defaults and each field's
:class:`~direct_frontend.fleet.schema.Rules`. Nothing here knows the fleet
file; :mod:`direct_frontend.fleet.load` adds the rules that are not a field's
type or range.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeGuard, TypeVar

from direct_frontend.fleet.locate import KeyPath, Locator
from direct_frontend.fleet.problems import FleetProblem
from direct_frontend.fleet.schema import KnobValue, Rules

_D = TypeVar("_D")
_T = TypeVar("_T")
Table = dict[str, object]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_NO_RULES = Rules()
_SCALARS = (bool, int, float, str)


def field_name(path: KeyPath) -> str:
    """The dotted name of ``path`` as messages show it: ``engine[2].simulator.max_running``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if _BARE_KEY.fullmatch(part) else json.dumps(part, ensure_ascii=False)
            out += f".{key}" if out else key
    return out


def literal(value: object) -> str:
    """A TOML-looking rendering of a scalar, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # inf, -inf, nan: TOML spells them the same
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return json.dumps(shown, ensure_ascii=False)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return repr(value)


def described(value: object) -> str:
    """What a TOML value is, for "expected X, got Y" messages."""
    if isinstance(value, bool):
        kind = "boolean"
    elif isinstance(value, int):
        kind = "integer"
    elif isinstance(value, float):
        kind = "float"
    elif isinstance(value, str):
        kind = "string"
    elif isinstance(value, datetime.datetime):
        kind = "datetime"
    elif isinstance(value, datetime.date):
        kind = "date"
    elif isinstance(value, datetime.time):
        kind = "time"
    elif isinstance(value, dict):
        return "table"
    elif isinstance(value, list):
        return "array"
    else:  # not reachable from tomllib
        return type(value).__name__
    return f"{kind} {literal(value)}"


def _type_only(value: object) -> str:
    """The type of a value without the value itself (for secrets)."""
    return described(value).split(" ", 1)[0]


def _is_str(value: object) -> TypeGuard[str]:
    return isinstance(value, str)


def _is_bool(value: object) -> TypeGuard[bool]:
    return isinstance(value, bool)


def _is_integer(value: object) -> TypeGuard[int]:
    """An integer; TOML's booleans are not (Python's ``bool`` is an ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_array(value: object) -> TypeGuard[list[object]]:
    return isinstance(value, list)


def _range_message(value: float, minimum: float | None, maximum: float | None, above: bool) -> str:
    got = literal(value)
    if minimum is not None and maximum is not None:
        return f"must be between {minimum} and {maximum}, got {got}"
    if minimum is not None:
        return f"must be {'greater than' if above else 'at least'} {minimum}, got {got}"
    return f"must be at most {maximum}, got {got}"


# -- the schema, as the checker sees it -------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """One dataclass field as the checker reads it."""

    name: str
    key: str | None  # the TOML key; None when the field is not in the file
    type: Any  # the resolved annotation, ``None`` taken out of an optional
    default: Any  # ``dataclasses.MISSING`` when there is none
    rules: Rules


def specs(cls: type) -> dict[str, FieldSpec]:
    """The fields of a schema dataclass, in their order, by name."""
    return _specs(cls)


@functools.cache
def _specs(cls: type) -> dict[str, FieldSpec]:
    hints = typing.get_type_hints(cls)
    out: dict[str, FieldSpec] = {}
    for field in dataclasses.fields(cls):
        rules: Rules = field.metadata.get("rules", _NO_RULES)
        hint = hints[field.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            hint = rest[0] if len(rest) == 1 else hint
        default = field.default
        if field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        key = (rules.key or field.name) if rules.in_file else None
        out[field.name] = FieldSpec(field.name, key, hint, default, rules)
    return out


def keys_of(cls: type) -> tuple[str, ...]:
    """The TOML keys of a table, in field order (fields sharing a key list it once)."""
    return tuple(dict.fromkeys(s.key for s in specs(cls).values() if s.key is not None))


def required_keys(cls: type) -> tuple[str, ...]:
    """The keys a table must have: fields without a default the loader cannot derive."""
    return tuple(
        s.key
        for s in specs(cls).values()
        if s.key is not None and s.default is dataclasses.MISSING and not s.rules.derived
    )


def default_of(cls: type, name: str) -> Any:
    """The schema's default for ``cls.name`` (``dataclasses.MISSING`` if it has none)."""
    return specs(cls)[name].default


def _placeholder(spec: FieldSpec) -> Any:
    """The default, or for a required field a value of its type (the file is refused anyway)."""
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if typing.get_origin(spec.type) is Literal:
        return typing.get_args(spec.type)[0]
    return spec.type()


# -- the checker --------------------------------------------------------------------


def secret_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a bearer secret (None: nothing), without quoting it."""
    if not value or any(ch.isspace() or not ch.isprintable() for ch in value):
        return "must be non-empty, without spaces or control characters"
    if not value.isascii():
        # A header is bytes; a client's could never equal this secret's UTF-8.
        return "must be ASCII (an Authorization header cannot carry it otherwise)"
    return None


class Checker:
    """Records every problem with its line; the typed reads return None when absent or invalid."""

    def __init__(self, file: str, locator: Locator) -> None:
        self.file = file
        self.locator = locator
        self.problems: list[FleetProblem] = []

    def report(self, path: KeyPath, message: str) -> None:
        line = self.locator.line_of(path)
        self.problems.append(FleetProblem(self.file, line, field_name(path), message))

    # -- a schema dataclass, field by field ----------------------------------------

    def section(self, cls: type[_D], value: object, path: KeyPath) -> _D:
        """A table read whole from its dataclass (absent or not a table: all defaults).

        Subclasses route the tables that have rules of their own to their own methods.
        """
        tbl = self.table(value, path, keys_of(cls))
        if tbl is None:
            return cls()
        return cls(**self.fields(cls, tbl, path))

    def fields(
        self, cls: type, tbl: Table, path: KeyPath, by_hand: Mapping[str, object] | None = None
    ) -> dict[str, Any]:
        """The values of ``cls``'s fields, read in field order unless ``by_hand`` has them.

        A value that is ``None`` (absent or invalid) becomes the field's default.
        """
        given = by_hand or {}
        values: dict[str, Any] = {}
        for name, spec in specs(cls).items():
            value = given[name] if name in given else self.read(cls, name, tbl, path)
            values[name] = _placeholder(spec) if value is None else value
        return values

    def read(self, cls: type, name: str, tbl: Table, path: KeyPath) -> Any:
        """One field of ``cls`` from ``tbl``, checked by its type and rules."""
        spec = specs(cls)[name]
        key, kind, rules = spec.key, spec.type, spec.rules
        if key is None:
            raise TypeError(f"{cls.__name__}.{name} is not read from the file")
        if sum(other.key == key for other in specs(cls).values()) > 1:
            raise TypeError(f"{cls.__name__}.{name} shares the key {key!r}; read it by hand")
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            return self.section(kind, tbl.get(key, {}), (*path, key))
        if kind in _SCALARS:
            return self._scalar(kind, rules, tbl, path, key)
        if kind == tuple[str, ...] and rules.secret:
            return self.secrets(tbl, path, key)
        noun = rules.noun or name
        if typing.get_origin(kind) is Literal:
            return self.choice(tbl, path, key, typing.get_args(kind), noun)
        if typing.get_origin(kind) is tuple and typing.get_origin(typing.get_args(kind)[0]) is (
                Literal):
            return self.choices(tbl, path, key, typing.get_args(typing.get_args(kind)[0]), noun)
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            text = self.choice(tbl, path, key, tuple(member.value for member in kind), noun)
            return None if text is None else kind(text)
        raise TypeError(f"{cls.__name__}.{name}: no generic read for {kind!r}; read it by hand")

    def _scalar(self, kind: type, rules: Rules, tbl: Table, path: KeyPath, key: str) -> Any:
        """A boolean, integer, float or string field, checked by its rules."""
        if kind is bool:
            return self.boolean(tbl, path, key)
        if kind is int:
            return self.integer(tbl, path, key, minimum=rules.at_least, maximum=rules.at_most)
        if kind is float:
            above = rules.above is not None
            minimum = rules.above if above else rules.at_least
            return self.number(tbl, path, key, minimum=minimum, above=above, maximum=rules.at_most)
        if rules.secret:
            return self.secret(tbl[key], (*path, key)) if key in tbl else None
        return self.string(tbl, path, key)

    def knobs(self, cls: type[_D], values: Mapping[str, KnobValue], path: KeyPath) -> _D:
        """A policy's knobs table as ``cls``: its field names, numbers, their lower bounds.

        Knob messages keep their own, shorter wording ("must not be negative").
        """
        known = specs(cls)
        names = ", ".join(sorted(known))
        checked: dict[str, KnobValue] = {}
        for key, value in values.items():
            where = (*path, key)
            spec = known.get(key)
            if spec is None:
                self.report(where, f"unknown key (expected one of: {names})")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                self.report(where, f"expected a number, got {described(value)}")
            elif spec.type is int and not isinstance(value, int):
                self.report(where, f"expected an integer, got {described(value)}")
            elif spec.rules.at_least is not None and value < spec.rules.at_least:
                low = spec.rules.at_least
                message = "must not be negative" if low == 0 else f"must be at least {low}"
                self.report(where, message)
            else:
                checked[key] = value if spec.type is int else float(value)
        return cls(**checked)

    # -- typed reads: None when absent or invalid (invalid is reported) -------------

    def table(self, value: object, path: KeyPath, keys: Sequence[str] | None) -> Table | None:
        if not isinstance(value, dict):
            self.report(path, f"expected a table, got {described(value)}")
            return None
        if keys is not None:
            expected = ", ".join(keys)
            for key in value:
                if key not in keys:
                    self.report((*path, key), f"unknown key (expected one of: {expected})")
        return value

    def array_of_tables(self, value: object, path: KeyPath, name: str) -> list[object]:
        """The ``[[name]]`` tables at ``path``: none when the value is not an array (reported)."""
        if isinstance(value, list):
            return value
        self.report(path, f"expected an array of tables ([[{name}]]), got {described(value)}")
        return []

    def required(self, tbl: Table, path: KeyPath, keys: Sequence[str]) -> None:
        for key in keys:
            if key not in tbl:
                self.report((*path, key), "required key is missing")

    def given(
        self, tbl: Table, path: KeyPath, key: str, accepts: Callable[[object], TypeGuard[_T]],
        expected: str, shown: Callable[[object], str] = described,
    ) -> _T | None:
        """``tbl[key]`` if ``accepts`` it; None when absent, or reported as not ``expected``."""
        if key not in tbl:
            return None
        value = tbl[key]
        if not accepts(value):
            self.report((*path, key), f"expected {expected}, got {shown(value)}")
            return None
        return value

    def string(self, tbl: Table, path: KeyPath, key: str) -> str | None:
        value = self.given(tbl, path, key, _is_str, "a string")
        if value is None:
            return None
        if not value.strip():
            self.report((*path, key), "must not be empty")
            return None
        return value

    def choice(
        self, tbl: Table, path: KeyPath, key: str, choices: Sequence[str], noun: str
    ) -> str | None:
        value = self.string(tbl, path, key)
        if value is None or value in choices:
            return value
        expected = ", ".join(choices)
        self.report((*path, key), f"{value!r} is not a valid {noun} (expected one of: {expected})")
        return None

    def choices(
        self, tbl: Table, path: KeyPath, key: str, choices: Sequence[str], noun: str
    ) -> tuple[str, ...] | None:
        """An array of distinct choices, each checked on its own line and index."""
        items = self.strings(tbl, path, key)
        if items is None:
            return None
        expected = ", ".join(choices)
        for where, item in items:
            if item not in choices:
                self.report(where, f"{item!r} is not a valid {noun} (expected one of: {expected})")
        return tuple(dict.fromkeys(item for _, item in items if item in choices))

    def boolean(self, tbl: Table, path: KeyPath, key: str) -> bool | None:
        return self.given(tbl, path, key, _is_bool, "a boolean")

    def integer(
        self,
        tbl: Table,
        path: KeyPath,
        key: str,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> int | None:
        value = self.given(tbl, path, key, _is_integer, "an integer")
        if value is None:
            return None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            self.report((*path, key), _range_message(value, minimum, maximum, above=False))
            return None
        return value

    def number(
        self,
        tbl: Table,
        path: KeyPath,
        key: str,
        *,
        minimum: float | None = None,
        above: bool = False,
        maximum: float | None = None,
    ) -> float | None:
        """A finite float; integers are accepted (``interval_s = 5``)."""
        value = self.given(tbl, path, key, _is_number, "a number")
        if value is None:
            return None
        if not math.isfinite(value):
            self.report((*path, key), f"must be a finite number, got {literal(value)}")
            return None
        too_low = minimum is not None and (value <= minimum if above else value < minimum)
        if too_low or (maximum is not None and value > maximum):
            self.report((*path, key), _range_message(value, minimum, maximum, above))
            return None
        return float(value)

    def strings(self, tbl: Table, path: KeyPath, key: str) -> list[tuple[KeyPath, str]] | None:
        """An array of strings, each with its own path for messages."""
        value = self.given(tbl, path, key, _is_array, "an array of strings")
        if value is None:
            return None
        items: list[tuple[KeyPath, str]] = []
        for index, item in enumerate(value, 1):
            where = (*path, key, index)
            if isinstance(item, str):
                items.append((where, item))
            else:
                self.report(where, f"expected a string, got {described(item)}")
        return items

    def secret(self, value: object, where: KeyPath) -> str | None:
        """A bearer secret; messages never quote it (they end up in logs)."""
        if not isinstance(value, str):
            self.report(where, f"expected a string, got {_type_only(value)}")
            return None
        problem = secret_problem(value)
        if problem is not None:
            self.report(where, problem)
            return None
        return value

    def secrets(self, tbl: Table, path: KeyPath, key: str) -> tuple[str, ...] | None:
        """An array of secrets; the good ones are kept."""
        raw = self.given(tbl, path, key, _is_array, "an array of strings", _type_only)
        if raw is None:
            return None
        return tuple(
            secret
            for index, item in enumerate(raw, 1)
            if (secret := self.secret(item, (*path, key, index))) is not None
        )
