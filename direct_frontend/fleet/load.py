"""Read a fleet file into a :class:`~direct_frontend.fleet.schema.FleetConfig`.

Every rule of the fleet file lives here. The checker keeps going after a
problem (substituting the default so later checks still run) and raises one
:class:`FleetError` with all of them, so an operator fixes a file in one
pass. Only :func:`load_fleet` touches the filesystem, and only to read the
file: whether the tokenizer directory exists is a run-time question.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import math
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from direct_frontend.engines.neutral import EngineRole
from direct_frontend.fleet.locate import KeyPath, Locator
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import (
    ENGINE_KINDS,
    ROUTING_POLICIES,
    AdminConfig,
    AuthConfig,
    EngineConfig,
    EngineKind,
    FaultsConfig,
    FleetConfig,
    FrontendConfig,
    Knobs,
    KnobValue,
    LimitsConfig,
    ProbeConfig,
    RoutingConfig,
    RoutingPolicy,
    SimulatorConfig,
)

__all__ = [
    "FleetError", "FleetProblem", "field_name", "load_fleet", "parse_fleet", "parse_fleet_bytes",
]

_T = TypeVar("_T")
Table = dict[str, object]
Endpoint = tuple[str, int]  # host (IPv6 without brackets), port

_TOP_KEYS = ("frontend", "engine")
_FRONTEND_KEYS = (
    "listen",
    "served_model_name",
    "tokenizer",
    "max_body_bytes",
    "max_tokens_default",
    "request_timeout_s",
    "log_json",
    "drain_timeout_s",
    "routing",
    "probe",
    "admin",
    "auth",
    "faults",
    "limits",
)
_FAULTS_KEYS = ("max_retries", "max_migrations", "stall_timeout_s", "drain_migrate_after_s")
_LIMITS_KEYS = ("max_in_flight", "max_queue", "queue_timeout_s")
_ADMIN_KEYS = ("enabled", "token")
_AUTH_KEYS = ("api_keys",)
_ROUTING_KEYS = ("policy", "knobs")
_PROBE_KEYS = (
    "interval_s",
    "timeout_s",
    "failure_threshold",
    "success_threshold",
    "join_timeout_s",
)
_ENGINE_KEYS = (
    "name",
    "url",
    "kind",
    "role",
    "kv_events",
    "kv_replay",
    "context_length",
    "block_size",
    "bootstrap_port",
    "simulate",
    "simulator",
)
_SIMULATOR_KEYS = (
    "prefill_us_per_token",
    "decode_us_per_token",
    "max_running",
    "vocab_size",
    "eos_probability",
    "context_length",
    "served_model_name",
)
_ROLES = tuple(role.value for role in EngineRole)

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")
_SYNTAX_AT = re.compile(
    r"^(?P<msg>.*) \(at (?:line (?P<line>\d+), column (?P<col>\d+)|end of document)\)$"
)


def load_fleet(path: Path) -> FleetConfig:
    """Read and check the fleet file at ``path``; raise :class:`FleetError` on any problem."""
    file = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise FleetError(
            [FleetProblem(file, None, "", f"cannot read the file: {reason}")]
        ) from None
    return parse_fleet_bytes(raw, path)


def parse_fleet_bytes(raw: bytes, source: Path) -> FleetConfig:
    """Check the fleet file's bytes (already read, e.g. to hash them for a reload)."""
    file = str(source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        message = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        raise FleetError([FleetProblem(file, line, "", message)]) from None
    return parse_fleet(text.removeprefix("\ufeff"), source)


def parse_fleet(text: str, source: Path) -> FleetConfig:
    """Check fleet-file ``text`` read from ``source``; raise :class:`FleetError` on any problem.

    ``source`` names the file in messages (as given) and anchors a relative
    tokenizer path; it is never opened.
    """
    file = str(source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FleetError([_syntax_problem(file, text, exc)]) from None
    checker = _Checker(file, Locator(text))
    fleet = checker.fleet(data, source)
    if checker.problems:
        # File order reads best; problems with no line (missing keys) go first.
        ordered = sorted(checker.problems, key=lambda p: -1 if p.line is None else p.line)
        raise FleetError(ordered)
    return fleet


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


def _syntax_problem(file: str, text: str, exc: tomllib.TOMLDecodeError) -> FleetProblem:
    """Turn tomllib's message into a problem carrying its line and column."""
    found = _SYNTAX_AT.match(str(exc))
    if found is None:
        return FleetProblem(file, None, "", f"invalid TOML: {exc}")
    message = found["msg"]
    if found["line"] is not None:
        line, column = int(found["line"]), int(found["col"])
    else:  # "at end of document"
        line = text.count("\n") + 1
        column = len(text) - (text.rfind("\n") + 1) + 1
    message = message[:1].lower() + message[1:]
    return FleetProblem(file, line, "", f"invalid TOML: {message}", column)


def _literal(value: object) -> str:
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


def _describe(value: object) -> str:
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
    return f"{kind} {_literal(value)}"


def _kind(value: object) -> str:
    """The type of a value without the value itself (for secrets)."""
    return _describe(value).split(" ", 1)[0]


def _range_message(value: float, minimum: float | None, maximum: float | None, above: bool) -> str:
    got = _literal(value)
    if minimum is not None and maximum is not None:
        return f"must be between {minimum} and {maximum}, got {got}"
    if minimum is not None:
        return f"must be {'greater than' if above else 'at least'} {minimum}, got {got}"
    return f"must be at most {maximum}, got {got}"


def _valid_host(host: str) -> bool:
    """A hostname or an IP literal; all-numeric names must be real IPv4 addresses."""
    if not _HOSTNAME.fullmatch(host):
        return False
    if all(label.isdigit() for label in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
    return True


def _host_port(text: str, *, min_port: int, scheme: str) -> Endpoint | str:
    """Split ``host:port`` (IPv6 in brackets); a reason string when it is not one."""
    form = f"{scheme}://host:port" if scheme else "host:port"
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            return "the IPv6 address has no closing ']'"
        host, rest = text[1:close], text[close + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{host!r} is not an IPv6 address"
        if not rest.startswith(":"):
            return f"the port is missing (expected {form})"
        port_text = rest[1:]
    else:
        if ":" not in text:
            return f"the port is missing (expected {form})"
        host, _, port_text = text.rpartition(":")
        if ":" in host:
            return "an IPv6 address must be in brackets, like [::1]:port"
        if not host:
            return f"the host is missing (expected {form})"
        if not _valid_host(host):
            return f"{host!r} is not a valid host name or IP address"
    if not port_text:
        return f"the port is missing (expected {form})"
    if not (port_text.isascii() and port_text.isdigit()):
        return f"the port {port_text!r} is not a number"
    port = int(port_text)
    if not min_port <= port <= 65535:
        return f"the port must be between {min_port} and 65535, got {port}"
    return host, port


def _split_url(text: str, scheme: str) -> Endpoint | str | None:
    """Parse ``scheme://host:port``: the endpoint, a reason, or None if not URL-shaped."""
    sep = text.find("://")
    if sep <= 0:
        return None
    if text[:sep] != scheme:
        return f"the scheme must be {scheme}://, not {text[:sep]}://"
    rest = text[sep + 3 :]
    if any(ch in rest for ch in "/?#"):
        return f"only {scheme}://host:port is allowed (no path, query or fragment)"
    if "@" in rest:
        return "user info is not allowed"
    if rest.startswith("*:"):
        return f"'*' is a bind address; give the host to connect to ({scheme}://host:port)"
    return _host_port(rest, min_port=1, scheme=scheme)


def _endpoint_text(endpoint: Endpoint) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _endpoint_key(endpoint: Endpoint) -> Endpoint:
    """Endpoints compare case-insensitively by host (DNS names are case-blind)."""
    return endpoint[0].lower(), endpoint[1]


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@dataclasses.dataclass(slots=True)
class _Draft:
    """An engine as checked so far, with what the cross-engine checks need."""

    index: int
    config: EngineConfig
    name_given: bool
    endpoint: Endpoint | None  # None when the url is missing or invalid
    kv: list[tuple[KeyPath, Endpoint]]


class _Checker:
    """Walks the parsed TOML, recording every problem with its line."""

    def __init__(self, file: str, locator: Locator) -> None:
        self.file = file
        self.locator = locator
        self.problems: list[FleetProblem] = []

    def report(self, path: KeyPath, message: str) -> None:
        line = self.locator.line_of(path)
        self.problems.append(FleetProblem(self.file, line, field_name(path), message))

    # -- typed getters: None when absent or invalid (invalid is reported) ----

    def table(self, value: object, path: KeyPath, keys: Sequence[str] | None) -> Table | None:
        if not isinstance(value, dict):
            self.report(path, f"expected a table, got {_describe(value)}")
            return None
        if keys is not None:
            expected = ", ".join(keys)
            for key in value:
                if key not in keys:
                    self.report((*path, key), f"unknown key (expected one of: {expected})")
        return value

    def required(self, tbl: Table, path: KeyPath, *keys: str) -> None:
        for key in keys:
            if key not in tbl:
                self.report((*path, key), "required key is missing")

    def string(self, tbl: Table, path: KeyPath, key: str) -> str | None:
        if key not in tbl:
            return None
        value = tbl[key]
        if not isinstance(value, str):
            self.report((*path, key), f"expected a string, got {_describe(value)}")
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

    def boolean(self, tbl: Table, path: KeyPath, key: str) -> bool | None:
        if key not in tbl:
            return None
        value = tbl[key]
        if not isinstance(value, bool):
            self.report((*path, key), f"expected a boolean, got {_describe(value)}")
            return None
        return value

    def integer(
        self,
        tbl: Table,
        path: KeyPath,
        key: str,
        *,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int | None:
        if key not in tbl:
            return None
        value = tbl[key]
        if isinstance(value, bool) or not isinstance(value, int):
            self.report((*path, key), f"expected an integer, got {_describe(value)}")
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
        minimum: float = 0,
        above: bool = False,
        maximum: float | None = None,
    ) -> float | None:
        """A finite float; integers are accepted (``interval_s = 5``)."""
        if key not in tbl:
            return None
        value = tbl[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.report((*path, key), f"expected a number, got {_describe(value)}")
            return None
        if not math.isfinite(value):
            self.report((*path, key), f"must be a finite number, got {_literal(value)}")
            return None
        too_low = value <= minimum if above else value < minimum
        if too_low or (maximum is not None and value > maximum):
            self.report((*path, key), _range_message(value, minimum, maximum, above))
            return None
        return float(value)

    def strings(self, tbl: Table, path: KeyPath, key: str) -> list[tuple[KeyPath, str]] | None:
        """An array of strings, each with its own path for messages."""
        if key not in tbl:
            return None
        value = tbl[key]
        if not isinstance(value, list):
            self.report((*path, key), f"expected an array of strings, got {_describe(value)}")
            return None
        items: list[tuple[KeyPath, str]] = []
        for index, item in enumerate(value, 1):
            where = (*path, key, index)
            if isinstance(item, str):
                items.append((where, item))
            else:
                self.report(where, f"expected a string, got {_describe(item)}")
        return items

    def url(self, text: str, path: KeyPath, scheme: str, noun: str) -> Endpoint | None:
        parsed = _split_url(text, scheme)
        if isinstance(parsed, tuple):
            return parsed
        reason = "" if parsed is None else f": {parsed}"
        self.report(path, f"{text!r} is not a valid {noun}{reason}")
        return None

    # -- sections --------------------------------------------------------------

    def fleet(self, data: Table, source: Path) -> FleetConfig:
        self.table(data, (), _TOP_KEYS)
        frontend = self.frontend(data.get("frontend", {}), source)
        drafts = self.engines(data.get("engine", []))
        self.cross_check(drafts)
        engines = tuple(draft.config for draft in drafts)
        return FleetConfig(frontend=frontend, engines=engines, source=source)

    def frontend(self, value: object, source: Path) -> FrontendConfig:
        path: KeyPath = ("frontend",)
        tbl = self.table(value, path, _FRONTEND_KEYS)
        if tbl is None:
            tbl = {}
        self.required(tbl, path, "served_model_name", "tokenizer")
        default = FrontendConfig(served_model_name="", tokenizer=Path())
        host, port = default.listen_host, default.listen_port
        listen = self.string(tbl, path, "listen")
        if listen is not None:
            parsed = _host_port(listen, min_port=0, scheme="")
            if isinstance(parsed, str):
                message = f"{listen!r} is not a valid listen address: {parsed}"
                self.report((*path, "listen"), message)
            else:
                host, port = parsed
        tokenizer = self.string(tbl, path, "tokenizer")
        if tokenizer is not None and tokenizer.startswith("~"):
            message = f"{tokenizer!r}: '~' is not expanded; write the full path"
            self.report((*path, "tokenizer"), message)
        return FrontendConfig(
            listen_host=host,
            listen_port=port,
            served_model_name=_or(self.string(tbl, path, "served_model_name"), ""),
            # Relative to the fleet file, so a fleet directory can be moved whole.
            tokenizer=source.parent / tokenizer if tokenizer is not None else Path(),
            max_body_bytes=_or(
                self.integer(tbl, path, "max_body_bytes", minimum=1), default.max_body_bytes
            ),
            max_tokens_default=_or(
                self.integer(tbl, path, "max_tokens_default", minimum=1), default.max_tokens_default
            ),
            request_timeout_s=_or(
                self.number(tbl, path, "request_timeout_s", above=True), default.request_timeout_s
            ),
            log_json=_or(self.boolean(tbl, path, "log_json"), default.log_json),
            drain_timeout_s=_or(
                self.number(tbl, path, "drain_timeout_s"), default.drain_timeout_s
            ),
            routing=self.routing(tbl.get("routing", {}), (*path, "routing")),
            probe=self.probe(tbl.get("probe", {}), (*path, "probe")),
            admin=self.admin(tbl.get("admin", {}), (*path, "admin")),
            auth=self.auth(tbl.get("auth", {}), (*path, "auth")),
            faults=self.faults(tbl.get("faults", {}), (*path, "faults")),
            limits=self.limits(tbl.get("limits", {}), (*path, "limits")),
        )

    def faults(self, value: object, path: KeyPath) -> FaultsConfig:
        tbl = self.table(value, path, _FAULTS_KEYS)
        default = FaultsConfig()
        if tbl is None:
            return default
        return FaultsConfig(
            max_retries=_or(
                self.integer(tbl, path, "max_retries", minimum=0), default.max_retries
            ),
            max_migrations=_or(
                self.integer(tbl, path, "max_migrations", minimum=0), default.max_migrations
            ),
            stall_timeout_s=_or(
                self.number(tbl, path, "stall_timeout_s", above=True), default.stall_timeout_s
            ),
            drain_migrate_after_s=_or(
                self.number(tbl, path, "drain_migrate_after_s"), default.drain_migrate_after_s
            ),
        )

    def limits(self, value: object, path: KeyPath) -> LimitsConfig:
        tbl = self.table(value, path, _LIMITS_KEYS)
        default = LimitsConfig()
        if tbl is None:
            return default
        return LimitsConfig(
            max_in_flight=_or(
                self.integer(tbl, path, "max_in_flight", minimum=1), default.max_in_flight
            ),
            max_queue=_or(self.integer(tbl, path, "max_queue", minimum=0), default.max_queue),
            queue_timeout_s=_or(
                self.number(tbl, path, "queue_timeout_s"), default.queue_timeout_s
            ),
        )

    def admin(self, value: object, path: KeyPath) -> AdminConfig:
        tbl = self.table(value, path, _ADMIN_KEYS)
        if tbl is None:
            return AdminConfig()
        return AdminConfig(
            enabled=_or(self.boolean(tbl, path, "enabled"), AdminConfig().enabled),
            token=self.secret(tbl["token"], (*path, "token")) if "token" in tbl else None,
        )

    def auth(self, value: object, path: KeyPath) -> AuthConfig:
        tbl = self.table(value, path, _AUTH_KEYS)
        if tbl is None or "api_keys" not in tbl:
            return AuthConfig()
        raw = tbl["api_keys"]
        if not isinstance(raw, list):
            self.report((*path, "api_keys"), f"expected an array of strings, got {_kind(raw)}")
            return AuthConfig()
        keys = [
            key
            for index, item in enumerate(raw, 1)
            if (key := self.secret(item, (*path, "api_keys", index))) is not None
        ]
        return AuthConfig(api_keys=tuple(keys))

    def secret(self, value: object, where: KeyPath) -> str | None:
        """A bearer secret; messages never quote it (they end up in logs)."""
        if not isinstance(value, str):
            self.report(where, f"expected a string, got {_kind(value)}")
            return None
        if not value or any(ch.isspace() or not ch.isprintable() for ch in value):
            self.report(where, "must be non-empty, without spaces or control characters")
            return None
        return value

    def routing(self, value: object, path: KeyPath) -> RoutingConfig:
        tbl = self.table(value, path, _ROUTING_KEYS)
        if tbl is None:
            return RoutingConfig()
        policy: RoutingPolicy = "round_robin"
        policy_text = self.choice(tbl, path, "policy", ROUTING_POLICIES, "policy")
        for known in ROUTING_POLICIES:  # narrows the string to the Literal
            if policy_text == known:
                policy = known
        knobs: dict[str, KnobValue] = {}
        raw_knobs = self.table(tbl.get("knobs", {}), (*path, "knobs"), None)
        for key, knob in (raw_knobs or {}).items():
            if isinstance(knob, str | int | float | bool):
                knobs[key] = knob
            else:
                message = f"expected a string, number or boolean, got {_describe(knob)}"
                self.report((*path, "knobs", key), message)
        if policy == "kv_aware":
            self.kv_knobs(knobs, (*path, "knobs"))
        return RoutingConfig(policy=policy, knobs=Knobs(knobs))

    def kv_knobs(self, knobs: dict[str, KnobValue], path: KeyPath) -> None:
        """The kv_aware policy's knobs: known names, numbers, sensible ranges."""
        from direct_frontend.routing.kv_aware import KvKnobs

        defaults = KvKnobs()
        known = {name: getattr(defaults, name) for name in KvKnobs.__dataclass_fields__}
        for key, value in knobs.items():
            where = (*path, key)
            if key not in known:
                self.report(where, f"unknown key (expected one of: {', '.join(sorted(known))})")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                self.report(where, f"expected a number, got {_describe(value)}")
            elif isinstance(known[key], int) and not isinstance(value, int):
                self.report(where, f"expected an integer, got {_describe(value)}")
            elif key in ("block_size", "approx_max_blocks") and value < 1:
                self.report(where, "must be at least 1")
            elif value < 0:
                self.report(where, "must not be negative")

    def probe(self, value: object, path: KeyPath) -> ProbeConfig:
        tbl = self.table(value, path, _PROBE_KEYS)
        if tbl is None:
            return ProbeConfig()
        default = ProbeConfig()
        return ProbeConfig(
            interval_s=_or(self.number(tbl, path, "interval_s", above=True), default.interval_s),
            timeout_s=_or(self.number(tbl, path, "timeout_s", above=True), default.timeout_s),
            failure_threshold=_or(
                self.integer(tbl, path, "failure_threshold", minimum=1), default.failure_threshold
            ),
            success_threshold=_or(
                self.integer(tbl, path, "success_threshold", minimum=1), default.success_threshold
            ),
            join_timeout_s=_or(
                self.number(tbl, path, "join_timeout_s", above=True), default.join_timeout_s
            ),
        )

    def engines(self, value: object) -> list[_Draft]:
        if not isinstance(value, list):
            message = f"expected an array of tables ([[engine]]), got {_describe(value)}"
            self.report(("engine",), message)
            return []
        drafts = [self.engine(item, index) for index, item in enumerate(value, 1)]
        return [draft for draft in drafts if draft is not None]

    def engine(self, value: object, index: int) -> _Draft | None:
        path: KeyPath = ("engine", index)
        tbl = self.table(value, path, _ENGINE_KEYS)
        if tbl is None:
            return None
        self.required(tbl, path, "url", "kind")

        url = self.string(tbl, path, "url")
        endpoint = None if url is None else self.url(url, (*path, "url"), "grpc", "URL")

        kind: EngineKind = "sglang"
        kind_text = self.choice(tbl, path, "kind", ENGINE_KINDS, "engine kind")
        for known in ENGINE_KINDS:  # narrows the string to the Literal
            if kind_text == known:
                kind = known
        role_text = self.choice(tbl, path, "role", _ROLES, "role")
        role = EngineRole.BOTH if role_text is None else EngineRole(role_text)
        if kind_text == "trtllm" and role is not EngineRole.BOTH:
            self.report((*path, "role"), 'trtllm engines have no P/D roles; use role = "both"')

        name = self.string(tbl, path, "name")
        if name is not None and any(ch.isspace() or not ch.isprintable() for ch in name):
            self.report((*path, "name"), f"{name!r} has spaces or control characters")
        if name is None and "name" not in tbl and endpoint is not None:
            name = _endpoint_text(endpoint)  # the documented default: host:port

        kv: list[tuple[KeyPath, Endpoint]] = []
        events = self.endpoints(tbl, path, "kv_events", kv)
        replay = self.endpoints(tbl, path, "kv_replay", kv)
        raw_events, raw_replay = tbl.get("kv_events", []), tbl.get("kv_replay")
        if isinstance(raw_replay, list) and isinstance(raw_events, list):
            given, wanted = len(raw_replay), len(raw_events)
            if given != wanted:
                message = (
                    f"has {_plural(given, 'endpoint')} but kv_events has {wanted}"
                    " (one replay endpoint per data-parallel rank, in the same order)"
                )
                self.report((*path, "kv_replay"), message)

        bootstrap_port = self.integer(tbl, path, "bootstrap_port", minimum=1, maximum=65535)
        if bootstrap_port is not None:
            self.check_bootstrap(path, bootstrap_port, kind_text, role, endpoint)

        simulate = self.boolean(tbl, path, "simulate")
        simulator = SimulatorConfig()
        if "simulator" in tbl:
            if simulate:
                simulator = self.simulator(tbl["simulator"], (*path, "simulator"))
            elif "simulate" not in tbl or simulate is False:
                self.report((*path, "simulator"), "only allowed with simulate = true")
        if simulate and endpoint is not None and not _is_loopback(endpoint[0]):
            message = f"a simulated engine listens on 127.0.0.1; use grpc://127.0.0.1:{endpoint[1]}"
            self.report((*path, "url"), message)

        config = EngineConfig(
            name=_or(name, ""),
            url=_or(url, ""),
            kind=kind,
            role=role,
            kv_events=events,
            kv_replay=replay,
            context_length=self.integer(tbl, path, "context_length", minimum=1),
            block_size=self.integer(tbl, path, "block_size", minimum=1),
            bootstrap_port=bootstrap_port,
            simulate=_or(simulate, False),
            simulator=simulator,
        )
        return _Draft(index, config, "name" in tbl, endpoint, kv)

    def endpoints(
        self, tbl: Table, path: KeyPath, key: str, seen: list[tuple[KeyPath, Endpoint]]
    ) -> tuple[str, ...]:
        """ZMQ ``tcp://host:port`` endpoints; valid ones are added to ``seen``."""
        items = self.strings(tbl, path, key) or []
        for where, text in items:
            endpoint = self.url(text, where, "tcp", "ZMQ endpoint")
            if endpoint is not None:
                seen.append((where, endpoint))
        return tuple(text for _, text in items)

    def check_bootstrap(
        self,
        path: KeyPath,
        port: int,
        kind: str | None,
        role: EngineRole,
        endpoint: Endpoint | None,
    ) -> None:
        where = (*path, "bootstrap_port")
        if kind is not None and kind != "sglang":
            self.report(where, f"only sglang engines have a bootstrap port (this one is {kind})")
        elif role is EngineRole.DECODE:
            self.report(where, "only prefill engines run a bootstrap server (role is decode)")
        if endpoint is not None and endpoint[1] == port:
            self.report(where, f"must differ from the gRPC port in url ({port})")

    def simulator(self, value: object, path: KeyPath) -> SimulatorConfig:
        tbl = self.table(value, path, _SIMULATOR_KEYS)
        if tbl is None:
            return SimulatorConfig()
        default = SimulatorConfig()
        return SimulatorConfig(
            prefill_us_per_token=_or(
                self.number(tbl, path, "prefill_us_per_token"), default.prefill_us_per_token
            ),
            decode_us_per_token=_or(
                self.number(tbl, path, "decode_us_per_token"), default.decode_us_per_token
            ),
            max_running=_or(self.integer(tbl, path, "max_running", minimum=1), default.max_running),
            vocab_size=self.integer(tbl, path, "vocab_size", minimum=1),
            eos_probability=_or(
                self.number(tbl, path, "eos_probability", maximum=1), default.eos_probability
            ),
            context_length=_or(
                self.integer(tbl, path, "context_length", minimum=1), default.context_length
            ),
            served_model_name=self.string(tbl, path, "served_model_name"),
        )

    def cross_check(self, drafts: list[_Draft]) -> None:
        """Rules between engines: unique URLs, names, simulator ports and KV endpoints."""
        urls: dict[Endpoint, int] = {}
        names: dict[str, int] = {}
        sim_ports: dict[int, int] = {}
        kv_seen: dict[Endpoint, KeyPath] = {}
        for draft in drafts:
            cfg, url_path = draft.config, ("engine", draft.index, "url")
            url_clash = False
            if draft.endpoint is not None:
                first = urls.setdefault(_endpoint_key(draft.endpoint), draft.index)
                if first != draft.index:
                    url_clash = True
                    self.report(url_path, f"{cfg.url!r} is already used by engine[{first}]")
                elif cfg.simulate:
                    port = draft.endpoint[1]
                    other = sim_ports.setdefault(port, draft.index)
                    if other != draft.index:
                        message = f"port {port} is already used by simulated engine[{other}]"
                        self.report(url_path, message)
            if cfg.name and not (url_clash and not draft.name_given):
                first = names.setdefault(cfg.name, draft.index)
                if first != draft.index:
                    derived = "" if draft.name_given else " (derived from the url)"
                    message = f"{cfg.name!r}{derived} is already used by engine[{first}]"
                    self.report(("engine", draft.index, "name"), message)
            for where, endpoint in draft.kv:
                first_kv = kv_seen.setdefault(_endpoint_key(endpoint), where)
                if first_kv != where:
                    text = f"tcp://{_endpoint_text(endpoint)}"
                    self.report(where, f"{text!r} is already used by {field_name(first_kv)}")
