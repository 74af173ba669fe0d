"""The fleet file as typed, immutable values.

Everything is a frozen dataclass so a loaded fleet can be shared between
tasks, compared against a reloaded one and hashed without copying. Nothing
here reads files or validates: :mod:`direct_frontend.fleet.load` builds these
from TOML. The schema is written down once, here: the fields are the keys of
each table (in the order messages list them), their types and defaults are the
fleet file's, and each field's :class:`Rules` (its metadata) carry its bounds,
which :mod:`direct_frontend.fleet.checker` checks. Only the rules that are not
a field's type or range (addresses, URLs, rules between fields and between
engines) are written by hand, in :mod:`direct_frontend.fleet.load`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

from direct_frontend.engines.neutral import EngineRole
from direct_frontend.fleet.address import endpoint_text
from direct_frontend.fleet.frontend_tables import (
    ACCESS_FIELDS as ACCESS_FIELDS,
)
from direct_frontend.fleet.frontend_tables import (
    AccessField as AccessField,
)
from direct_frontend.fleet.frontend_tables import (
    AccessLogConfig as AccessLogConfig,
)
from direct_frontend.fleet.frontend_tables import (
    BatchesConfig as BatchesConfig,
)
from direct_frontend.fleet.frontend_tables import (
    KubernetesConfig as KubernetesConfig,
)
from direct_frontend.fleet.frontend_tables import (
    ReplicasConfig as ReplicasConfig,
)
from direct_frontend.fleet.frontend_tables import (
    ResponsesConfig as ResponsesConfig,
)
from direct_frontend.fleet.frontend_tables import (
    StoreBackend as StoreBackend,
)
from direct_frontend.fleet.frontend_tables import (
    TenantConfig as TenantConfig,
)
from direct_frontend.fleet.frontend_tables import (
    TenantField as TenantField,
)
from direct_frontend.fleet.frontend_tables import (
    TenantsConfig as TenantsConfig,
)
from direct_frontend.fleet.frontend_tables import (
    TracingConfig as TracingConfig,
)
from direct_frontend.fleet.rules import (
    AT_LEAST_ONE as AT_LEAST_ONE,
)
from direct_frontend.fleet.rules import (
    NON_NEGATIVE as NON_NEGATIVE,
)
from direct_frontend.fleet.rules import (
    POSITIVE as POSITIVE,
)
from direct_frontend.fleet.rules import (
    Rules as Rules,
)
from direct_frontend.fleet.rules import (
    setting as setting,
)

RoutingPolicy = Literal["round_robin", "least_loaded", "kv_aware", "cache_affinity"]
EngineKind = Literal["sglang", "vllm", "trtllm"]
KnobValue = float | int | str | bool

ROUTING_POLICIES: tuple[RoutingPolicy, ...] = typing.get_args(RoutingPolicy)
ENGINE_KINDS: tuple[EngineKind, ...] = typing.get_args(EngineKind)

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
class KvAwareKnobs:
    """``[frontend.routing.knobs]`` for ``policy = "kv_aware"`` (the README's knob table)."""

    # = the engines' KV block size (vLLM block_size, SGLang page size)
    block_size: int = setting(16, AT_LEAST_ONE)
    # blocks of queue one block to prefill is worth (this request's own prefill) …
    overlap_weight: float = setting(1.0, NON_NEGATIVE)
    # … plus this much × how full the engine's cache would be with it stored: a block stored
    # in a full cache evicts someone else's, who prefills it again
    eviction_weight: float = setting(2.0, NON_NEGATIVE)
    # blocks of prefill one request in flight is worth (its decode slows every step), the same
    # whether the overlap comes from KV events or the approximate memory
    in_flight_weight: float = setting(4.0, NON_NEGATIVE)
    temperature: float = setting(0.0, NON_NEGATIVE)
    # the load guard spills when the chosen engine has this many requests above the mean …
    balance_abs_threshold: float = setting(32.0, NON_NEGATIVE)
    # … and this many times the mean
    balance_rel_threshold: float = setting(1.5, NON_NEGATIVE)
    # … or, where the chosen engine's prefill queue is over this many blocks (twice the fleet's
    # mean, 3 requests or more), when it has twice the mean and 2 above it (0: never)
    balance_backlog_blocks: float = setting(64.0, NON_NEGATIVE)
    # where KV events flow, a block a request we sent an engine is storing there (its events
    # have not shown it yet) counts this much of a cached one
    memory_weight: float = setting(1.0, Rules(at_least=0, at_most=1))
    approx_ttl_s: float = setting(120.0, NON_NEGATIVE)
    approx_max_blocks: int = setting(1 << 20, AT_LEAST_ONE)
    # an engine's prefix-cache capacity in blocks, for the approximate memory's LRU model
    # (0: unknown, trust the TTL)
    approx_capacity_blocks: int = setting(0, NON_NEGATIVE)
    # engine blocks per block of the approximate memory: it models only what was sent, so a
    # coarser unit costs less per prompt block and matches to this many blocks
    approx_unit_blocks: int = setting(4, AT_LEAST_ONE)


#: ``session_key`` entries: ``header:<name>`` (case-insensitive), ``user`` or
#: ``prompt_cache_key`` (the body fields; OpenAI's key for requests that share a cache)
SESSION_USER_FIELD = "user"
SESSION_CACHE_KEY_FIELD = "prompt_cache_key"
SESSION_HEADER_PREFIX = "header:"


@dataclasses.dataclass(frozen=True, slots=True)
class SessionSource:
    """One ``session_key`` entry, read once: where a request's routing key is looked up."""

    written: str  # as in the fleet file (what ``check`` and ``/fleet`` show)
    field: str | None  # the body field (``user`` or ``prompt_cache_key``); None for a header
    header: str | None  # the header's name in lower case, as ASGI gives it; None for a field

    @classmethod
    def parse(cls, text: str) -> SessionSource | None:
        """The entry ``text`` names; None when it names neither a field nor a header."""
        if text in (SESSION_USER_FIELD, SESSION_CACHE_KEY_FIELD):
            return cls(text, text, None)
        name = text.removeprefix(SESSION_HEADER_PREFIX)
        if name == text or not name.strip():
            return None
        return cls(text, None, name.strip().lower())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    """``[frontend.routing]``: the policy and its knobs (``[frontend.routing.knobs]``).

    ``knobs`` is the table as written (what ``check`` shows and a reload
    compares); ``kv_aware`` is what the ``kv_aware`` policy reads, built from
    it by the loader (the defaults under any other policy, which takes no knobs).
    """

    policy: RoutingPolicy = setting("round_robin", Rules(noun="policy"))
    knobs: Mapping[str, KnobValue] = Knobs()
    kv_aware: KvAwareKnobs = setting(KvAwareKnobs(), Rules(key="knobs"))
    #: session affinity (routing/affinity.py): where a request's routing key comes from,
    #: first found wins (``"header:x-session-id"``, ``"user"``); empty: no affinity
    session_key: tuple[SessionSource, ...] = ()
    #: under kv_aware, the cost in blocks of leaving the key's engine
    session_weight: float = setting(8.0, NON_NEGATIVE)
    #: under kv_aware, a prefix no engine holds goes to its first block's rendezvous engine
    #: (replicas placing one new prefix at once agree where), at ``session_weight``
    cold_prefix_home: bool = False

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
    A request that needs an engine (to start, retry or migrate) when none it
    can use serves waits up to ``wait_for_engine_s`` for one to come back
    (0: it fails at once).
    """

    max_retries: int = setting(2, NON_NEGATIVE)
    max_migrations: int = setting(3, NON_NEGATIVE)
    stall_timeout_s: float = setting(30.0, POSITIVE)
    drain_migrate_after_s: float = setting(10.0, NON_NEGATIVE)
    wait_for_engine_s: float = setting(5.0, NON_NEGATIVE)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LimitsConfig:
    """``[frontend.limits]``: admission control, so a burst never melts the daemon down.

    Past ``max_in_flight`` requests wait in a queue of ``max_queue`` places
    (fair between tenants, by tier) for at most ``queue_timeout_s``; beyond
    that they get a 429. A ``service_tier: "flex"`` request may wait
    ``flex_queue_timeout_s``, and is admitted only while ``flex_reserve``
    slots stay free after it for the interactive tiers (absent: an eighth of
    ``max_in_flight``, at least 1). With ``preempt``, a request of a tenant
    short of its fair share that finds no slot takes one running request of
    a tenant past its share off its engine; that one resumes token-exactly
    when a slot frees, and gives way at most ``max_preemptions`` times
    (pipeline/preempt.py).
    """

    max_in_flight: int = setting(1024, AT_LEAST_ONE)
    max_queue: int = setting(1024, NON_NEGATIVE)
    queue_timeout_s: float = setting(10.0, NON_NEGATIVE)
    flex_queue_timeout_s: float = setting(600.0, NON_NEGATIVE)
    flex_reserve: int | None = setting(None, NON_NEGATIVE)
    preempt: bool = True
    max_preemptions: int = setting(2, NON_NEGATIVE)

    @property
    def flex_reserve_slots(self) -> int:
        """The slots a flex request leaves free: ``flex_reserve``, or its default."""
        if self.flex_reserve is not None:
            return self.flex_reserve
        return max(1, self.max_in_flight // 8)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    """``[frontend.probe]``: how engines are health-checked.

    The timeout is generous because SGLang's health check runs a real
    one-token generation, which queues behind a busy batch.
    """

    interval_s: float = setting(5.0, POSITIVE)
    timeout_s: float = setting(2.0, POSITIVE)
    # consecutive failures before an engine is taken out
    failure_threshold: int = setting(3, AT_LEAST_ONE)
    # consecutive successes before it is put back
    success_threshold: int = setting(2, AT_LEAST_ONE)
    join_timeout_s: float = setting(30.0, POSITIVE)  # discovery + first probe of a new engine
    # after each healthy probe, ask the engine (SGLang, vLLM GetLoads) for its requests from
    # every client, so routing weighs what other routers and clients send it too
    read_loads: bool = True


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AdminConfig:
    """``[frontend.admin]``: the fleet view and control endpoints (``/fleet``...).

    ``token`` is a secret: it is kept out of ``repr`` so it never reaches a log.
    """

    enabled: bool = True
    token: str | None = setting(None, Rules(secret=True))  # bearer token, if required


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AuthConfig:
    """``[frontend.auth]``: bearer keys the OpenAI endpoints require (none: open).

    Each key is an owner: what one key stores (responses, background
    responses) no other key can see. ``tenant_header`` narrows the owner to
    the tenant a trusted gateway names in that header, within the key (a key
    never reaches another key's objects, whatever header it sends).

    ``api_keys`` is every key, resolved by the loader (:mod:`direct_frontend.fleet.keys`):
    those written here, plus those of the environment variable ``api_keys_env``
    names and of the file ``api_keys_file`` names, read at each load and reload.
    """

    api_keys: tuple[str, ...] = setting((), Rules(secret=True))
    api_keys_env: str | None = None  # a variable of keys separated by commas or whitespace
    # a file of keys, one a line (# comments), resolved against the fleet file
    api_keys_file: Path | None = None
    tenant_header: str | None = None  # e.g. "x-tenant-id"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FrontendConfig:
    """``[frontend]``: the OpenAI-facing side of the daemon."""

    listen_host: str = setting("127.0.0.1", Rules(key="listen"))
    listen_port: int = setting(8000, Rules(key="listen"))
    # a fleet of one model; with [[model]] tables, absent: the first model's
    served_model_name: str = dataclasses.field(metadata={"rules": Rules(derived=True)})
    # model directory with tokenizer.json, resolved against the fleet file; with [[model]]
    # tables, the tokenizer of a model that names none (absent: the first model's)
    tokenizer: Path = dataclasses.field(metadata={"rules": Rules(derived=True)})
    max_body_bytes: int = setting(4 * 1024 * 1024, AT_LEAST_ONE)
    max_tokens_default: int = setting(1024, AT_LEAST_ONE)  # used when a request gives no max_tokens
    # the context of an engine that reports none (TensorRT-LLM) and has no context_length in
    # the file or its [[model]]: prompts past it are refused, long ones before tokenizing
    default_context_length: int = setting(131_072, AT_LEAST_ONE)
    request_timeout_s: float = setting(600.0, POSITIVE)
    # a request head must arrive whole within this long of its first byte (the connection closes)
    header_timeout_s: float = setting(10.0, POSITIVE)
    # a request body must arrive whole within this long (else a 408), however slowly it trickles
    body_timeout_s: float = setting(30.0, POSITIVE)
    log_json: bool = False
    # a removed engine's in-flight requests get this long
    drain_timeout_s: float = setting(30.0, NON_NEGATIVE)
    # a file with no [[engine]] is refused (a truncated file would empty the fleet) unless true
    allow_empty_fleet: bool = False
    # processes serving the port (run --workers, control/workers.py); 0: "auto", one per core
    workers: int = setting(1, NON_NEGATIVE)
    routing: RoutingConfig = RoutingConfig()
    probe: ProbeConfig = ProbeConfig()
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    faults: FaultsConfig = FaultsConfig()
    limits: LimitsConfig = LimitsConfig()
    tracing: TracingConfig = TracingConfig()
    access_log: AccessLogConfig = AccessLogConfig()
    tenants: TenantsConfig = TenantsConfig()
    replicas: ReplicasConfig = ReplicasConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    responses: ResponsesConfig = ResponsesConfig()
    batches: BatchesConfig = BatchesConfig()

    @property
    def listen(self) -> str:
        """The listen address as written in the fleet file (IPv6 in brackets)."""
        return endpoint_text((self.listen_host, self.listen_port))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SimulatorConfig:
    """``[engine.simulator]``: the timing and shape of an embedded simulated engine."""

    prefill_us_per_token: float = setting(20.0, NON_NEGATIVE)
    decode_us_per_token: float = setting(2000.0, NON_NEGATIVE)
    max_running: int = setting(64, AT_LEAST_ONE)
    vocab_size: int | None = setting(None, AT_LEAST_ONE)  # None: the tokenizer's vocabulary
    eos_probability: float = setting(0.02, Rules(at_least=0, at_most=1))
    # chance per token of a non-ASCII character spelled over several tokens (é, 中, 🚀), to
    # exercise a client's incremental decoding; 0: plain ASCII words, so a length cut never
    # splits a character
    multibyte_probability: float = setting(0.0, Rules(at_least=0, at_most=1))
    context_length: int = setting(4096, AT_LEAST_ONE)
    # None: the frontend's (set it to demo a refusal)
    served_model_name: str | None = None
    # LoRA adapters it holds at once (0: none; SGLang only: the contract that loads them)
    max_loras: int = setting(0, NON_NEGATIVE)
    lora_load_ms: float = setting(50.0, NON_NEGATIVE)  # how long loading one takes
    # above 0: an embedding model of that many dimensions (Embed answers, Generate is
    # refused; SGLang and vLLM only); 0: a generation model
    embedding_dim: int = setting(0, NON_NEGATIVE)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """One ``[[engine]]``: where an engine is and what the fleet file says about it.

    ``context_length``, ``block_size`` and a ``role`` other than ``both``
    override what discovery reads from the engine, because some engine kinds
    do not report these facts or report a misleading value.
    """

    # absent: the url's host:port
    name: str = dataclasses.field(metadata={"rules": Rules(derived=True)})
    url: str  # grpc://host:port
    kind: EngineKind = dataclasses.field(metadata={"rules": Rules(noun="engine kind")})
    role: EngineRole = setting(EngineRole.BOTH, Rules(noun="role"))
    kv_events: tuple[str, ...] = ()  # ZMQ tcp://host:port, one per data-parallel rank
    kv_replay: tuple[str, ...] = ()  # empty, or one per kv_events endpoint
    #: data-parallel ranks KV-aware routing pins requests to when the engine publishes no KV
    #: events (with kv_events, one rank per endpoint); absent: the engine balances its ranks
    dp_ranks: int | None = setting(None, Rules(at_least=1, at_most=256))
    context_length: int | None = setting(None, AT_LEAST_ONE)
    block_size: int | None = setting(None, AT_LEAST_ONE)
    # SGLang P/D bootstrap server of a prefill engine
    bootstrap_port: int | None = setting(None, Rules(at_least=1, at_most=65535))
    simulate: bool = False  # run an embedded simulator on url's port instead
    simulator: SimulatorConfig = SimulatorConfig()
    # the [[model]] it serves (a name or alias); absent: what its discovery reports
    model: str | None = None
    # an engine a [[pool]] found: the pool's name and the pod's UID (never in the file)
    pool: str | None = setting(None, Rules(in_file=False))
    pod_uid: str | None = setting(None, Rules(in_file=False))


#: the pod annotations a pool reads an engine's ports from (else the pool's ports)
GRPC_PORT_ANNOTATION = "direct-frontend.io/grpc-port"
KV_EVENTS_PORT_ANNOTATION = "direct-frontend.io/kv-events-port"
KV_REPLAY_PORT_ANNOTATION = "direct-frontend.io/kv-replay-port"
PORT = Rules(at_least=1, at_most=65535)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    """One ``[[pool]]``: engines found by a Kubernetes label selector, not listed by hand.

    Each pod that is Ready, has an IP and is not being deleted becomes an
    engine ``<pool>/<pod>`` at ``grpc://<pod IP>:<port>``, with the pool's
    settings (those of a file ``[[engine]]``). A port comes from the pod's
    annotation when it has one, else from the pool. Serving and prefill pools
    of one P/D fleet are two pools (two selectors) with their own ``role``.
    """

    name: str
    namespace: str = "default"
    selector: str  # a label selector, as kubectl -l takes it: "app=vllm,tier in (a,b)"
    kind: EngineKind = dataclasses.field(metadata={"rules": Rules(noun="engine kind")})
    role: EngineRole = setting(EngineRole.BOTH, Rules(noun="role"))
    model: str | None = None  # the [[model]] its engines serve (checked at each join)
    port: int | None = setting(None, PORT)  # the gRPC port when a pod has no annotation
    port_annotation: str = GRPC_PORT_ANNOTATION
    kv_events_port: int | None = setting(None, PORT)  # ZMQ KV events on the pod's IP
    kv_events_annotation: str = KV_EVENTS_PORT_ANNOTATION
    kv_replay_port: int | None = setting(None, PORT)
    kv_replay_annotation: str = KV_REPLAY_PORT_ANNOTATION
    #: data-parallel ranks per pod's engine: rank r's KV events on the ports + r
    dp_ranks: int = setting(1, Rules(at_least=1, at_most=256))
    context_length: int | None = setting(None, AT_LEAST_ONE)
    block_size: int | None = setting(None, AT_LEAST_ONE)
    bootstrap_port: int | None = setting(None, PORT)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EffortBudgets:
    """``[model.sampling.effort_budgets]``: the thinking budget of each ``reasoning_effort``.

    OpenAI clients ask for less or more reasoning by ``reasoning_effort``; a
    model that reads no such switch (Qwen3, DeepSeek-R1) keeps it as a budget.
    """

    none: int | None = setting(None, NON_NEGATIVE)
    minimal: int | None = setting(None, NON_NEGATIVE)
    low: int | None = setting(None, NON_NEGATIVE)
    medium: int | None = setting(None, NON_NEGATIVE)
    high: int | None = setting(None, NON_NEGATIVE)
    xhigh: int | None = setting(None, NON_NEGATIVE)

    def of(self, effort: str | None) -> int | None:
        """The budget of ``effort`` (None: that effort has none here)."""
        if effort is None or effort not in EFFORTS:
            return None
        budget: int | None = getattr(self, effort)
        return budget


#: the ``reasoning_effort`` values :class:`EffortBudgets` has a key for
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingDefaults:
    """``[model.sampling]``: what a request of the model gets for a field it leaves unset."""

    temperature: float | None = setting(None, Rules(at_least=0, at_most=2))
    top_p: float | None = setting(None, Rules(above=0, at_most=1))
    top_k: int | None = setting(None, Rules(at_least=0))
    min_p: float | None = setting(None, Rules(at_least=0, at_most=1))
    repetition_penalty: float | None = setting(None, Rules(above=0))
    max_tokens: int | None = setting(None, AT_LEAST_ONE)  # default: frontend.max_tokens_default
    #: a chat request's reasoning budget when it names none (pipeline/relay.py keeps it)
    thinking_token_budget: int | None = setting(None, NON_NEGATIVE)
    effort_budgets: EffortBudgets = EffortBudgets()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """One ``[[model.adapter]]``: a LoRA adapter of the model, served under its own name.

    ``path`` is what an engine loads it from (``LoadLoRAAdapter``); absent, the
    adapter must be loaded on the engines already (it is routed, never loaded).
    """

    name: str
    path: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MediaConfig:
    """``[model.media]``: whether and how the model takes images (multimodal/policy.py).

    Images are taken when the model directory describes an image processor the
    router has (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) and ``images`` is true.
    ``fetch`` false takes data URLs only. ``allowed_hosts`` (empty: any) are the
    hosts http(s) URLs may name (``*.example.com`` for subdomains);
    ``allowed_networks`` (CIDRs) are the private, loopback or link-local
    networks that may still be fetched from, which are otherwise refused.
    """

    images: bool = True
    fetch: bool = True
    allowed_hosts: tuple[str, ...] = ()
    allowed_networks: tuple[str, ...] = ()
    max_image_bytes: int = setting(20 * 1024 * 1024, AT_LEAST_ONE)
    max_image_pixels: int = setting(40_000_000, AT_LEAST_ONE)
    max_images: int = setting(16, AT_LEAST_ONE)  # per request
    fetch_timeout_s: float = setting(10.0, POSITIVE)  # the whole fetch, redirects included
    max_redirects: int = setting(3, NON_NEGATIVE)
    # images go as references to engines that process media themselves (a vLLM servicer
    # whose discovery lists a media processor); false: always as preprocessed tensors
    engine_processing: bool = True


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """One ``[[model]]``: a model the fleet serves, with its own engines and routing.

    ``routing`` and ``limits`` default to ``[frontend]``'s, ``tokenizer`` to
    ``frontend.tokenizer``. ``tool_parser`` and ``reasoning_parser`` name the
    output parsers (pipeline/parsing.py; unset: detected from the chat template).
    ``implicit``: made from ``[frontend]`` for a file without ``[[model]]``
    tables (a fleet of one model).
    """

    name: str
    aliases: tuple[str, ...] = ()
    tokenizer: Path = dataclasses.field(metadata={"rules": Rules(derived=True)})
    chat_template: Path | None = None  # a Jinja file instead of the tokenizer's own template
    context_length: int | None = setting(None, AT_LEAST_ONE)  # over what engines report
    owned_by: str = "direct-frontend"  # as /v1/models shows it
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    sampling: SamplingDefaults = SamplingDefaults()
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    # LoRA adapters an engine may hold at once (least recently used unloaded past it)
    max_adapters_per_engine: int = setting(4, AT_LEAST_ONE)
    adapters: tuple[AdapterConfig, ...] = setting((), Rules(key="adapter"))
    media: MediaConfig = MediaConfig()
    implicit: bool = setting(False, Rules(in_file=False))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may ask for this model by (adapters aside)."""
        return (self.name, *self.aliases)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    """A whole fleet file: the frontend, its models and its engines (possibly none yet).

    ``models`` is never empty: without ``[[model]]`` tables it holds the one
    model ``[frontend]`` describes.
    """

    frontend: FrontendConfig
    engines: tuple[EngineConfig, ...] = setting((), Rules(key="engine"))
    models: tuple[ModelConfig, ...] = setting((), Rules(key="model"))
    pools: tuple[PoolConfig, ...] = setting((), Rules(key="pool"))
    source: Path = dataclasses.field(metadata={"rules": Rules(in_file=False)})

    def __post_init__(self) -> None:
        if not self.models:
            object.__setattr__(self, "models", (implicit_model(self.frontend),))

    @property
    def file_engines(self) -> tuple[EngineConfig, ...]:
        """The ``[[engine]]`` tables: the engines no pool found."""
        return tuple(engine for engine in self.engines if engine.pool is None)

    def model(self, name: str) -> ModelConfig | None:
        """The model ``name`` (a name or alias) names, if any."""
        return next((m for m in self.models if name in m.names), None)

    def engine_model(self, engine: EngineConfig) -> ModelConfig | None:
        """The model ``engine`` serves as far as the file says (None: discovery decides)."""
        if engine.model is not None:
            return self.model(engine.model)
        if engine.simulate and engine.simulator.served_model_name is not None:
            return self.model(engine.simulator.served_model_name)
        return self.models[0] if len(self.models) == 1 else None


def implicit_model(frontend: FrontendConfig) -> ModelConfig:
    """The one model of a file without ``[[model]]`` tables: ``[frontend]``'s."""
    return ModelConfig(
        name=frontend.served_model_name,
        tokenizer=frontend.tokenizer,
        routing=frontend.routing,
        limits=frontend.limits,
        implicit=True,
    )
