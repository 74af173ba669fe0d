"""Prometheus metrics for the frontend, in a registry owned by :class:`Metrics`.

A fresh :class:`Metrics` per app (and per test) avoids the duplicate-name
errors of prometheus_client's global registry. Label children are cached,
because ``.labels()`` costs microseconds. Inter-token latency is observed per
streamed chunk, so it uses a small histogram of our own that records ``n``
tokens in one bucket increment rather than ``n`` observe calls.

Not thread-safe beyond what the GIL gives: the app updates and renders metrics
from one Trio thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Generic, Literal, TypeVar, get_args, overload

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from direct_frontend import __version__
from direct_frontend.errors import ErrorKind
from direct_frontend.observability import descriptors
from direct_frontend.observability.shims import ShimStatus, shims_active
from direct_frontend.observability.tallies import Buckets, CounterFamily, HistogramFamily, Tally

PREFIX: Final = "direct_frontend_"

EngineState = Literal["joining", "serving", "unhealthy", "draining", "refused"]
ENGINE_STATES: Final[tuple[EngineState, ...]] = get_args(EngineState)

#: Time to first token: sub-millisecond (cache hits, tiny prompts) to a minute (queued).
TTFT_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
#: Whole requests: as above, plus long generations of several minutes.
REQUEST_BUCKETS: Final = (*TTFT_BUCKETS, 120.0, 300.0, 600.0)
#: Waits in the admission queue: none at all (most), to its timeout (10 s by default).
QUEUE_BUCKETS: Final = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                        10.0, 30.0, 60.0)
#: Per-token decode latency: dense around the usual 5-100 ms.
INTER_TOKEN_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: How long after an engine stamped a KV-event batch the index held it: about a millisecond
#: on one host, tens of milliseconds when the event loop is busy, seconds when it is starved.
KV_LAG_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class PerTokenHistogram(HistogramFamily):
    """A label-less histogram that can record ``n`` equal observations at once."""

    def __init__(self, name: str, documentation: str, *, buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, buckets=buckets)
        self._series = self._sole()  # (observed once per streamed batch: no look-up)

    def observe(self, gap: float, n: int = 1) -> None:
        """Record ``n`` tokens that arrived together after ``gap`` seconds: ``gap/n`` each."""
        if n > 0:
            self._series.observe_spread(gap, n)


class ShimGauge(Collector):
    """1 per hot-path shim in use, 0 per shim that is off: read from the shims at each scrape."""

    def __init__(
        self, name: str, documentation: str, report: Callable[[], Iterable[ShimStatus]]
    ) -> None:
        self._name = name
        self._doc = documentation
        self._report = report

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self._name, self._doc, labels=("shim",))
        for status in self._report():
            family.add_metric((status.shim,), 1.0 if status.active else 0.0)
        yield family

    def describe(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self._name, self._doc, labels=("shim",))


_F = TypeVar("_F", bound=Collector)


class _Family(Generic[_F]):
    """One metric of :class:`Metrics`, declared in its class body: its name is the attribute's.

    :meth:`Metrics.__init__` builds each into an instance attribute of that name;
    ``__get__`` only gives the type checker the metric's type (the declarations
    are taken off the class: :func:`_take_families`).
    """

    __slots__ = ("_build", "name")

    def __init__(self, build: Callable[[str, CollectorRegistry], _F]) -> None:
        self._build = build
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Family[_F]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _F: ...
    def __get__(self, obj: object, owner: type) -> _Family[_F] | _F:
        if obj is None:  # pragma: no cover
            return self
        raise AttributeError(f"{self.name} is built by Metrics.__init__")  # pragma: no cover

    def build(self, registry: CollectorRegistry) -> _F:
        """The metric, registered in ``registry`` under :data:`PREFIX` and its name."""
        return self._build(PREFIX + self.name, registry)


def _counter(doc: str, *labels: str) -> _Family[CounterFamily]:
    return _registered(lambda name: CounterFamily(name, doc, labels))


def _gauge(doc: str, *labels: str) -> _Family[Gauge]:
    return _Family(lambda name, r: Gauge(name, doc, labels, registry=r))


def _histogram(doc: str, *labels: str, buckets: Sequence[float]) -> _Family[HistogramFamily]:
    return _registered(lambda name: HistogramFamily(name, doc, labels, buckets=buckets))


def _registered(make: Callable[[str], _F]) -> _Family[_F]:
    """A collector of our own, made from its name and registered."""

    def build(name: str, registry: CollectorRegistry) -> _F:
        collector = make(name)
        registry.register(collector)
        return collector

    return _Family(build)


class Metrics:
    """Every frontend metric, registered in its own :attr:`registry`.

    Label values must come from small fixed sets (route names, status codes,
    engine names, error kinds) to keep cardinality bounded. The metrics are
    declared below in the order ``/metrics`` lists them.
    """

    build_info = _gauge("Always 1: the running build, in its labels.", "version")
    requests_total = _counter("HTTP requests by endpoint and status code.", "endpoint", "code")
    admission_queue_depth = _gauge(
        "Requests waiting in a model's admission queue (an autoscaling signal).", "model")
    admission_wait_seconds = _histogram(
        "Time a request waited for an admission slot, by model (0: admitted at once).",
        "model", buckets=QUEUE_BUCKETS)
    # by tenant and tier: the tenant label is its name in the fleet file, or a name a header
    # or body field gave (at most [frontend.tenants] max_series), else "other": never a key
    tenant_queue_depth = _gauge(
        "Requests waiting in a model's admission queue, by tenant and service tier.",
        "model", "tenant", "tier")
    tenant_wait_seconds = _histogram(
        "Time a request waited for an admission slot, by model, tenant and service tier.",
        "model", "tenant", "tier", buckets=QUEUE_BUCKETS)
    tenant_admitted_total = _counter(
        "Requests admitted, by model, tenant and the service tier they were served at.",
        "model", "tenant", "tier")
    tenant_refused_total = _counter(
        "Requests the admission queue refused, by model, tenant, service tier and reason "
        "(queue_full, tenant_queue_full, pushed_out, timeout).",
        "model", "tenant", "tier", "reason")
    request_duration_seconds = _histogram(
        "Time from request start to the last byte sent.", "endpoint", buckets=REQUEST_BUCKETS)
    time_to_first_token_seconds = _histogram(
        "Time from request start to the first token.", buckets=TTFT_BUCKETS)
    inter_token_latency_seconds = _registered(lambda name: PerTokenHistogram(
        name, "Gap between streamed tokens (a chunk's gap split evenly over its tokens).",
        buckets=INTER_TOKEN_BUCKETS))
    in_flight_requests = _gauge("Requests being served now.")
    engine_state = _gauge(
        "1 for the engine's current state, 0 for the others.", "engine", "state")
    engine_in_flight = _gauge("Requests in flight on each engine.", "engine")
    engine_requests_total = _counter("Engine calls by outcome.", "engine", "outcome")
    prompt_tokens_total = _counter("Prompt tokens of finished requests.")
    completion_tokens_total = _counter("Generated tokens of finished requests.")
    cancelled_requests_total = _counter("Requests the client abandoned.")
    malformed_engine_messages_total = _counter(
        "Engine messages we could not interpret.", "engine")
    parser_malformed_total = _counter(
        "Tool calls or reasoning blocks of model output a parser could not read "
        "(sent as content), by parser.", "parser")
    reasoning_budget_closed_total = _counter(
        "Replies whose reasoning block the router closed at their thinking_token_budget.")
    migrations_refused_total = _counter(
        "Streams ended instead of migrating, by why no other engine could continue them "
        "(constraint: a sampled constrained stream; replay_diverged: a deterministic one "
        "whose replay gave other tokens).", "reason")
    engine_waits_total = _counter(
        "Waits of a request for an engine to serve, by how they ended "
        "(served, expired, cancelled).", "outcome")
    engine_errors_total = _counter("Engine call failures by error kind.", "engine", "kind")
    kv_predicted_cached_tokens_total = _counter(
        "Prompt tokens the KV-aware router predicted the chosen engine had cached.")
    kv_reported_cached_tokens_total = _counter(
        "Prompt tokens the engines reported as cached, for KV-routed requests.")
    kv_prediction_diverged = _gauge(
        "Engines whose predicted and reported cache hits disagree over their recent window "
        "(routed by the approximate prefix memory).")
    kv_load_guard_spills_total = _counter(
        "Requests the load guard sent away from the engine with the best cache overlap.")
    kv_index_blocks = _gauge("Blocks held in the KV-event index.")
    kv_index_bytes = _gauge("Estimated memory of the KV-event index.")
    kv_malformed_events_total = _counter(
        "KV-event messages that could not be decoded.", "engine")
    kv_event_lag_seconds = _histogram(
        "How long after the engine stamped a live KV-event batch the index held it (wall "
        "clocks: skew between hosts is in it; replayed batches are not counted), by engine.",
        "engine", buckets=KV_LAG_BUCKETS)
    replica_degraded = _gauge(
        "1 while [frontend.replicas] is set but NATS is out of reach: routing on "
        "this replica's own state only.")
    replica_peers = _gauge("Sibling replicas heard from recently.")
    shim_active = _registered(lambda name: ShimGauge(
        name,
        "1 while a hot-path shim over a library's internals is in use, by shim "
        "(docs/decisions/0002-hot-path-shims.md); 0: the library's own, slower code runs.",
        shims_active))
    # Read at scrape time: every HTTP connection holds one (see http/keepalive.py).
    open_fds = _gauge("File descriptors the process has open.")
    max_fds = _gauge("The process's soft limit on open file descriptors.")
    model_requests_total = _counter(
        "Generation requests by the model they asked for.", "model", "code")
    model_time_to_first_token_seconds = _histogram(
        "Time to the first token, by model.", "model", buckets=TTFT_BUCKETS)
    model_prompt_tokens_total = _counter(
        "Prompt tokens of finished requests, by model.", "model")
    model_completion_tokens_total = _counter(
        "Generated tokens of finished requests, by model.", "model")
    model_cached_tokens_total = _counter(
        "Prompt tokens the engines reported as cached, by model (the hit rate's numerator).",
        "model")
    model_engines_serving = _gauge("Engines serving each model.", "model")
    responses_stored = _gauge("Responses this process keeps for previous_response_id.")
    responses_stored_bytes = _gauge(
        "JSON bytes of the stored responses ([frontend.responses] max_bytes bounds it).")
    responses_background = _gauge(
        "Background responses (background: true) running in this process.")
    responses_evicted_total = _counter(
        "Stored responses dropped before their time to keep within max_bytes.")
    batches_running = _gauge("Batches (the Batch API) this process runs.")
    batch_lines_total = _counter(
        "Batch lines run by this process, by outcome (completed, failed, retried: the "
        "server had no room then, so the line is asked again).", "outcome")
    pool_membership_stale = _gauge(
        "1 while a [[pool]]'s watch is down and its last membership is kept.", "pool")
    pool_engines = _gauge("Engines a [[pool]]'s Ready pods make.", "pool")
    pool_watch_errors_total = _counter(
        "Failed lists and watches of a [[pool]] (each reconnects with backoff).", "pool")
    pool_relists_total = _counter("Full lists of a [[pool]]'s pods, by why.", "pool", "reason")
    rate_limited_total = _counter(
        "Requests refused over a tenant's rate limit ([frontend.tenants]), by tenant (its "
        "name in the fleet file; every other tenant is \"other\") and limit (requests, "
        "tokens).", "tenant", "limit")

    def __init__(self) -> None:
        # The ``*_created`` series double the exposition for nothing Prometheus uses;
        # the switch is process-wide in prometheus_client, which suits a daemon.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped upstream
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # the process's own: CPU, memory, descriptors, GC; Python's version (the standard names)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        for family in _FAMILIES:
            setattr(self, family.name, family.build(r))
        self.build_info.labels(__version__).set(1)
        self.open_fds.set_function(descriptors.open_count)
        self.max_fds.set_function(descriptors.soft_limit)
        self._models: dict[str, ModelSeries] = {}
        self._requests: dict[tuple[str, int], Tally] = {}
        self._durations: dict[str, Buckets] = {}
        self._engine_labels: dict[
            str, set[tuple[CounterFamily | Gauge | HistogramFamily, tuple[str, ...]]]] = {}
        #: engine_requests_total's children by (engine, outcome): counted on every request
        self._engine_requests: dict[tuple[str, str], Tally] = {}
        #: requests being served: a plain count, read at scrape time (two updates a request)
        self._in_flight = 0
        self.in_flight_requests.set_function(lambda: self._in_flight)

    # -- requests --------------------------------------------------------------

    # -- stored responses -------------------------------------------------------

    def watch_responses(self, count: Callable[[], float], size: Callable[[], float]) -> None:
        """Read the store's size at scrape time."""
        self.responses_stored.set_function(count)
        self.responses_stored_bytes.set_function(size)

    def watch_background(self, running: Callable[[], float]) -> None:
        """Read how many background responses run at scrape time."""
        self.responses_background.set_function(running)

    def watch_batches(self, running: Callable[[], float]) -> None:
        """Read how many batches run at scrape time."""
        self.batches_running.set_function(running)

    def batch_line(self, outcome: str) -> None:
        self.batch_lines_total.labels(outcome).inc()

    def response_evicted(self) -> None:
        self.responses_evicted_total.inc()

    def request_started(self) -> None:
        """Count a request in flight; pair with :meth:`request_finished`."""
        self._in_flight += 1

    def request_finished(
        self, endpoint: str, status: int, duration: float, *, was_in_flight: bool = True
    ) -> None:
        """Count a finished request and its duration (seconds).

        ``was_in_flight``: False for one never counted by :meth:`request_started`.
        """
        if was_in_flight:
            self._in_flight -= 1
        key = (endpoint, status)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests_total.labels(endpoint, str(status))
        counter.inc()
        hist = self._durations.get(endpoint)
        if hist is None:
            hist = self._durations[endpoint] = self.request_duration_seconds.labels(endpoint)
        hist.observe(duration)

    def observe_ttft(self, seconds: float) -> None:
        """Record the time to the first token of one request."""
        self.time_to_first_token_seconds.observe(seconds)

    def observe_inter_token(self, gap: float, n_tokens: int) -> None:
        """Record one streamed chunk of ``n_tokens`` that came ``gap`` seconds after the last."""
        self.inter_token_latency_seconds.observe(gap, n_tokens)

    def add_tokens(self, prompt: int, completion: int) -> None:
        """Add a finished request's token usage."""
        if prompt:
            self.prompt_tokens_total.inc(prompt)
        if completion:
            self.completion_tokens_total.inc(completion)

    def request_cancelled(self) -> None:
        """Count a request the client abandoned (disconnect mid-generation)."""
        self.cancelled_requests_total.inc()

    def rate_limited(self, tenant: str, limit: str) -> None:
        """Count a request refused over ``tenant``'s (a configured name) ``limit``."""
        self.rate_limited_total.labels(tenant, limit).inc()

    # -- models ----------------------------------------------------------------

    def model_series(self, model: str) -> ModelSeries:
        """The per-model series of ``model`` (made once, so the hot path skips ``.labels``)."""
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = ModelSeries(self, model)
        return series

    def forget_model(self, model: str) -> None:
        """Drop the series of a model the fleet no longer serves (bounded cardinality)."""
        series = self._models.pop(model, None)
        if series is None:
            return
        for metric in (self.model_time_to_first_token_seconds, self.model_prompt_tokens_total,
                       self.model_completion_tokens_total, self.model_cached_tokens_total,
                       self.model_engines_serving, self.admission_queue_depth,
                       self.admission_wait_seconds):
            metric.remove(model)
        for status in series.statuses:
            self.model_requests_total.remove(model, str(status))
        for tenant, tier in series.tenant_keys:
            for metric in (self.tenant_queue_depth, self.tenant_wait_seconds,
                           self.tenant_admitted_total):
                with contextlib.suppress(KeyError):
                    metric.remove(model, tenant, tier)
        for tenant, tier, reason in series.refusal_keys:
            self.tenant_refused_total.remove(model, tenant, tier, reason)

    # -- engines ---------------------------------------------------------------

    @overload
    def _child(self, metric: Gauge, engine: str, *rest: str) -> Gauge: ...
    @overload
    def _child(self, metric: CounterFamily, engine: str, *rest: str) -> Tally: ...
    @overload
    def _child(self, metric: HistogramFamily, engine: str, *rest: str) -> Buckets: ...
    def _child(
        self, metric: Gauge | CounterFamily | HistogramFamily, engine: str, *rest: str
    ) -> Gauge | Tally | Buckets:
        self._engine_labels.setdefault(engine, set()).add((metric, rest))
        return metric.labels(engine, *rest)

    def set_engine_state(self, engine: str, state: EngineState) -> None:
        """Set 1 on ``state`` and 0 on every other state, so one series is 1 per engine."""
        if state not in ENGINE_STATES:
            raise ValueError(f"unknown engine state {state!r}")
        for s in ENGINE_STATES:
            self._child(self.engine_state, engine, s).set(1 if s == state else 0)

    def set_engine_in_flight(self, engine: str, count: int) -> None:
        """Set how many requests the engine is serving now."""
        self._child(self.engine_in_flight, engine).set(count)

    def engine_request(self, engine: str, outcome: str) -> None:
        """Count one engine call by outcome (e.g. ok, error, cancelled, migrated)."""
        key = (engine, outcome)
        child = self._engine_requests.get(key)
        if child is None:
            child = self._engine_requests[key] = self._child(
                self.engine_requests_total, engine, outcome
            )
        child.inc()

    def malformed_engine_message(self, engine: str) -> None:
        """Count an engine message that could not be interpreted."""
        self._child(self.malformed_engine_messages_total, engine).inc()

    def kv_event_lag(self, engine: str) -> Buckets:
        """The KV-event lag series of ``engine``: observe on it directly (once per batch)."""
        return self._child(self.kv_event_lag_seconds, engine)

    def engine_wait(self, outcome: str) -> None:
        """Count one wait of a request for an engine to serve, by how it ended."""
        self.engine_waits_total.labels(outcome).inc()

    def engine_error(self, engine: str, kind: ErrorKind | str) -> None:
        """Count an engine failure by :class:`ErrorKind` (or its value)."""
        label = kind.value if isinstance(kind, ErrorKind) else kind
        self._child(self.engine_errors_total, engine, label).inc()

    def forget_engine(self, engine: str) -> None:
        """Drop every series of an engine that left the fleet, to bound cardinality."""
        for key in [key for key in self._engine_requests if key[0] == engine]:
            del self._engine_requests[key]
        for metric, rest in self._engine_labels.pop(engine, ()):
            metric.remove(engine, *rest)

    def pool_status(self, pool: str, *, stale: bool, engines: int) -> None:
        self.pool_membership_stale.labels(pool).set(1 if stale else 0)
        self.pool_engines.labels(pool).set(engines)

    def forget_pool(self, pool: str) -> None:
        for metric in (self.pool_membership_stale, self.pool_engines):
            with contextlib.suppress(KeyError):
                metric.remove(pool)

    # -- exposition ------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The ``/metrics`` body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _take_families(cls: type) -> tuple[_Family[Any], ...]:
    """The metrics declared on ``cls``, in order, taken off the class.

    The declarations type the attributes for mypy; at run time only the
    instance holds them, so reading one is a plain (specialised) lookup.
    """
    families = tuple(v for v in vars(cls).values() if isinstance(v, _Family))
    for family in families:
        delattr(cls, family.name)
    return families


_FAMILIES: Final = _take_families(Metrics)


class ModelSeries:
    """One model's label children of the ``model_*`` metrics, and of its tenants' admission
    series (it is the model's admission observer: pipeline/admission.py)."""

    __slots__ = (
        "_by_status",
        "_by_tenant",
        "_cached",
        "_completion",
        "_depth",
        "_metrics",
        "_prompt",
        "_refusals",
        "_requests",
        "_serving",
        "_ttft",
        "_wait",
        "model",
        "refusal_keys",
        "statuses",
        "tenant_keys",
    )

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.model = model
        self._requests = metrics.model_requests_total
        self._ttft = metrics.model_time_to_first_token_seconds.labels(model)
        self._prompt = metrics.model_prompt_tokens_total.labels(model)
        self._completion = metrics.model_completion_tokens_total.labels(model)
        self._cached = metrics.model_cached_tokens_total.labels(model)
        self._serving = metrics.model_engines_serving.labels(model)
        self._depth = metrics.admission_queue_depth.labels(model)
        self._wait = metrics.admission_wait_seconds.labels(model)
        self.statuses: set[int] = set()
        self._by_status: dict[int, Tally] = {}  # the children, looked up once per status
        self._metrics = metrics
        #: (tenant, tier) -> its wait histogram's and admitted counter's children
        self._by_tenant: dict[tuple[str, str], tuple[Buckets, Tally]] = {}
        self.tenant_keys: set[tuple[str, str]] = set()  # every (tenant, tier) with a series
        self._refusals: dict[tuple[str, str, str], Tally] = {}
        self.refusal_keys: set[tuple[str, str, str]] = set()

    def request(self, status: int) -> None:
        child = self._by_status.get(status)
        if child is None:
            self.statuses.add(status)
            child = self._by_status[status] = self._requests.labels(self.model, str(status))
        child.inc()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def queue_depth(self, waiting: int) -> None:
        self._depth.set(waiting)

    def admitted(self, tenant: str, tier: str, waited: float) -> None:
        """A request of ``tenant`` (its label) was admitted at ``tier`` after ``waited`` s."""
        self._wait.observe(waited)
        children = self._by_tenant.get((tenant, tier))
        if children is None:
            self.tenant_keys.add((tenant, tier))
            metrics = self._metrics
            children = self._by_tenant[tenant, tier] = (
                metrics.tenant_wait_seconds.labels(self.model, tenant, tier),
                metrics.tenant_admitted_total.labels(self.model, tenant, tier))
        children[0].observe(waited)
        children[1].inc()

    def refused(self, tenant: str, tier: str, reason: str) -> None:
        """A request of ``tenant`` at ``tier`` was refused by the admission queue."""
        key = (tenant, tier, reason)
        child = self._refusals.get(key)
        if child is None:
            self.refusal_keys.add(key)
            child = self._refusals[key] = self._metrics.tenant_refused_total.labels(
                self.model, tenant, tier, reason)
        child.inc()

    def tenant_queue_depths(self, waiting: dict[tuple[str, str], int]) -> None:
        """Set the requests waiting by (tenant, tier); a series once set and now empty is 0."""
        gauge = self._metrics.tenant_queue_depth
        for key in waiting.keys() - self.tenant_keys:
            self.tenant_keys.add(key)
        for tenant, tier in self.tenant_keys:
            gauge.labels(self.model, tenant, tier).set(waiting.get((tenant, tier), 0))

    def usage(self, prompt: int, completion: int, cached: int) -> None:
        if prompt:
            self._prompt.inc(prompt)
        if completion:
            self._completion.inc(completion)
        if cached:
            self._cached.inc(cached)

    def engines_serving(self, count: int) -> None:
        self._serving.set(count)
