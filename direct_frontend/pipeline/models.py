"""The models a daemon serves, each routed on its own, and the names requests ask for them by.

Every model of the fleet gets a :class:`ServedModel`: its own view of the
catalog (only its engines), its own policy instance, admission queue and
limits (a busy model never starves another's queue), its tokenizer and its
metric series. The whole set is a :class:`ModelTable`, replaced whole on a
reload like the settings; a request resolves its ``model`` in the table
once, on arrival, and keeps what it found to its end, so a removed model's
requests finish under it. The control plane builds both
(control/model_builder.py).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Iterator

import msgspec

from direct_frontend.fleet.preflight import TextModelKey
from direct_frontend.fleet.schema import AdapterConfig, ModelConfig, SamplingDefaults
from direct_frontend.observability.metrics import ModelSeries
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.parsing import with_tools_or_format
from direct_frontend.pipeline.preprocess import Tokenizing
from direct_frontend.pipeline.relay import Relay
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.catalog import Catalog

Request = ChatRequest | CompletionRequest
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_SAMPLING_DEFAULTS = operator.attrgetter(*_SAMPLING_FIELDS)  # a model's, as one tuple


def with_defaults(request: Request, defaults: SamplingDefaults) -> Request:
    """``request`` with the model's sampling defaults where the client set nothing.

    A chat request that names no thinking budget gets its ``reasoning_effort``'s
    (``effort_budgets``), else the model's ``thinking_token_budget``.
    """
    changes: dict[str, object] = {}
    values = _SAMPLING_DEFAULTS(defaults)  # the model's defaults read first: mostly none is set
    if values.count(None) != len(values):
        changes = {name: value for name, value in zip(_SAMPLING_FIELDS, values, strict=True)
                   if value is not None and getattr(request, name) is None}
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
