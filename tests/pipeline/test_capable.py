"""Which serving engines can carry a request's optional fields (sans-IO)."""

from __future__ import annotations

import dataclasses

from direct_frontend.engines.neutral import Constraint, ConstraintKind, SamplingOptions
from direct_frontend.pipeline.capable import incapable, none_capable
from direct_frontend.routing.catalog import Catalog, EngineHandle
from tests.support.fleet import engine

FLEET = Catalog(1, (
    engine("s"),  # sglang
    dataclasses.replace(engine("v"), kind="vllm"),
    dataclasses.replace(engine("t"), kind="trtllm"),
))


def test_a_plain_request_fits_every_engine() -> None:
    plain = SamplingOptions(max_tokens=4)
    assert incapable(FLEET, plain) == {}
    constrained = dataclasses.replace(plain, constraint=Constraint(ConstraintKind.CHOICE,
                                                                   choices=("a",)))
    assert incapable(FLEET, constrained) == {}  # every kind takes every constraint kind


def test_each_field_excludes_the_kinds_that_lack_it() -> None:
    assert incapable(FLEET, SamplingOptions(max_tokens=4, seed=1)) == {"s": "seed"}
    biased = SamplingOptions(max_tokens=4, logit_bias=((3, 1.0),))
    assert incapable(FLEET, biased) == {"t": "logit_bias"}
    both = SamplingOptions(max_tokens=4, seed=1, logit_bias=((3, 1.0),))
    assert incapable(FLEET, both) == {"s": "seed", "t": "logit_bias"}
    assert none_capable(FLEET, incapable(FLEET, both)) is None  # vLLM carries both


def test_when_no_serving_engine_can_carry_it_the_400_names_the_field() -> None:
    sglang_only = Catalog(1, (engine("s"), engine("s2")))
    lacking = incapable(sglang_only, SamplingOptions(max_tokens=4, seed=1))
    err = none_capable(sglang_only, lacking)
    assert err is not None and err.status == 400 and err.param == "seed"
    assert "sglang" in err.message
    assert none_capable(Catalog(), {}) is None  # nothing serves: the request waits instead


def embedder(name: str) -> EngineHandle:
    """An engine of an embedding model (vLLM --runner pooling)."""
    base = engine(name)
    return dataclasses.replace(base, kind="vllm",
                               info=dataclasses.replace(base.info, generates=False))


def test_an_embedding_models_engines_never_take_a_generation() -> None:
    mixed = Catalog(1, (*FLEET.engines, embedder("e")))
    assert mixed.embedders == {"e"}
    assert incapable(mixed, SamplingOptions(max_tokens=4)) == {"e": "model"}
    assert incapable(mixed, SamplingOptions(max_tokens=4, seed=1)) == {"e": "model", "s": "seed"}
    assert none_capable(mixed, incapable(mixed, SamplingOptions(max_tokens=4))) is None


def test_a_generation_for_an_embedding_model_is_a_400_naming_the_model() -> None:
    only = Catalog(1, (embedder("e1"), embedder("e2")))
    err = none_capable(only, incapable(only, SamplingOptions(max_tokens=4)))
    assert err is not None and err.status == 400 and err.param == "model"
    assert "/v1/embeddings" in err.message
