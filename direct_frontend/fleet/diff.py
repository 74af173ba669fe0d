"""What a new fleet file changes against the running fleet (sans-IO).

Works on the JSON form of a fleet (:func:`~direct_frontend.fleet.describe.to_jsonable`),
so the same code diffs a reload in the daemon (two loaded files) and
``check --against`` (a file against a daemon's ``GET /fleet``). Engines are
matched by name: one whose settings differ in any way is *changed* (replaced
by a new incarnation), one with no match is added or removed. ``[frontend]``
settings are compared leaf by leaf and split into those a running daemon
applies at once and those that need a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from direct_frontend.fleet.describe import JsonValue, to_jsonable
from direct_frontend.fleet.schema import EngineConfig, FleetConfig

_V = TypeVar("_V")

#: ``[frontend]`` settings a running daemon cannot change: the listening socket, the
#: tokenizer loaded at start, the model name every engine was admitted against, and the
#: log format chosen at start (the command line may override it), the tracer and the replica
#: link built at start, and the context assumed for engines that report none (read as each
#: engine joins).
RESTART_FIELDS = (
    "listen", "tokenizer", "served_model_name", "log_json", "tracing", "replicas", "workers",
    "responses", "default_context_length",
)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineChange:
    """An engine present in both fleets whose settings differ (``fields``: dotted names)."""

    name: str
    fields: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FleetDiff:
    """The engine and frontend changes between a running fleet and a new file."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[EngineChange, ...] = ()
    unchanged: tuple[str, ...] = ()
    live: tuple[str, ...] = ()  # [frontend] fields applied without a restart
    restart: tuple[str, ...] = ()  # [frontend] fields that need a restart
    #: [[model]] tables by name (a file without them has none to diff: [frontend] is its model)
    models_added: tuple[str, ...] = ()
    models_removed: tuple[str, ...] = ()
    models_changed: tuple[EngineChange, ...] = ()
    #: [[pool]] tables by name: a changed one is watched anew (its pods relisted)
    pools_added: tuple[str, ...] = ()
    pools_removed: tuple[str, ...] = ()
    pools_changed: tuple[EngineChange, ...] = ()

    @property
    def pools_differ(self) -> bool:
        return bool(self.pools_added or self.pools_removed or self.pools_changed)

    @property
    def models_differ(self) -> bool:
        return bool(self.models_added or self.models_removed or self.models_changed)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.live or self.restart
                    or self.models_differ or self.pools_differ)

    @property
    def changed_names(self) -> tuple[str, ...]:
        return tuple(change.name for change in self.changed)

    def lines(self) -> list[str]:
        """The diff for people, one change per line (``+`` add, ``-`` remove, ``~`` replace)."""
        if self.empty:
            return ["no changes"]
        out = [f"+ model {name} (serves once an engine of it joins)" for name in self.models_added]
        out += [f"- model {name} (new requests get a 404; its requests finish)"
                for name in self.models_removed]
        out += [f"~ model {c.name} ({', '.join(c.fields)})" for c in self.models_changed]
        out += [f"+ pool {name} (its Ready pods join)" for name in self.pools_added]
        out += [f"- pool {name} (its engines drain, then leave)" for name in self.pools_removed]
        out += [f"~ pool {c.name} (relisted: {', '.join(c.fields)})" for c in self.pools_changed]
        out += [f"+ engine {name} (joins: probe first, then serves)" for name in self.added]
        out += [f"- engine {name} (drains, then leaves)" for name in self.removed]
        out += [
            f"~ engine {c.name} (replaced: {', '.join(c.fields)})" for c in self.changed
        ]
        out += [f"~ frontend.{name} (applies live)" for name in self.live]
        out += [f"! frontend.{name} (needs a restart; keeps its running value)"
                for name in self.restart]
        if self.unchanged:
            out.append(f"= {len(self.unchanged)} engine(s) unchanged: {', '.join(self.unchanged)}")
        return out

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "added": list(self.added),
            "removed": list(self.removed),
            "changed": [{"name": c.name, "fields": list(c.fields)} for c in self.changed],
            "unchanged": list(self.unchanged),
            "live": list(self.live),
            "restart": list(self.restart),
            "models_added": list(self.models_added),
            "models_removed": list(self.models_removed),
            "models_changed": [{"name": c.name, "fields": list(c.fields)}
                               for c in self.models_changed],
            "pools_added": list(self.pools_added),
            "pools_removed": list(self.pools_removed),
            "pools_changed": [{"name": c.name, "fields": list(c.fields)}
                              for c in self.pools_changed],
        }


def diff_fleets(old: FleetConfig, new: FleetConfig) -> FleetDiff:
    """Diff two loaded fleets, secrets included (so a rotated token is a change)."""
    return diff_fleet_data(to_jsonable(old, redact=False), to_jsonable(new, redact=False))


def diff_fleet_data(old: Mapping[str, Any], new: Mapping[str, Any]) -> FleetDiff:
    """Diff two fleets in their JSON form (``to_jsonable``)."""
    added, removed, changed, unchanged = _match(
        _by_name(old, "engines"), _by_name(new, "engines"), _changed_names)
    models = _match(_by_name(old, "models"), _by_name(new, "models"), _changed_names)
    pools = _match(_by_name(old, "pools"), _by_name(new, "pools"), _changed_names)
    live: list[str] = []
    restart: list[str] = []
    # With [[model]] tables these two are the first model's, and models change live.
    derived = ("served_model_name", "tokenizer") if _by_name(new, "models") else ()
    for leaf in _changed_leaves(old.get("frontend", {}), new.get("frontend", {})):
        name = ".".join(leaf)
        if name in derived:
            continue
        (restart if leaf and leaf[0] in RESTART_FIELDS else live).append(name)
    return FleetDiff(added, removed, changed, unchanged, tuple(live), tuple(restart),
                     models_added=models[0], models_removed=models[1], models_changed=models[2],
                     pools_added=pools[0], pools_removed=pools[1], pools_changed=pools[2])


def diff_engines(old: FleetConfig, new: FleetConfig) -> FleetDiff:
    """Only the engine changes between two fleets that differ in nothing else.

    For pool membership, event by event: it compares the engines' settings as
    values (field by field, no JSON form of the whole fleet), so its cost is
    one pass over the engines.
    """
    before = {engine.name: engine for engine in old.engines}
    after = {engine.name: engine for engine in new.engines}
    added, removed, changed, unchanged = _match(before, after, _changed_fields)
    return FleetDiff(added=added, removed=removed, changed=changed, unchanged=unchanged)


def _changed_fields(old: EngineConfig, new: EngineConfig) -> Iterator[str]:
    """The names of the fields that differ between two engines' settings."""
    if old != new:
        yield from (f.name for f in dataclasses.fields(new)
                    if getattr(old, f.name) != getattr(new, f.name))


def as_in_file(fleet: Mapping[str, Any]) -> dict[str, Any]:
    """A running fleet's JSON form without the engines its pools found (not in any file)."""
    engines = [engine for engine in fleet.get("engines", []) if not engine.get("pool")]
    return {**fleet, "engines": engines}


def _by_name(fleet: Mapping[str, Any], key: str) -> dict[str, Mapping[str, Any]]:
    """Engines, or the ``[[model]]`` tables (an implicit model is [frontend]'s: not listed)."""
    return {item["name"]: item for item in fleet.get(key, []) if not item.get("implicit")}


def _match(
    old: Mapping[str, _V], new: Mapping[str, _V], changes: Callable[[_V, _V], Iterable[str]]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[EngineChange, ...], tuple[str, ...]]:
    """(added, removed, changed, unchanged) names between two sets of tables matched by name.

    ``changes`` names what differs between two tables of the same name.
    """
    added = tuple(name for name in new if name not in old)
    removed = tuple(name for name in old if name not in new)
    changed: list[EngineChange] = []
    unchanged: list[str] = []
    for name, item in new.items():
        before = old.get(name)
        if before is None:
            continue
        fields = tuple(changes(before, item))
        if fields:
            changed.append(EngineChange(name, fields))
        else:
            unchanged.append(name)
    return added, removed, tuple(changed), tuple(unchanged)


def _changed_names(old: Mapping[str, Any], new: Mapping[str, Any]) -> Iterator[str]:
    """The dotted names of the values that differ between two tables in JSON form."""
    return (".".join(leaf) for leaf in _changed_leaves(old, new))


def _changed_leaves(old: Any, new: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The paths of the values that differ; tables are walked, arrays compared whole."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in (*old, *(k for k in new if k not in old)):
            if key == "name" and not path:
                continue  # engines are matched by name; a rename is a remove and an add
            yield from _changed_leaves(old.get(key), new.get(key), (*path, key))
    elif old != new:
        yield path


@dataclasses.dataclass(frozen=True, slots=True)
class ReloadResult:
    """The outcome of one reload: applied (with its diff) or rejected (with its problems).

    ``version`` is the config version running afterwards: it grows by one
    whenever a reload applied something, and stays put when one is rejected.
    """

    ok: bool
    trigger: str  # "file", "signal" or "api"
    at: float
    version: int
    digest: str  # sha256 of the file read, "" if it could not be read
    errors: tuple[str, ...] = ()
    diff: FleetDiff | None = None

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "ok": self.ok,
            "trigger": self.trigger,
            "at": self.at,
            "version": self.version,
            "digest": self.digest,
            "errors": list(self.errors),
            "diff": None if self.diff is None else self.diff.to_json(),
        }
