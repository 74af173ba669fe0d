"""Placing a request on the fleet (sans-IO): aggregated or a P/D pair, and who hears back."""

from __future__ import annotations

import pytest

from direct_frontend.engines.neutral import EngineRole
from direct_frontend.errors import NoEngineAvailable
from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.routing.catalog import Catalog
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import LeastLoaded
from tests.support.fleet import StaticFleet as Fleet
from tests.support.fleet import engine

PROMPT = tuple(range(100, 116))  # 4 blocks of 4


def test_an_aggregated_placement_carries_the_fleet_policys_predictions() -> None:
    policy = KvAware(KvAwareKnobs(block_size=4))
    dispatcher = Dispatcher(Fleet(Catalog(1, (engine("a"),))))
    placement = dispatcher.choose(policy, PROMPT, 16)
    assert placement.engine.name == "a"
    assert placement.blocks == tuple(prefix_hashes(PROMPT, 4))
    assert placement.predicted_cached_tokens == 0  # nothing sent there yet
    again = dispatcher.choose(policy, PROMPT, 16)  # approximate mode: the router remembers
    assert again.predicted_cached_tokens == 3 * 4


def test_a_pair_is_placed_by_its_decode_engine_and_predicts_nothing() -> None:
    catalog = Catalog(1, (engine("agg"), engine("p", EngineRole.PREFILL),
                          engine("d", EngineRole.DECODE)))
    policy = KvAware(KvAwareKnobs(block_size=4))
    dispatcher = Dispatcher(Fleet(catalog))
    placement = dispatcher.choose(policy, PROMPT, 16)
    assert placement.engine.name == "d"
    # a decode engine's cached tokens are the transferred KV: no prediction, no blocks
    assert (placement.blocks, placement.predicted_cached_tokens, placement.spilled) == (
        (), None, False
    )
    # the prefill engine excluded (it failed): no pair left, the aggregated engine serves
    assert dispatcher.choose(policy, PROMPT, 16, exclude={"p"}).engine.name == "agg"
    with pytest.raises(NoEngineAvailable):
        dispatcher.choose(policy, PROMPT, 16, exclude={"p", "agg"})


def test_completion_reaches_the_policy_that_placed_the_request() -> None:
    policy = KvAware(KvAwareKnobs(block_size=4, approx_unit_blocks=1))  # block by block
    catalog = Catalog(1, (engine("a", incarnation=1), engine("p", EngineRole.PREFILL, 2),
                          engine("d", EngineRole.DECODE, 3)))
    dispatcher = Dispatcher(Fleet(catalog))
    answer = (7,) * 8
    whole = prefix_hashes(PROMPT + answer, 4)
    pair = dispatcher.choose(policy, PROMPT, 16)
    assert pair.engine.name == "d"
    dispatcher.complete(policy, pair, PROMPT, answer)
    assert policy.overlaps(whole, policy.clock(), catalog.engines) == {}  # not the fleet's
    aggregated = dispatcher.choose(policy, PROMPT, 16, exclude={"p"})
    dispatcher.complete(policy, aggregated, PROMPT, answer)
    assert policy.overlaps(whole, policy.clock(), catalog.engines) == {"a": len(whole)}
    assert isinstance(dispatcher.disagg.decode_policy, LeastLoaded)
