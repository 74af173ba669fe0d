"""``[frontend]``'s tables of the services beside routing: tenants, the access log,
tracing, the replica link, stored responses, batches and Kubernetes (a part of the schema,
fleet/schema.py, which re-exports every name here).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from direct_frontend.fleet.rules import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Rules, setting

StoreBackend = Literal["memory", "sqlite", "postgres"]


#: the body fields that may name a request's tenant (``[frontend.tenants] field``)
TenantField = Literal["user", "safety_identifier"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    """``[[frontend.tenants.tenant]]``: one tenant's share of the admission queue, its caps.

    ``name`` is what ``/metrics`` and its refusals call it; with ``[frontend.tenants]
    header`` or ``field`` it is also the value that names it. Otherwise ``api_key_env``
    names the variable holding its API key (and its name defaults to the variable's).
    """

    name: str | None = None
    api_key_env: str | None = None
    weight: float = setting(1.0, POSITIVE)
    max_in_flight: int = setting(0, NON_NEGATIVE)  # 0: [frontend.tenants] max_in_flight
    max_queue: int = setting(0, NON_NEGATIVE)  # 0: [frontend.tenants] max_queue
    priority: bool | None = None  # may ask for service_tier "priority" (absent: the default)
    #: the admission flow it is (pipeline/admission.py), resolved by the loader
    flow: str = setting("", Rules(in_file=False))
    # its rate limits (pipeline/ratelimit.py); absent: [frontend.tenants]'s, 0: none
    requests_per_minute: int | None = setting(None, NON_NEGATIVE)
    tokens_per_minute: int | None = setting(None, NON_NEGATIVE)

    @property
    def label(self) -> str:
        """What ``/metrics`` and refusals call it: its name, else its key's variable."""
        return self.name or self.api_key_env or "other"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TenantsConfig:
    """``[frontend.tenants]``: who shares the admission queue fairly, and by what weights.

    A request's tenant is its API key's owner by default (every key one
    tenant; with no keys, everyone one), or the value of ``header`` when a
    gateway names tenants so, or of the body's ``field`` (``user`` or
    ``safety_identifier``). Waiting requests are admitted in weighted fair
    order between tenants; ``max_in_flight`` caps what one tenant holds and
    ``max_queue`` how many of its requests wait (0: no cap but the model's
    own). ``priority`` says whether a tenant not listed (or listed without
    ``priority``) may have ``service_tier: "priority"``; one that may not is
    served at ``default``, and told so. Beyond ``max_series`` tenants that are
    not listed, ``/metrics`` folds the rest into one ``tenant="other"``.
    ``requests_per_minute`` and ``tokens_per_minute`` are every tenant's rate
    limits (0: none) unless a named tenant gives its own (pipeline/ratelimit.py).
    """

    header: str | None = None  # e.g. "x-tenant-id"
    field: TenantField | None = setting(None, Rules(noun="tenant field"))
    default_weight: float = setting(1.0, POSITIVE)
    max_in_flight: int = setting(0, NON_NEGATIVE)
    max_queue: int = setting(0, NON_NEGATIVE)
    priority: bool = False
    max_series: int = setting(32, NON_NEGATIVE)
    tenant: tuple[TenantConfig, ...] = ()  # [[frontend.tenants.tenant]]
    # each tenant's rate limits, unless it names its own (0: none)
    requests_per_minute: int = setting(0, NON_NEGATIVE)
    tokens_per_minute: int = setting(0, NON_NEGATIVE)

    @property
    def named_by(self) -> str | None:
        """What names a tenant besides its key: ``header <name>``, ``field <name>`` or None."""
        if self.header is not None:
            return f"header {self.header}"
        if self.field is not None:
            return f"field {self.field}"
        return None

    def by_flow(self) -> dict[str, TenantConfig]:
        """Each listed tenant by its flow."""
        return {tenant.flow: tenant for tenant in self.tenant}


#: what an access-log line can carry
AccessField = Literal["method", "path", "status", "duration_ms", "request_id", "model",
                      "client", "user_agent"]
ACCESS_FIELDS: tuple[AccessField, ...] = typing.get_args(AccessField)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AccessLogConfig:
    """``[frontend.access_log]``: one INFO line per request (logger ``direct_frontend.access``).

    ``fields`` are its ``key=value`` pairs (JSON keys with ``--log-json``), in
    that order (every line of ours carries ``request_id`` anyway); ``enabled =
    false`` turns it off. Probes (``/health``,
    ``/ready``) and scrapes (``/metrics``) are left out unless
    ``include_probes``: they would drown the requests.
    """

    enabled: bool = True
    fields: tuple[AccessField, ...] = setting(
        ("method", "path", "status", "duration_ms", "request_id", "model", "client"),
        Rules(noun="field"))
    include_probes: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TracingConfig:
    """``[frontend.tracing]``: OpenTelemetry spans of each request, sent over OTLP/HTTP.

    Off while ``otlp_endpoint`` is unset (the default); needs the
    ``direct-frontend[tracing]`` extra. Built at start: a change needs a restart.
    """

    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces
    service_name: str = "direct-frontend"
    # the share of new traces kept; a client's sampled traceparent is always followed
    sample_ratio: float = setting(1.0, Rules(at_least=0, at_most=1))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReplicasConfig:
    """``[frontend.replicas]``: several daemons in front of one fleet, routing as one.

    With ``nats`` unset (the default) a daemon shares nothing with its
    siblings. With it, each replica tells the others over that NATS server
    what only it knows (its in-flight load per engine, its approximate-mode
    placements, the transport faults it saw, what its tenants spent of their
    rate limits), a replica that starts late
    asks a sibling for its KV index, and a replica answers for the stored
    responses it holds. Built at start.

    Who may speak: every client the NATS server lets in on ``cluster``'s
    subjects is a sibling, and its word steers routing and reaches stored
    responses. So the server must authenticate its clients: a replica
    refuses to start against one that lets anyone in (its ``INFO`` has no
    ``auth_required``) unless ``insecure = true``, which starts it with a
    warning. A client that may connect but must not speak for the fleet is
    kept off ``<cluster>.>`` by the server's permissions; nothing is signed
    on top, as a shared signing key would sit beside the credentials
    anyway. The credentials: ``user`` with ``password_env`` or
    ``password_file``, or ``token_env`` or ``token_file``, or
    ``nkey_seed_file``, or ``creds_file`` (a JWT and seed); a ``user:password@``
    in ``nats`` works too and is shown redacted. Secrets come from the
    environment or a file, never the fleet file itself. ``tls = true`` (or a
    ``tls://`` URL) refuses a server that does not require TLS; ``tls_ca``
    verifies the server, ``tls_cert`` and ``tls_key`` are this client's.

    ``cluster`` names the subjects (``<cluster>.load`` ...): two fleets on one
    server must differ in it, or each hears the other's load and faults.
    It is not derived from the fleet (its engines change with reloads, its
    path differs between hosts): the default is one fixed name, so replicas
    of one fleet agree without being told, and a second fleet names its own.
    ``run --workers N`` on its own ``nats-server`` uses a namespace of its own.
    Relative file paths start at the fleet file's directory.
    """

    # e.g. nats://127.0.0.1:4222 or tls://nats.internal:4222; kept out of repr, as a
    # user:password@ in it is a secret (fleet/bus.py ``shown_url`` is its printable form)
    nats: str | None = dataclasses.field(default=None, repr=False)
    cluster: str = "direct-frontend"
    user: str | None = None
    password_env: str | None = None  # the environment variable holding user's password
    password_file: str | None = None  # a file holding it (its first line)
    token_env: str | None = None
    token_file: str | None = None
    nkey_seed_file: str | None = None
    creds_file: str | None = None
    tls: bool = False  # require TLS (implied by a tls:// URL)
    tls_ca: str | None = None  # CA bundle verifying the server (absent: the system's)
    tls_cert: str | None = None  # this client's certificate, with tls_key
    tls_key: str | None = None
    # accept a NATS server that lets any client in (a warning at start)
    insecure: bool = False
    # how often changed load is sent (a peer's view lags by about this much)
    publish_interval_s: float = setting(0.02, POSITIVE)
    # a peer silent this long is forgotten (its load no longer counts)
    peer_timeout_s: float = setting(3.0, POSITIVE)
    # how long a late replica waits for a sibling's KV index snapshot at start
    snapshot_timeout_s: float = setting(2.0, NON_NEGATIVE)

    @property
    def wants_tls(self) -> bool:
        """TLS is required: ``tls = true``, a ``tls://`` URL, or a client certificate."""
        return (self.tls or self.tls_cert is not None
                or (self.nats is not None and self.nats.startswith("tls://")))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesConfig:
    """``[frontend.responses]``: the Responses API's stored responses.

    A response is kept (unless its request says ``store: false``) so that
    ``previous_response_id`` and ``GET /v1/responses/{id}`` find it: in the
    memory of the process that answered it, at most ``max_bytes`` per process
    and none longer than ``ttl_s``. Every response belongs to the API key that
    made it (``[frontend.auth]``); the budget is shared fairly between owners
    (an owner under its share never loses a record to another's traffic), and
    one owner may run at most ``max_background_per_owner`` background
    responses at once. With ``store = false`` nothing is kept. Built at start.

    ``backend`` says where they (and conversations) live: ``sqlite`` (the
    default: a file on this machine that its workers share; survives
    restarts), ``postgres`` (one database every replica shares) or
    ``memory`` (this process; lost at exit, so never the default: what a
    client is told is stored is durable unless the file says otherwise).
    With a database, ``max_bytes`` bounds this process's cache of what it
    wrote, ``ttl_s`` and ``retain_bytes_per_owner`` what the database keeps.
    """

    store: bool = True
    max_bytes: int = setting(64 * 1024 * 1024, AT_LEAST_ONE)
    ttl_s: float = setting(86400.0, POSITIVE)
    # no owner holds more than this (absent: the whole budget, fairly shared between owners)
    max_bytes_per_owner: int | None = setting(None, AT_LEAST_ONE)
    # background responses one owner may have queued or running at once (beyond: a 429)
    max_background_per_owner: int = setting(8, AT_LEAST_ONE)
    backend: StoreBackend = setting("sqlite", Rules(noun="store backend"))
    # sqlite: the database file, relative to the fleet file (absent: responses.db in
    # $STATE_DIRECTORY, else in $XDG_STATE_HOME/direct-frontend or ~/.local/state/direct-frontend)
    path: str | None = None
    # postgres: the database, as a postgresql:// URL (a secret: shown nowhere, and no spaces)
    dsn: str | None = setting(None, Rules(secret=True))
    # database connections (and worker threads) of one process
    connections: int = setting(4, AT_LEAST_ONE)
    # a background response whose process has not renewed its lease this long reads as failed
    lease_s: float = setting(30.0, POSITIVE)
    # a database: conversations untouched this long are dropped (absent: kept until deleted)
    conversation_ttl_s: float | None = setting(None, POSITIVE)
    # a database: an owner's stored responses beyond this many bytes lose their oldest
    retain_bytes_per_owner: int | None = setting(None, AT_LEAST_ONE)
    # a database: how often retention runs (in the background, in small transactions)
    sweep_interval_s: float = setting(60.0, POSITIVE)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BatchesConfig:
    """``[frontend.batches]``: the Files and Batch APIs (kept in ``[frontend.responses]``'s
    store, so ``store = false`` turns them off).

    An uploaded file is at most ``max_file_bytes`` and ``max_lines`` requests,
    and one owner's files at most ``max_bytes_per_owner`` (its batches' output
    files count, but are never refused); files are kept ``file_ttl_s`` (a
    batch's output files too, from when it ends). One owner may have
    ``max_active_per_owner`` batches that have not ended. A batch runs at most
    ``concurrency`` of its lines at once (at the ``flex`` service tier), and
    one process runs at most ``max_running`` batches at once (the next is the
    oldest of the owner with the fewest running); a batch whose process
    stopped renewing its lease for ``lease_s`` is taken up by another process
    (or by the same daemon after a restart), which runs only its unfinished
    lines. Read at each batch's turn: a reload applies at once.
    """

    max_file_bytes: int = setting(100 * 1024 * 1024, AT_LEAST_ONE)
    max_lines: int = setting(50_000, AT_LEAST_ONE)  # OpenAI's limit
    file_ttl_s: float = setting(30 * 86400.0, POSITIVE)  # OpenAI keeps batch files 30 days
    max_bytes_per_owner: int = setting(10 * 1024 * 1024 * 1024, AT_LEAST_ONE)
    max_active_per_owner: int = setting(16, AT_LEAST_ONE)
    # lines of one batch in flight at once: a batch never floods the admission queue
    concurrency: int = setting(8, AT_LEAST_ONE)
    max_running: int = setting(4, AT_LEAST_ONE)
    lease_s: float = setting(30.0, POSITIVE)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesConfig:
    """``[frontend.kubernetes]``: how ``[[pool]]`` tables reach the Kubernetes API server.

    Without ``kubeconfig`` the daemon uses its pod's service account when it
    runs in a cluster, else ``$KUBECONFIG`` or ``~/.kube/config``. A watch asks
    the server to end after ``watch_timeout_s`` (then it resumes from the last
    resourceVersion), and at most ``watch_silence_s`` − 5 s, so that the
    bookmark the server sends before a watch's end arrives in time: a watch
    that brings no byte for ``watch_silence_s`` is a dead connection, ended
    and relisted (:func:`~direct_frontend.fleet.pools.watch_seconds`). A full
    relist reconciles every ``relist_interval_s`` anyway, so a missed delete
    never lives longer than that.
    """

    kubeconfig: str | None = None  # a kubeconfig file, resolved against the fleet file
    context: str | None = None  # a kubeconfig context (absent: its current-context)
    watch_timeout_s: float = setting(240.0, POSITIVE)
    # a watch silent this long is a dead connection (each watch asks to end 5 s sooner)
    watch_silence_s: float = setting(30.0, Rules(at_least=10))
    relist_interval_s: float = setting(300.0, POSITIVE)
    # reconnects back off from 0.1 s, doubling (jittered), to at most this
    max_backoff_s: float = setting(10.0, POSITIVE)
    # /ready says no until every pool has had a serving engine (start-up only)
    wait_for_pods: bool = False
