"""Adapter placement and residency (sans-IO): prefer the holder, unload the idle LRU."""

from __future__ import annotations

import pytest

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import AdapterConfig
from direct_frontend.pipeline.adapters import AdapterPolicy, Residency, carries_adapters
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.policies import RequestView, RoundRobin

REQUEST = RequestView((1, 2, 3), 4)


def handle(name: str, incarnation: int, kind: str = "sglang",
           role: EngineRole = EngineRole.BOTH) -> EngineHandle:
    return EngineHandle(name, kind, f"grpc://{name}:1", incarnation, role,
                        EngineInfo(served_model_name="m"), 4096, None, model="m")


def test_residency_unloads_the_least_recently_used_idle_adapter() -> None:
    residency = Residency(2)
    residency.sync(1, ["a", "b"])
    assert residency.victim(1) == "a"
    residency.touch(1, "a")
    assert residency.victim(1) == "b"
    residency.begin(1, "b")
    assert residency.victim(1) == "a"  # b has a request running
    residency.begin(1, "a")
    with pytest.raises(EngineError) as caught:
        residency.victim(1)
    assert caught.value.kind is ErrorKind.OVERLOADED
    residency.end(1, "a")
    residency.sync(1, ["b"])  # the engine's own word after an unload
    assert residency.victim(1) is None and not residency.holds(1, "a")


def test_residency_forgets_engines_that_left() -> None:
    residency = Residency(1)
    residency.sync(1, ["a"])
    residency.prune({2})
    assert not residency.holds(1, "a") and not residency.of(1).listed


def test_placement_prefers_an_engine_holding_the_adapter() -> None:
    one, two = handle("one", 1), handle("two", 2)
    catalog = Catalog(1, (one, two))
    residency = Residency(1)
    policy = AdapterPolicy(RoundRobin(), residency, AdapterConfig(name="sql", path="/sql"))
    residency.sync(2, ["sql"])
    assert {policy.choose(catalog, REQUEST).engine.name for _ in range(4)} == {"two"}  # type: ignore[union-attr]
    chosen = policy.choose(catalog, REQUEST, exclude={"two"})
    assert chosen is not None and chosen.engine.name == "one"  # loads there instead


def test_a_preloaded_only_adapter_is_placed_only_where_it_is() -> None:
    catalog = Catalog(1, (handle("one", 1),))
    policy = AdapterPolicy(RoundRobin(), Residency(1), AdapterConfig(name="pre"))
    assert policy.choose(catalog, REQUEST) is None


def test_only_engines_whose_contract_carries_an_adapter_serve_one() -> None:
    assert carries_adapters(handle("s", 1))
    assert not carries_adapters(handle("v", 1, kind="vllm"))  # no LoRA field in its Generate
    assert not carries_adapters(handle("t", 1, kind="trtllm"))
    assert not carries_adapters(handle("d", 1, role=EngineRole.DECODE))
