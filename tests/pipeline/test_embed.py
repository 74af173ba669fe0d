"""Which engines an embedding may go to (sans-IO; the calls are in tests/e2e/test_embeddings.py)."""

from __future__ import annotations

import dataclasses

from direct_frontend.pipeline.embed import embedders
from direct_frontend.routing.catalog import Catalog, EngineHandle
from tests.support.fleet import engine


def embedding_engine(name: str, kind: str) -> EngineHandle:
    base = engine(name)
    return dataclasses.replace(base, kind=kind, info=dataclasses.replace(base.info,
                                                                         generates=False))


def test_only_an_embedding_models_engines_of_a_kind_that_embeds() -> None:
    catalog = Catalog(1, (
        engine("gen"),  # a generation model's SGLang engine
        embedding_engine("v", "vllm"),
        embedding_engine("s", "sglang"),
        embedding_engine("t", "trtllm"),  # its servicer does not implement Embed
    ))
    assert catalog.embedders == {"v", "s", "t"}
    assert embedders(catalog) == {"v", "s"}
    assert embedders(Catalog(1, (engine("gen"),))) == set()
