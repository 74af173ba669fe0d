"""Builds the table of models a daemon serves, keeping what a reload did not change.

Every model of the fleet gets its :class:`~direct_frontend.pipeline.models.ServedModel`
from :class:`ModelBuilder`: its own view of the catalog (only its engines:
:class:`ModelFleet`), its own policy instance, admission queue and limits (a
busy model never starves another's queue), its tokenizer and its metric
series. A reload keeps the parts of a model that did not change (its policy
and queue when routing and limits did not, its relay when its tokenizer did
not), and loads each tokenizer once, in a worker thread
(:meth:`ModelBuilder.load`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

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
)
from direct_frontend.multimodal.fetch import new_decode_limiter
from direct_frontend.observability.metrics import Metrics
from direct_frontend.pipeline.adapters import (
    AdapterDispatcher,
    AdapterPolicy,
    Residency,
    carries_adapters,
)
from direct_frontend.pipeline.dispatch import Dispatcher, WaitableFleet
from direct_frontend.pipeline.media import MediaProfile, media_profile
from direct_frontend.pipeline.models import ModelTable, ServedModel
from direct_frontend.pipeline.parsing import model_parsers, parser_problems
from direct_frontend.pipeline.preprocess import (
    Tokenizing,
    new_holding_limiter,
    new_tokenize_limiter,
)
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
        #: rendering and bounding large chats, daemon-wide: one at a time (they hold the GIL)
        self.holding = new_holding_limiter()
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
                                    media=self._media(config, text_model),
                                    holding=self.holding)
        return ServedModel(config, settings, relay, tokenizing, key)

    def _media(self, config: ModelConfig, text_model: TextModel) -> MediaProfile | None:
        return media_profile(config.name, config.media, text_model, self.decode_limiter)
