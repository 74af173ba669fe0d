"""Read a fleet file into a :class:`~direct_frontend.fleet.schema.FleetConfig`.

The schema says what each table holds, and :class:`~.checker.Checker` reads
it by that; the rules here are the ones that are not a field's type or range:
the listen address and the tokenizer path, URLs and KV endpoints, P/D roles
and bootstrap ports (by what each engine kind's dialect can do), the
simulator gate, and the rules between engines. The checker keeps going after
a problem (substituting the default so later checks still run) and raises one
:class:`FleetError` with all of them, so an operator fixes a file in one
pass. Only :func:`load_fleet` touches the filesystem to read the file, and
:mod:`~direct_frontend.fleet.keys` reads the API keys the file points at
(an environment variable, a keys file): whether the tokenizer directory
exists is a run-time question.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from direct_frontend.engines.neutral import EngineRole
from direct_frontend.fleet.address import (
    Endpoint,
    endpoint_key,
    endpoint_text,
    host_port,
    is_loopback,
    split_url,
)
from direct_frontend.fleet.bus import REPLICAS_FILES, replicas_problems
from direct_frontend.fleet.checker import (
    Table,
    default_of,
    described,
    field_name,
    keys_of,
    required_keys,
)
from direct_frontend.fleet.keys import AuthTables, KeySources, process_sources
from direct_frontend.fleet.locate import KeyPath, Locator
from direct_frontend.fleet.models import ModelTables
from direct_frontend.fleet.pools import PoolTables
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import (
    SESSION_CACHE_KEY_FIELD,
    SESSION_HEADER_PREFIX,
    SESSION_USER_FIELD,
    EngineConfig,
    FleetConfig,
    FrontendConfig,
    Knobs,
    KnobValue,
    KvAwareKnobs,
    ReplicasConfig,
    ResponsesConfig,
    RoutingConfig,
    SessionSource,
    SimulatorConfig,
    implicit_model,
)
from direct_frontend.observability import tracing
from direct_frontend.observability.redact import redact_url

__all__ = [
    "FleetError", "FleetProblem", "field_name", "load_fleet", "parse_fleet", "parse_fleet_bytes",
]

_D = TypeVar("_D")

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


def parse_fleet_bytes(
    raw: bytes, source: Path, *, sources: KeySources | None = None
) -> FleetConfig:
    """Check the fleet file's bytes (already read, e.g. to hash them for a reload)."""
    file = str(source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        message = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        raise FleetError([FleetProblem(file, line, "", message)]) from None
    return parse_fleet(text.removeprefix("\ufeff"), source, sources=sources)


def parse_fleet(text: str, source: Path, *, sources: KeySources | None = None) -> FleetConfig:
    """Check fleet-file ``text`` read from ``source``; raise :class:`FleetError` on any problem.

    ``source`` names the file in messages (as given) and anchors relative
    paths; it is never opened. ``[frontend.auth]``'s ``api_keys_env`` and
    ``api_keys_file`` are read from ``sources`` (default: this process's
    environment and filesystem).
    """
    file = str(source)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FleetError([_syntax_problem(file, text, exc)]) from None
    checker = _Checker(file, Locator(text), sources or process_sources())
    fleet = checker.fleet(data, source)
    if checker.problems:
        # File order reads best; problems with no line (missing keys) go first.
        ordered = sorted(checker.problems, key=lambda p: -1 if p.line is None else p.line)
        raise FleetError(ordered)
    return fleet


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


class _Checker(PoolTables, ModelTables, AuthTables):
    """The fleet file's own rules, on top of the schema-driven reads."""

    def url(self, text: str, path: KeyPath, scheme: str, noun: str) -> Endpoint | None:
        parsed = split_url(text, scheme)
        if isinstance(parsed, tuple):
            return parsed
        reason = "" if parsed is None else f": {parsed}"
        self.report(path, f"{redact_url(text)!r} is not a valid {noun}{reason}")
        return None

    def section(self, cls: type[_D], value: object, path: KeyPath) -> _D:
        if cls is RoutingConfig:
            return cast(_D, self.routing(value, path))
        return super().section(cls, value, path)

    def fleet(self, data: Table, source: Path) -> FleetConfig:
        self.table(data, (), keys_of(FleetConfig))
        frontend = self.frontend(data.get("frontend", {}), source, "model" in data)
        models = self.models(data.get("model", []), frontend, source)
        frontend = self.resolve_frontend(frontend, models)
        drafts = self.engines(data.get("engine", []))
        pools = self.pools(data.get("pool", []), models or [implicit_model(frontend)])
        if data.get("engine", []) == [] and not data.get("pool") and not frontend.allow_empty_fleet:
            self.refuse_empty(data)
        self.cross_check(drafts)
        self.engine_models([(draft.index, draft.config) for draft in drafts], models)
        engines = tuple(draft.config for draft in drafts)
        return FleetConfig(frontend=frontend, models=tuple(models), engines=engines,
                           pools=tuple(pools), source=source)

    def refuse_empty(self, data: Table) -> None:
        """No engines is far more often a file cut short than a wish: say so, unless allowed.

        A reload of such a file would drain the whole fleet; a start would
        serve nothing. The problem sits where the engines are missing: on
        ``engine = []`` if written, else at the end of the file.
        """
        message = (
            "no [[engine]] or [[pool]] tables (is the file cut short?); add engines, or set"
            " allow_empty_fleet = true in [frontend] to run with none"
        )
        if "engine" in data:
            self.report(("engine",), message)
        else:
            self.problems.append(
                FleetProblem(self.file, self.locator.last_line, "engine", message)
            )

    def frontend(self, value: object, source: Path, has_models: bool) -> FrontendConfig:
        path: KeyPath = ("frontend",)
        tbl = self.table(value, path, keys_of(FrontendConfig))
        if tbl is None:
            tbl = {}
        self.required(tbl, path, required_keys(FrontendConfig))
        self.frontend_model_keys(tbl, has_models)
        host = default_of(FrontendConfig, "listen_host")
        port = default_of(FrontendConfig, "listen_port")
        listen = self.string(tbl, path, "listen")
        if listen is not None:
            parsed = host_port(listen, min_port=0, scheme="")
            if isinstance(parsed, str):
                message = f"{listen!r} is not a valid listen address: {parsed}"
                self.report((*path, "listen"), message)
            else:
                host, port = parsed
        tokenizer = self.string(tbl, path, "tokenizer")
        if tokenizer is not None and tokenizer.startswith("~"):
            message = f"{tokenizer!r}: '~' is not expanded; write the full path"
            self.report((*path, "tokenizer"), message)
        by_hand = {
            "listen_host": host,
            "listen_port": port,
            "workers": self.workers(tbl, path),
            # Relative to the fleet file, so a fleet directory can be moved whole.
            "tokenizer": None if tokenizer is None else source.parent / tokenizer,
            "auth": self.auth(tbl.get("auth", {}), (*path, "auth"), source),
            "tenants": self.tenants(tbl.get("tenants", {}), (*path, "tenants")),
        }
        frontend = FrontendConfig(**self.fields(FrontendConfig, tbl, path, by_hand))
        self.check_tracing(frontend.tracing.otlp_endpoint, (*path, "tracing", "otlp_endpoint"))
        self.check_store(frontend.responses, (*path, "responses"))
        return dataclasses.replace(
            frontend, replicas=self.replicas(frontend.replicas, source, (*path, "replicas")))

    def replicas(self, replicas: ReplicasConfig, source: Path, path: KeyPath) -> ReplicasConfig:
        """``[frontend.replicas]``'s rules between keys; its files resolved against the fleet's."""
        for key, message in replicas_problems(replicas):
            self.report((*path, key), message)
        files: dict[str, Any] = {key: str(source.parent / value) for key in REPLICAS_FILES
                                 if (value := getattr(replicas, key)) is not None}
        return dataclasses.replace(replicas, **files)

    def check_store(self, responses: ResponsesConfig, where: KeyPath) -> None:
        """A postgres backend names its database; each backend's keys are its own."""
        if responses.backend == "postgres" and responses.dsn is None:
            self.report((*where, "backend"), "the postgres backend needs dsn, its database "
                        "as a postgresql:// URL")
        if responses.backend != "postgres" and responses.dsn is not None:
            self.report((*where, "dsn"), f"dsn is for the postgres backend, not "
                        f"{responses.backend!r}")
        if responses.backend != "sqlite" and responses.path is not None:
            self.report((*where, "path"), f"path is for the sqlite backend, not "
                        f"{responses.backend!r}")
        if responses.path is not None and responses.path.startswith("~"):
            self.report((*where, "path"), f"{responses.path!r}: '~' is not expanded; write "
                        "the full path")

    def workers(self, tbl: Table, path: KeyPath) -> int:
        """``workers``: a count of at least 1, or ``"auto"`` (read as 0: one per core)."""
        if tbl.get("workers") == "auto":
            return 0
        if isinstance(tbl.get("workers"), str):
            self.report((*path, "workers"), f"expected an integer or \"auto\", got "
                        f"{described(tbl['workers'])}")
            return 1
        count = self.integer(tbl, path, "workers", minimum=1)
        return 1 if count is None else count

    def check_tracing(self, endpoint: str | None, where: KeyPath) -> None:
        """An OTLP/HTTP endpoint is an http(s) URL, and sending to it needs the tracing extra."""
        if endpoint is None:
            return
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            self.report(where, f"{redact_url(endpoint)!r} is not an http:// or https:// URL")
        elif not tracing.available():
            self.report(where, f"tracing needs the OpenTelemetry packages: {tracing.EXTRA_HINT}")

    def routing(self, value: object, path: KeyPath) -> RoutingConfig:
        tbl = self.table(value, path, keys_of(RoutingConfig))
        if tbl is None:
            return RoutingConfig()
        policy: str | None = self.read(RoutingConfig, "policy", tbl, path)
        knobs: dict[str, KnobValue] = {}
        raw_knobs = self.table(tbl.get("knobs", {}), (*path, "knobs"), None)
        for key, knob in (raw_knobs or {}).items():
            if isinstance(knob, str | int | float | bool):
                knobs[key] = knob
            else:
                message = f"expected a string, number or boolean, got {described(knob)}"
                self.report((*path, "knobs", key), message)
        kv_aware = None
        if policy in ("kv_aware", "cache_affinity"):  # the baseline reads the same knobs
            kv_aware = self.knobs(KvAwareKnobs, knobs, (*path, "knobs"))
        by_hand = {"policy": policy, "knobs": Knobs(knobs), "kv_aware": kv_aware,
                   "session_key": self.session_key(tbl, path)}
        return RoutingConfig(**self.fields(RoutingConfig, tbl, path, by_hand))

    def session_key(self, tbl: Table, path: KeyPath) -> tuple[SessionSource, ...]:
        """``session_key``: each entry ``user``, ``prompt_cache_key`` or ``header:<name>``."""
        sources = []
        for where, text in self.strings(tbl, path, "session_key") or []:
            source = SessionSource.parse(text)
            if source is None:
                self.report(where, f"{text!r} is neither {SESSION_USER_FIELD!r}, "
                            f"{SESSION_CACHE_KEY_FIELD!r} nor '{SESSION_HEADER_PREFIX}<name>'")
            else:
                sources.append(source)
        return tuple(sources)

    def engines(self, value: object) -> list[_Draft]:
        tables = self.array_of_tables(value, ("engine",), "engine")
        drafts = [self.engine(item, index) for index, item in enumerate(tables, 1)]
        return [draft for draft in drafts if draft is not None]

    def engine(self, value: object, index: int) -> _Draft | None:
        path: KeyPath = ("engine", index)
        tbl = self.table(value, path, keys_of(EngineConfig))
        if tbl is None:
            return None
        self.required(tbl, path, required_keys(EngineConfig))

        url: str | None = self.read(EngineConfig, "url", tbl, path)
        endpoint = None if url is None else self.url(url, (*path, "url"), "grpc", "URL")

        kind: str | None = self.read(EngineConfig, "kind", tbl, path)
        role: EngineRole | None = self.read(EngineConfig, "role", tbl, path)
        if role is not None and kind is not None:
            self.check_role(path, kind, role)

        name = self.engine_name(tbl, path, endpoint)
        kv: list[tuple[KeyPath, Endpoint]] = []
        events = self.endpoints(tbl, path, "kv_events", kv)
        replay = self.endpoints(tbl, path, "kv_replay", kv)
        self.check_rank_counts(tbl, path)

        bootstrap_port: int | None = self.read(EngineConfig, "bootstrap_port", tbl, path)
        if bootstrap_port is not None:
            self.check_bootstrap(path, bootstrap_port, kind, role, endpoint)

        simulate: bool | None = self.read(EngineConfig, "simulate", tbl, path)
        simulator = self.simulated(tbl, path, simulate, endpoint, kv)

        by_hand = {
            "name": name,
            "url": url,
            "kind": kind,
            "role": role,
            "kv_events": events,
            "kv_replay": replay,
            "bootstrap_port": bootstrap_port,
            "simulate": simulate,
            "simulator": simulator,
            "pool": None,
            "pod_uid": None,
        }
        config = EngineConfig(**self.fields(EngineConfig, tbl, path, by_hand))
        return _Draft(index, config, "name" in tbl, endpoint, kv)

    def engine_name(self, tbl: Table, path: KeyPath, endpoint: Endpoint | None) -> str | None:
        """``name``: printable without spaces; absent, it is the url's ``host:port``."""
        name: str | None = self.read(EngineConfig, "name", tbl, path)
        if name is not None and any(ch.isspace() or not ch.isprintable() for ch in name):
            self.report((*path, "name"), f"{name!r} has spaces or control characters")
        if name is None and "name" not in tbl and endpoint is not None:
            name = endpoint_text(endpoint)  # the documented default: host:port
        return name

    def check_rank_counts(self, tbl: Table, path: KeyPath) -> None:
        """``kv_replay`` and ``dp_ranks`` agree with the number of ``kv_events`` endpoints."""
        raw_events, raw_replay = tbl.get("kv_events", []), tbl.get("kv_replay")
        if isinstance(raw_replay, list) and isinstance(raw_events, list):
            given, wanted = len(raw_replay), len(raw_events)
            if given != wanted:
                message = (
                    f"has {_plural(given, 'endpoint')} but kv_events has {wanted}"
                    " (one replay endpoint per data-parallel rank, in the same order)"
                )
                self.report((*path, "kv_replay"), message)
        raw_ranks = tbl.get("dp_ranks")
        if type(raw_ranks) is int and isinstance(raw_events, list) and raw_events \
                and raw_ranks != len(raw_events):
            self.report((*path, "dp_ranks"), (
                f"is {raw_ranks} but kv_events has {_plural(len(raw_events), 'endpoint')}"
                " (one per data-parallel rank)"))

    def simulated(
        self, tbl: Table, path: KeyPath, simulate: bool | None, endpoint: Endpoint | None,
        kv: list[tuple[KeyPath, Endpoint]],
    ) -> SimulatorConfig | None:
        """``[engine.simulator]`` (only with ``simulate = true``) and a simulator's own rules."""
        simulator = None
        if "simulator" in tbl:
            if simulate:
                simulator = self.section(SimulatorConfig, tbl["simulator"], (*path, "simulator"))
            elif "simulate" not in tbl or simulate is False:
                self.report((*path, "simulator"), "only allowed with simulate = true")
        if simulate and endpoint is not None and not is_loopback(endpoint[0]):
            message = f"a simulated engine listens on 127.0.0.1; use grpc://127.0.0.1:{endpoint[1]}"
            self.report((*path, "url"), message)
        if simulate:
            self.check_simulated_ranks(path, kv)
        return simulator

    def check_simulated_ranks(self, path: KeyPath, kv: list[tuple[KeyPath, Endpoint]]) -> None:
        """A simulated engine of several ranks publishes as vLLM does: base port + rank."""
        for key in ("kv_events", "kv_replay"):
            ports = [(where, endpoint[1]) for where, endpoint in kv if where[-2] == key]
            for rank, (where, port) in enumerate(ports):
                if rank and port != ports[0][1] + rank:
                    self.report(where, (
                        f"a simulated engine's rank {rank} publishes on the first endpoint's "
                        f"port + {rank}: use port {ports[0][1] + rank}"))

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
                first = urls.setdefault(endpoint_key(draft.endpoint), draft.index)
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
                first_kv = kv_seen.setdefault(endpoint_key(endpoint), where)
                if first_kv != where:
                    text = f"tcp://{endpoint_text(endpoint)}"
                    self.report(where, f"{text!r} is already used by {field_name(first_kv)}")
