"""The models a daemon serves, each routed on its own, and the names requests ask for them by.

Every model of the fleet gets a :class:`ServedModel`: its own view of the
catalog (only its engines: :class:`ModelFleet`), its own policy instance,
admission queue and limits (a busy model never starves another's queue),
its tokenizer and its metric series. The whole set is a :class:`ModelTable`,
replaced whole on a reload like the settings; a request resolves its
``model`` in the table once, on arrival, and keeps what it found to its end,
so a removed model's requests finish under it. A reload keeps the parts of a
model that did not change (its policy and queue when routing and limits did
not, its relay when its tokenizer did not), and loads each tokenizer once,
in a worker thread (:meth:`ModelBuilder.load`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

import msgspec
import trio

from direct_frontend.errors import EngineError
from direct_frontend.fleet.preflight import TextModelKey, load_text_models, text_model_key
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import (
    AdapterConfig,
    FleetConfig,
    FrontendConfig,
    ModelConfig,
    RoutingConfig,
    SamplingDefaults,
)
from direct_frontend.multimodal.fetch import new_decode_limiter
from direct_frontend.observability.metrics import Metrics, ModelSeries
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.adapters import (
    AdapterDispatcher,
    AdapterPolicy,
    Residency,
    carries_adapters,
)
from direct_frontend.pipeline.dispatch import Dispatcher, WaitableFleet
from direct_frontend.pipeline.media import MediaProfile, media_profile
from direct_frontend.pipeline.parsing import (
    model_parsers,
    parser_problems,
    with_tools_or_format,
)
from direct_frontend.pipeline.preprocess import Tokenizing, new_tokenize_limiter
from direct_frontend.pipeline.relay import Relay
from direct_frontend.pipeline.settings import Settings
from direct_frontend.pipeline.tokenizing import give_large_buffers_back
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.hitrate import HitRateWatch
from direct_frontend.routing.policies import Policy
from direct_frontend.text.model_dir import TextModel

log = logging.getLogger("direct_frontend.models")

#: builds a policy for a model's ``routing``; with the fleet's KV-event index when told to
#: (an adapter's policy never reads it: its blocks carry no adapter)
PolicyFactory = Callable[[RoutingConfig, bool], Policy]


class ModelFleet:
    """One model's view of the fleet: the catalog of its engines only.

    The filtered catalog keeps the fleet's version, so waiting for a change
    works as on the whole fleet (a change of another model's engines is a
    wake-up that finds nothing new, and the wait goes on).
    """

    __slots__ = ("_seen", "fleet", "keep", "model")

    def __init__(
        self, fleet: WaitableFleet, model: str,
        keep: Callable[[EngineHandle], bool] | None = None,
    ) -> None:
        self.fleet = fleet
        self.model = model
        self.keep = keep  # a further filter (an adapter's: engines that can carry it)
        self._seen: tuple[Catalog, Catalog] | None = None  # (the fleet's, ours)

    @property
    def catalog(self) -> Catalog:
        whole = self.fleet.catalog
        seen = self._seen
        if seen is None or seen[0] is not whole:
            ours = whole.of_model(self.model)
            if self.keep is not None:
                ours = Catalog(ours.version, tuple(filter(self.keep, ours.engines)))
            seen = self._seen = (whole, ours)
        return seen[1]

    async def wait_for_catalog(self, newer_than: int) -> Catalog:
        await self.fleet.wait_for_catalog(newer_than)
        return self.catalog

    def report_fault(self, engine: EngineHandle, error: EngineError) -> None:
        self.fleet.report_fault(engine, error)


def model_frontend(frontend: FrontendConfig, model: ModelConfig) -> FrontendConfig:
    """``[frontend]`` as one model's requests see it: its routing, limits and token default."""
    return dataclasses.replace(
        frontend,
        routing=model.routing,
        limits=model.limits,
        max_tokens_default=model.sampling.max_tokens or frontend.max_tokens_default,
    )


Request = ChatRequest | CompletionRequest
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def with_defaults(request: Request, defaults: SamplingDefaults) -> Request:
    """``request`` with the model's sampling defaults where the client set nothing.

    A chat request that names no thinking budget gets its ``reasoning_effort``'s
    (``effort_budgets``), else the model's ``thinking_token_budget``.
    """
    changes: dict[str, object] = {
        name: value
        for name in _SAMPLING_FIELDS
        if getattr(request, name) is None and (value := getattr(defaults, name)) is not None
    }
    if isinstance(request, ChatRequest) and request.thinking_token_budget is None:
        budget = defaults.effort_budgets.of(request.reasoning_effort)
        if budget is None:
            budget = defaults.thinking_token_budget
        if budget is not None:
            changes["thinking_token_budget"] = budget
    return msgspec.structs.replace(request, **changes) if changes else request


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ServedModel:
    """One model's routing state: what a request for it runs under, from start to end."""

    config: ModelConfig
    settings: Settings  # its policy, admission, failover; [frontend] with its overrides
    relay: Relay  # its dispatcher (its engines only), tokenizer and metric series
    tokenizing: Tokenizing
    text_model_key: TextModelKey
    adapter: AdapterConfig | None = None  # set: requests run under this LoRA adapter

    @property
    def name(self) -> str:
        return self.config.name if self.adapter is None else self.adapter.name

    @property
    def series(self) -> ModelSeries:
        assert self.relay.series is not None
        return self.relay.series

    @property
    def catalog(self) -> Catalog:
        return self.relay.dispatcher.fleet.catalog

    @property
    def context_length(self) -> int | None:
        """Its context window: the fleet file's, else the largest its engines report."""
        return self.config.context_length or _largest_context(self.catalog)

    def prepare_request(self, request: Request) -> Request:
        """The request as this model serves it: its sampling defaults filled in, and a chat
        request's tools and response format constrained together for its tool parser."""
        request = with_defaults(request, self.config.sampling)
        if isinstance(request, ChatRequest):
            return with_tools_or_format(request, self.relay.parsers)
        return request


@dataclasses.dataclass(frozen=True, slots=True)
class ModelCard:
    """One entry of ``GET /v1/models``."""

    id: str
    owned_by: str
    context_length: int | None
    parent: str | None = None  # an adapter's base model


class ModelTable:
    """The models served, by every name a request may use (names, aliases, adapters)."""

    def __init__(
        self, models: Iterable[ServedModel] = (), adapters: Iterable[ServedModel] = ()
    ) -> None:
        self.models: tuple[ServedModel, ...] = tuple(models)
        self.adapters: tuple[ServedModel, ...] = tuple(adapters)
        self._by_name: dict[str, ServedModel] = {}
        for model in self.models:
            for name in model.config.names:
                self._by_name[name] = model
        for adapter in self.adapters:
            self._by_name[adapter.name] = adapter

    def get(self, name: str) -> ServedModel | None:
        return self._by_name.get(name)

    def replaced(self, model: ServedModel) -> ModelTable:
        """The table with ``model`` in place of the model of the same name."""
        return ModelTable((model if m.name == model.name else m for m in self.models),
                          self.adapters)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def cards(self) -> list[ModelCard]:
        """Every model, alias and adapter, with who owns it and its context length."""
        cards: list[ModelCard] = []
        for model in self.models:
            config = model.config
            context = model.context_length
            cards += [ModelCard(name, config.owned_by, context) for name in config.names]
            cards += [ModelCard(a.name, config.owned_by, context, config.name)
                      for a in config.adapters]
        return cards


def _largest_context(catalog: Catalog) -> int | None:
    limits = [e.context_length for e in catalog.engines if e.context_length is not None]
    return max(limits) if limits else None


class ModelBuilder:
    """Makes each model's routing state, keeping what a reload did not change.

    Holds what every model shares: the fleet, the metrics, one tokenize
    limiter, and the tokenizers loaded so far (each once, by
    :func:`~direct_frontend.fleet.preflight.text_model_key`).
    """

    def __init__(
        self,
        fleet: WaitableFleet,
        metrics: Metrics,
        make_policy: PolicyFactory,
        text_models: Mapping[TextModelKey, TextModel] | None = None,
        diverged: set[int] | None = None,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.make_policy = make_policy
        #: the KV plane's engines whose predictions drifted: every model's hit-rate check
        #: adds to the one set the policies read
        self.diverged: set[int] = set() if diverged is None else diverged
        self.limiter = new_tokenize_limiter()
        give_large_buffers_back()  # a burst of large prompts leaves no resident heap behind
        #: image decodes and preprocessing, daemon-wide (pipeline/media.py)
        self.decode_limiter = new_decode_limiter()
        self.text_models: dict[TextModelKey, TextModel] = dict(text_models or {})
        #: per base model: which adapters its engines hold, and one lock per engine
        self._residency: dict[str, tuple[Residency, dict[int, trio.Lock]]] = {}

    async def load(self, fleet: FleetConfig) -> None:
        """Load the tokenizers ``fleet`` needs that are not loaded yet, in a worker thread.

        Raises :class:`~direct_frontend.fleet.problems.FleetError` naming a tokenizer
        that does not load; the ones loaded before stay.
        """
        problems = [
            FleetProblem(str(fleet.source), None, f"model {m.name!r}", problem)
            for m in fleet.models for problem in parser_problems(m.tool_parser, m.reasoning_parser)
        ]
        if problems:
            raise FleetError(problems)
        if all(text_model_key(m) in self.text_models for m in fleet.models):
            return
        loaded = dict(self.text_models)
        self.text_models = await trio.to_thread.run_sync(load_text_models, fleet, loaded)

    def build(
        self,
        fleet: FleetConfig,
        frontend: FrontendConfig,
        previous: ModelTable | None = None,
    ) -> ModelTable:
        """The table for ``fleet``'s models (tokenizers :meth:`load`-ed first)."""
        built = [self._model(model, frontend, previous) for model in fleet.models]
        adapters = [self._adapter(model, adapter, previous)
                    for model in built for adapter in model.config.adapters]
        keep = {model.text_model_key for model in built}
        self.text_models = {k: v for k, v in self.text_models.items() if k in keep}
        self._residency = {m.name: self._residency_of(m.config) for m in built}
        old = set() if previous is None else {
            m.name for m in (*previous.models, *previous.adapters)
        }
        for gone in old - {m.name for m in (*built, *adapters)}:
            self.metrics.forget_model(gone)
        return ModelTable(built, adapters)

    def _residency_of(self, config: ModelConfig) -> tuple[Residency, dict[int, trio.Lock]]:
        held = self._residency.get(config.name)
        if held is None or held[0].capacity != config.max_adapters_per_engine:
            held = (Residency(config.max_adapters_per_engine), {})
            self._residency[config.name] = held
        return held

    def _adapter(
        self, base: ServedModel, adapter: AdapterConfig, previous: ModelTable | None
    ) -> ServedModel:
        """An adapter of ``base``: its engines that can carry it, its queue, its own policy."""
        before = previous.get(adapter.name) if previous is not None else None
        if (before is not None and before.adapter == adapter and before.config == base.config
                and before.relay.text_model is base.relay.text_model
                and before.relay.parsers == base.relay.parsers):
            # unchanged: its policy and prefix memory go on, under the base model's settings
            return dataclasses.replace(
                before, settings=dataclasses.replace(base.settings, policy=before.settings.policy)
            )
        residency, locks = self._residency_of(base.config)
        policy = AdapterPolicy(self.make_policy(base.config.routing, False), residency, adapter)
        fleet = ModelFleet(self.fleet, base.config.name, carries_adapters)
        dispatcher = AdapterDispatcher(fleet, adapter, residency, locks)
        relay = Relay(dispatcher, base.relay.text_model, self.metrics,
                      HitRateWatch(self.metrics, self.diverged),
                      self.metrics.model_series(adapter.name), base.relay.parsers)
        settings = dataclasses.replace(base.settings, policy=policy)  # the base model's queue
        return ServedModel(base.config, settings, relay, base.tokenizing, base.text_model_key,
                           adapter)

    def _model(
        self, config: ModelConfig, frontend: FrontendConfig, previous: ModelTable | None
    ) -> ServedModel:
        before = previous.get(config.name) if previous is not None else None
        if before is not None and before.name != config.name:
            before = None  # the name was another model's alias or adapter
        scoped = model_frontend(frontend, config)
        key = text_model_key(config)
        if before is None:
            settings = Settings.first(scoped, self.make_policy(config.routing, True),
                                      self.metrics.model_series(config.name))
        else:
            routing_changed = config.routing != before.config.routing
            settings = before.settings.reloaded(
                scoped, self.make_policy(config.routing, True) if routing_changed else None
            )
        text_model = self.text_models[key]
        parsers = model_parsers(config.tool_parser, config.reasoning_parser,
                                text_model.template_text, text_model.model_type)
        if before is not None and before.text_model_key == key and before.relay.parsers == parsers:
            relay, tokenizing = before.relay, before.tokenizing
            if before.config.media != config.media:
                tokenizing = dataclasses.replace(tokenizing, media=self._media(config, text_model))
        else:
            log.info("model %s: tool parser %s, reasoning parser %s (%s)", config.name,
                     parsers.tool_parser or "none", parsers.reasoning_parser or "none",
                     parsers.reason, extra={"model": config.name})
            fleet = ModelFleet(self.fleet, config.name)
            relay = Relay(Dispatcher(fleet), text_model, self.metrics,
                          HitRateWatch(self.metrics, self.diverged),
                          self.metrics.model_series(config.name), parsers)
            tokenizing = Tokenizing(text_model, lambda: fleet.catalog, self.limiter,
                                    media=self._media(config, text_model))
        return ServedModel(config, settings, relay, tokenizing, key)

    def _media(self, config: ModelConfig, text_model: TextModel) -> MediaProfile | None:
        return media_profile(config.name, config.media, text_model, self.decode_limiter)


def queue_depths(table: ModelTable) -> dict[str, int]:
    """Requests waiting in each model's admission queue (by name), for the gauge."""
    return {model.name: model.settings.admission.waiting for model in table.models}


def tenant_queue_depths(table: ModelTable) -> dict[str, dict[tuple[str, str], int]]:
    """Requests waiting in each model's admission queue by (tenant label, tier), for the
    gauge."""
    return {model.name: model.settings.admission.waiting_by() for model in table.models}


def serving_counts(table: ModelTable) -> dict[str, int]:
    """Engines serving each model (by name), for the gauge and ``/fleet``."""
    return {
        model.name: len({e.name for e in model.catalog.engines}) for model in table.models
    }
