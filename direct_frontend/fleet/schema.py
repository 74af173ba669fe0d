"""The fleet file as typed, immutable values.

Everything is a frozen dataclass so a loaded fleet can be shared between
tasks, compared against a reloaded one and hashed without copying. Nothing
here reads files or validates: :mod:`direct_frontend.fleet.load` builds these
from TOML and is where every rule lives; the defaults below are the documented
defaults of the fleet file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

from direct_frontend.engines.neutral import EngineRole

RoutingPolicy = Literal["round_robin", "least_loaded", "kv_aware"]
EngineKind = Literal["sglang", "vllm", "trtllm"]
KnobValue = float | int | str | bool

ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("round_robin", "least_loaded", "kv_aware")
ENGINE_KINDS: tuple[EngineKind, ...] = ("sglang", "vllm", "trtllm")


class Knobs(Mapping[str, KnobValue]):
    """A read-only, hashable mapping of routing knobs.

    ``MappingProxyType`` would be read-only too, but it is unhashable and
    would make every enclosing frozen dataclass unhashable with it.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, KnobValue] | None = None) -> None:
        self._items: dict[str, KnobValue] = dict(items or {})

    def __getitem__(self, key: str) -> KnobValue:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"Knobs({self._items!r})"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    """``[frontend.routing]``: the policy and its knobs (``[frontend.routing.knobs]``).

    Knobs are kept as plain values because each policy defines its own; the
    policy, not the loader, interprets them.
    """

    policy: RoutingPolicy = "round_robin"
    knobs: Mapping[str, KnobValue] = Knobs()

    def __post_init__(self) -> None:
        if not isinstance(self.knobs, Knobs):
            object.__setattr__(self, "knobs", Knobs(self.knobs))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FaultsConfig:
    """``[frontend.faults]``: how requests survive engine failures.

    A request that fails before its first token is retried on another engine
    (``max_retries`` times); one that fails after it is migrated, continuing
    from the tokens already produced (``max_migrations`` times). An engine
    silent for ``stall_timeout_s`` mid-stream counts as failed. A removed
    engine's streams still running ``drain_migrate_after_s`` into its drain
    are migrated to other engines (0 disables: they run until the drain timeout).
    """

    max_retries: int = 2
    max_migrations: int = 3
    stall_timeout_s: float = 30.0
    drain_migrate_after_s: float = 10.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LimitsConfig:
    """``[frontend.limits]``: admission control, so a burst never melts the daemon down.

    Past ``max_in_flight`` requests wait in a FIFO queue of ``max_queue``
    places for at most ``queue_timeout_s``; beyond that they get a 429.
    """

    max_in_flight: int = 1024
    max_queue: int = 1024
    queue_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    """``[frontend.probe]``: how engines are health-checked.

    The timeout is generous because SGLang's health check runs a real
    one-token generation, which queues behind a busy batch.
    """

    interval_s: float = 5.0
    timeout_s: float = 2.0
    failure_threshold: int = 3  # consecutive failures before an engine is taken out
    success_threshold: int = 2  # consecutive successes before it is put back
    join_timeout_s: float = 30.0  # discovery + first probe of a new engine


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AdminConfig:
    """``[frontend.admin]``: the fleet view and control endpoints (``/fleet``...).

    ``token`` is a secret: it is kept out of ``repr`` so it never reaches a log.
    """

    enabled: bool = True
    token: str | None = dataclasses.field(default=None, repr=False)  # bearer token, if required


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AuthConfig:
    """``[frontend.auth]``: bearer keys the OpenAI endpoints require (none: open)."""

    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FrontendConfig:
    """``[frontend]``: the OpenAI-facing side of the daemon."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8000
    served_model_name: str
    tokenizer: Path  # model directory with tokenizer.json, resolved against the fleet file
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_default: int = 1024  # used when a request gives no max_tokens
    request_timeout_s: float = 600.0
    routing: RoutingConfig = RoutingConfig()
    probe: ProbeConfig = ProbeConfig()
    log_json: bool = False
    drain_timeout_s: float = 30.0  # a removed engine's in-flight requests get this long
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    faults: FaultsConfig = FaultsConfig()
    limits: LimitsConfig = LimitsConfig()

    @property
    def listen(self) -> str:
        """The listen address as written in the fleet file (IPv6 in brackets)."""
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{host}:{self.listen_port}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SimulatorConfig:
    """``[engine.simulator]``: the timing and shape of an embedded simulated engine."""

    prefill_us_per_token: float = 20.0
    decode_us_per_token: float = 2000.0
    max_running: int = 64
    vocab_size: int | None = None  # None: the tokenizer's vocabulary
    eos_probability: float = 0.02
    context_length: int = 4096
    served_model_name: str | None = None  # None: the frontend's (set it to demo a refusal)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """One ``[[engine]]``: where an engine is and what the fleet file says about it.

    ``context_length``, ``block_size`` and a ``role`` other than ``both``
    override what discovery reads from the engine, because some engine kinds
    do not report these facts or report a misleading value.
    """

    name: str
    url: str  # grpc://host:port
    kind: EngineKind
    role: EngineRole = EngineRole.BOTH
    kv_events: tuple[str, ...] = ()  # ZMQ tcp://host:port, one per data-parallel rank
    kv_replay: tuple[str, ...] = ()  # empty, or one per kv_events endpoint
    context_length: int | None = None
    block_size: int | None = None
    bootstrap_port: int | None = None  # SGLang P/D bootstrap server of a prefill engine
    simulate: bool = False  # run an embedded simulator on url's port instead
    simulator: SimulatorConfig = SimulatorConfig()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    """A whole fleet file: the frontend and its engines (possibly none yet)."""

    frontend: FrontendConfig
    engines: tuple[EngineConfig, ...] = ()
    source: Path
