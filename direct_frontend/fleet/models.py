"""The ``[[model]]`` tables of a fleet file, and how engines name the model they serve.

A fleet serves one or more models. A file without ``[[model]]`` tables is a
fleet of the one model ``[frontend]`` describes (``served_model_name``,
``tokenizer``, ``routing``, ``limits``), so today's files keep working. With
them, each model has its own tokenizer, routing, limits and sampling
defaults, and its LoRA adapters are served under their own names. Every name
a request may ask for (a model's name, its aliases, its adapters) is unique
across the fleet. These are the checks of the tables themselves and of the
``model`` key of engines; the generic reads come from :class:`Checker`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.neutral import EngineInfo
from direct_frontend.fleet.checker import (
    Checker,
    Table,
    keys_of,
    required_keys,
)
from direct_frontend.fleet.locate import KeyPath
from direct_frontend.fleet.schema import (
    AdapterConfig,
    EngineConfig,
    FrontendConfig,
    LimitsConfig,
    MediaConfig,
    ModelConfig,
    RoutingConfig,
)


class ModelTables(Checker):
    """Reads ``[[model]]`` tables and checks the names requests and engines use for them."""

    def models(self, value: object, frontend: FrontendConfig, source: Path) -> list[ModelConfig]:
        """Every ``[[model]]``, in file order; names, aliases and adapters unique fleet-wide."""
        models: list[ModelConfig] = []
        owners: dict[str, int] = {}
        for index, item in enumerate(self.array_of_tables(value, ("model",), "model"), 1):
            model = self.model(item, index, frontend, source)
            if model is None:
                continue
            named: list[tuple[KeyPath, str]] = [(("model", index, "name"), model.name)]
            named += [(("model", index, "aliases", i), a) for i, a in enumerate(model.aliases, 1)]
            named += [(("model", index, "adapter", i, "name"), adapter.name)
                      for i, adapter in enumerate(model.adapters, 1)]
            for where, name in named:
                first = owners.setdefault(name, index)
                if first != index or sum(n == name for _, n in named) > 1:
                    self.report(where, f"{name!r} is already used by model[{first}]")
            models.append(model)
        self.one_block_size(models)
        return models

    def one_block_size(self, models: list[ModelConfig]) -> None:
        """Models routed ``kv_aware`` share the fleet's one KV index, so one block size."""
        first: tuple[int, int] | None = None
        for index, model in enumerate(models, 1):
            if model.routing.policy != "kv_aware":
                continue
            block = model.routing.kv_aware.block_size
            if first is None:
                first = (index, block)
            elif block != first[1]:
                message = (f"must be model[{first[0]}]'s {first[1]}: the models routed kv_aware"
                           " share one KV index")
                self.report(("model", index, "routing", "knobs", "block_size"), message)

    def model(
        self, value: object, index: int, frontend: FrontendConfig, source: Path
    ) -> ModelConfig | None:
        path: KeyPath = ("model", index)
        tbl = self.table(value, path, keys_of(ModelConfig))
        if tbl is None:
            return None
        self.required(tbl, path, required_keys(ModelConfig))
        tokenizer = self.path(tbl, path, "tokenizer", source)
        if tokenizer is None and "tokenizer" not in tbl:
            if frontend.tokenizer == Path():
                message = "required key is missing (there is no frontend.tokenizer to fall back on)"
                self.report((*path, "tokenizer"), message)
            tokenizer = frontend.tokenizer
        aliases = tuple(text for _, text in self.strings(tbl, path, "aliases") or [])
        by_hand = {
            "aliases": aliases,
            "tokenizer": tokenizer,
            "chat_template": self.path(tbl, path, "chat_template", source),
            "routing": (self.section(RoutingConfig, tbl["routing"], (*path, "routing"))
                        if "routing" in tbl else frontend.routing),
            "limits": (self.section(LimitsConfig, tbl["limits"], (*path, "limits"))
                       if "limits" in tbl else frontend.limits),
            "adapters": self.adapters(tbl.get("adapter", []), (*path, "adapter")),
            "media": self.media(tbl["media"], (*path, "media")) if "media" in tbl
            else MediaConfig(),
            "implicit": False,
        }
        return ModelConfig(**self.fields(ModelConfig, tbl, path, by_hand))

    def media(self, value: object, path: KeyPath) -> MediaConfig:
        """``[model.media]``: its host and network lists by hand, each network a CIDR."""
        tbl = self.table(value, path, keys_of(MediaConfig))
        if tbl is None:
            return MediaConfig()
        hosts = tuple(text.lower() for _, text in self.strings(tbl, path, "allowed_hosts") or [])
        networks: list[str] = []
        for where, text in self.strings(tbl, path, "allowed_networks") or []:
            try:
                networks.append(str(ipaddress.ip_network(text, strict=False)))
            except ValueError:
                self.report(where, f"{text!r} is not a network (CIDR, e.g. 127.0.0.1/32)")
        by_hand = {"allowed_hosts": hosts, "allowed_networks": tuple(networks)}
        return MediaConfig(**self.fields(MediaConfig, tbl, path, by_hand))

    def adapters(self, value: object, path: KeyPath) -> tuple[AdapterConfig, ...]:
        adapters: list[AdapterConfig] = []
        for index, item in enumerate(self.array_of_tables(value, path, "model.adapter"), 1):
            where = (*path, index)
            tbl = self.table(item, where, keys_of(AdapterConfig))
            if tbl is None:
                continue
            self.required(tbl, where, required_keys(AdapterConfig))
            adapters.append(AdapterConfig(**self.fields(AdapterConfig, tbl, where)))
        return tuple(adapters)

    def path(self, tbl: Table, path: KeyPath, key: str, source: Path) -> Path | None:
        """A path relative to the fleet file's directory (so a fleet directory moves whole)."""
        text = self.string(tbl, path, key)
        if text is None:
            return None
        if text.startswith("~"):
            self.report((*path, key), f"{text!r}: '~' is not expanded; write the full path")
        return source.parent / text

    def frontend_model_keys(self, tbl: Table, has_models: bool) -> None:
        """Without ``[[model]]`` tables, ``[frontend]`` names the one model and its tokenizer."""
        if not has_models:
            self.required(tbl, ("frontend",), ("served_model_name", "tokenizer"))

    def resolve_frontend(
        self, frontend: FrontendConfig, models: list[ModelConfig]
    ) -> FrontendConfig:
        """``[frontend]`` with the first model's name and tokenizer where it gives none."""
        if not models:
            return frontend
        first = models[0]
        if frontend.served_model_name and not any(
            frontend.served_model_name in m.names for m in models
        ):
            known = ", ".join(m.name for m in models)
            message = (f"{frontend.served_model_name!r} names no [[model]] (models: {known});"
                       " leave it out with [[model]] tables")
            self.report(("frontend", "served_model_name"), message)
        return dataclasses.replace(
            frontend,
            served_model_name=frontend.served_model_name or first.name,
            tokenizer=frontend.tokenizer if frontend.tokenizer != Path() else first.tokenizer,
        )

    def engine_models(
        self, engines: list[tuple[int, EngineConfig]], models: list[ModelConfig]
    ) -> None:
        """Each engine's ``model`` names a model; without it, discovery must be able to say."""
        names = {name for model in models for name in model.names}
        known = ", ".join(model.name for model in models)
        for index, engine in engines:
            where: KeyPath = ("engine", index, "model")
            if engine.model is not None:
                if engine.model not in names:
                    self.report(where, f"{engine.model!r} names no [[model]] (models: {known})")
                continue
            if len(models) < 2:
                continue
            if engine.simulate and engine.simulator.served_model_name is None:
                self.report(("engine", index), 'a simulated engine of a fleet of several models'
                            ' needs model = "..." (the model it simulates)')
            elif not dialect_for(engine.kind).capabilities.reports_model:
                self.report(("engine", index), f'{engine.kind} engines do not report their served'
                            ' model; set model = "..." in a fleet of several models')


def engine_model(
    engine: EngineConfig, info: EngineInfo, models: Sequence[ModelConfig]
) -> ModelConfig | str:
    """The model a joining engine serves, or why it is refused (a sentence).

    The fleet file's ``model`` key and what discovery reports must agree; an
    engine that says nothing of its model (TensorRT-LLM) is taken at the file's
    word, or as the fleet's only model.
    """
    known = ", ".join(model.name for model in models)
    reported = info.served_model_name if info.served_name_known else None
    by_report = None if reported is None else next(
        (model for model in models if reported in model.names), None
    )
    if engine.model is not None:
        wanted = next((model for model in models if engine.model in model.names), None)
        if wanted is None:
            return f"the fleet file says model {engine.model!r}, which no model of the fleet is"
        if reported is not None and by_report is not wanted:
            return (f"discovery reports model {reported!r} but the fleet file says"
                    f" model = {engine.model!r}")
        return wanted
    if by_report is not None:
        return by_report
    if reported is None:
        if len(models) == 1:
            return models[0]
        return f'the engine does not report its model; set model = "..." (models: {known})'
    if len(models) == 1:
        return f"serves model {reported!r}, the fleet serves {models[0].name!r}"
    return f"serves model {reported!r}, which no [[model]] of the fleet names ({known})"
