"""Disaggregated serving decisions (sans-IO): pairing, per-role routing, placing the legs.

What each kind's legs carry is its dialect's (tests/engines/test_dialects.py).
"""

from __future__ import annotations

import json
import random

import pytest

from direct_frontend.engines.dialects.sglang import ROOM_LIMIT, SglangDialect
from direct_frontend.engines.dialects.vllm import PREFILL_PARAMS, VllmDialect
from direct_frontend.engines.neutral import (
    Disaggregation,
    EngineInfo,
    EngineRole,
    Finished,
    FinishReason,
    GenerateCall,
    SamplingOptions,
)
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import KvAwareKnobs
from direct_frontend.pipeline.disagg import (
    DisaggPlanner,
    pairable_groups,
    pairing_group,
    role_policies,
)
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import LeastLoaded, Placement, RequestView, RoundRobin

P, D, B = EngineRole.PREFILL, EngineRole.DECODE, EngineRole.BOTH
VIEW = RequestView((1, 2, 3), 16)
CALL = GenerateCall("req-1", (5, 6, 7, 8), SamplingOptions(max_tokens=40, min_tokens=3))


def engine(
    name: str,
    kind: str,
    role: EngineRole,
    *,
    connector: str = "NixlConnector",
    bootstrap_port: int | None = None,
    dp: int = 1,
    engine_id: str = "",
) -> EngineHandle:
    details = (("kv_connector", connector), ("kv_engine_id", engine_id)) if kind == "vllm" else ()
    info = EngineInfo("demo", role=role, data_parallel_size=dp, details=details)
    return EngineHandle(name, kind, f"grpc://{name}.lan:50051", 1, role, info, 4096, None,
                        bootstrap_port=bootstrap_port)


def names(placements: list[Placement | None]) -> list[str]:
    return [p.engine.name for p in placements if p is not None]


# -- which engines pair ---------------------------------------------------------------


def test_pairs_need_a_prefill_and_a_decode_of_the_same_group() -> None:
    catalog = Catalog(1, (
        engine("sp", "sglang", P), engine("sd", "sglang", D),
        engine("vp", "vllm", P), engine("vd", "vllm", D, connector="MooncakeConnector"),
        engine("agg", "sglang", B),
    ))
    # vLLM NIXL prefill and Mooncake decode cannot hand KV to each other
    assert pairable_groups(catalog) == {"sglang"}
    assert pairable_groups(catalog, exclude={"sp"}) == set()
    no_prefill = Catalog(1, (engine("sd", "sglang", D), engine("a", "sglang", B)))
    assert pairable_groups(no_prefill) == set()


def test_trtllm_never_pairs_whatever_its_handle_says() -> None:
    forced = (engine("tp", "trtllm", P), engine("td", "trtllm", D))
    assert [pairing_group(e) for e in forced] == [None, None]
    planner = DisaggPlanner()
    catalog = Catalog(1, forced)
    assert planner.choose_decode(catalog, VIEW) is None
    assert planner.plan(catalog, forced[1], CALL) is None


def test_a_mooncake_prefill_with_data_parallel_ranks_cannot_be_named() -> None:
    mooncake = "MooncakeConnector"
    catalog = Catalog(1, (engine("vp", "vllm", P, connector=mooncake, dp=2),
                          engine("vd", "vllm", D, connector=mooncake)))
    assert pairable_groups(catalog) == set()


def test_pd_is_preferred_and_aggregated_engines_are_the_fallback() -> None:
    planner = DisaggPlanner()
    catalog = Catalog(1, (engine("agg", "sglang", B), engine("sp", "sglang", P),
                          engine("sd", "sglang", D)))
    chosen = planner.choose_decode(catalog, VIEW)
    assert chosen is not None and chosen.engine.name == "sd"
    # the prefill failed (failover excludes it): no pair left, serve aggregated
    assert planner.choose_decode(catalog, VIEW, exclude={"sp"}) is None
    assert planner.choose_decode(catalog, VIEW, exclude={"sd"}) is None


# -- per-role routing -----------------------------------------------------------------


def test_each_role_has_its_own_round_robin_and_honours_exclusions() -> None:
    planner = DisaggPlanner(random.Random(1))
    planner.follow(RoundRobin())
    decodes = [engine("d1", "sglang", D), engine("d2", "sglang", D)]
    prefills = [engine("p1", "sglang", P), engine("p2", "sglang", P), engine("p3", "sglang", P)]
    catalog = Catalog(1, (*prefills, *decodes))
    picks = names([planner.choose_decode(catalog, VIEW) for _ in range(4)])
    assert sorted(picks[:2]) == ["d1", "d2"] and picks[2:] == picks[:2]  # in turn
    plans = [planner.plan(catalog, decodes[0], CALL) for _ in range(3)]
    assert sorted(p.prefill.name for p in plans if p) == ["p1", "p2", "p3"]
    again = planner.plan(catalog, decodes[0], CALL, exclude={"p1", "p2"})
    assert again is not None and again.prefill.name == "p3"
    assert planner.plan(catalog, decodes[0], CALL, exclude={"p1", "p2", "p3"}) is None


def test_role_policies_follow_the_fleet_policy() -> None:
    prefill, decode = role_policies(LeastLoaded())
    assert isinstance(prefill, LeastLoaded) and isinstance(decode, LeastLoaded)
    kv = KvAware(KvAwareKnobs(block_size=4), uses_events={7})
    prefill, decode = role_policies(kv)
    # the prefix cache that saves work is the prefill engine's; decode goes least loaded
    assert isinstance(prefill, KvAware) and prefill.knobs == kv.knobs
    assert prefill.uses_events is kv.uses_events
    assert isinstance(decode, LeastLoaded)
    planner = DisaggPlanner()
    planner.follow(kv)
    first = planner.prefill_policy
    planner.follow(kv)
    assert planner.prefill_policy is first  # same fleet policy: same per-role state
    planner.follow(RoundRobin())  # a reload replaced it
    assert isinstance(planner.prefill_policy, RoundRobin)


def test_role_policies_of_the_fleet_policy_before_a_reload_are_kept() -> None:
    planner = DisaggPlanner()
    old, new = KvAware(KvAwareKnobs(block_size=4)), KvAware(KvAwareKnobs(block_size=4))
    planner.follow(old)
    before = planner.prefill_policy
    planner.follow(new)  # a reload; requests admitted before it still carry ``old``
    after = planner.prefill_policy
    planner.follow(old)
    assert planner.prefill_policy is before  # its routing state is still there
    planner.follow(new)
    assert planner.prefill_policy is after


def test_kv_aware_prefill_blocks_count_in_the_prefill_engines_load() -> None:
    planner = DisaggPlanner()
    planner.follow(KvAware(KvAwareKnobs(block_size=2)))
    catalog = Catalog(1, (engine("p", "sglang", P), engine("d", "sglang", D)))
    plan = planner.plan(catalog, catalog.engines[1], CALL)
    assert plan is not None and len(plan.prefill_blocks) == 2  # 4 prompt tokens / 2


# -- the decode engine's dialect builds the legs -----------------------------------------


def test_sglang_legs_run_at_once_and_the_client_is_served_from_decode() -> None:
    planner = DisaggPlanner(random.Random(3))
    prefill = engine("sp", "sglang", P, bootstrap_port=9100)
    decode = engine("sd", "sglang", D)
    plan = planner.plan(Catalog(1, (prefill, decode)), decode, CALL)
    assert plan is not None and plan.parallel and not plan.relays_kv_params
    assert (plan.prefill, plan.decode) == (prefill, decode)
    legs = SglangDialect().pair_legs(CALL, prefill, random.Random(3))  # what the planner drew
    assert (plan.prefill_call, plan.decode_call) == (legs.prefill_call, legs.decode_call)
    rendezvous = plan.decode_call.disaggregation
    assert rendezvous is not None and plan.prefill_call.disaggregation == rendezvous
    assert rendezvous.bootstrap_room is not None and 0 <= rendezvous.bootstrap_room < ROOM_LIMIT
    assert plan.decode_after(Finished(FinishReason.LENGTH, 4, 1)) == plan.decode_call
    other = planner.plan(Catalog(1, (prefill, decode)), decode, CALL)
    assert other is not None and other.decode_call.disaggregation != rendezvous  # a new room


def test_vllm_nixl_prefill_leg_then_the_handoff_verbatim() -> None:
    prefill, decode = engine("vp", "vllm", P), engine("vd", "vllm", D)
    plan = DisaggPlanner().plan(Catalog(1, (prefill, decode)), decode, CALL)
    assert plan is not None and not plan.parallel and plan.relays_kv_params
    leg = plan.prefill_call
    assert leg.sampling.max_tokens == 1 and leg.sampling.min_tokens == 0 and leg.stream is False
    assert leg.disaggregation == Disaggregation(kv_transfer_params_json=PREFILL_PARAMS)
    handoff = '{"remote_block_ids": [1, 2], "do_remote_prefill": true}'  # odd spacing kept
    decode_call = plan.decode_after(Finished(FinishReason.LENGTH, 4, 1,
                                             kv_transfer_params_json=handoff))
    assert decode_call.disaggregation == Disaggregation(kv_transfer_params_json=handoff)
    assert decode_call.sampling == CALL.sampling and decode_call.input_ids == CALL.input_ids
    with pytest.raises(EngineError) as missing:
        plan.decode_after(Finished(FinishReason.LENGTH, 4, 1))
    assert missing.value.kind is ErrorKind.INTERNAL and missing.value.engine == "vp"


def test_vllm_mooncake_legs_run_one_after_the_other_without_a_relay() -> None:
    mooncake = "MooncakeConnector"
    prefill = engine("vp", "vllm", P, connector=mooncake, engine_id="engine-p")
    decode = engine("vd", "vllm", D, connector=mooncake)
    plan = DisaggPlanner(random.Random(5)).plan(Catalog(1, (prefill, decode)), decode, CALL)
    assert plan is not None and not plan.parallel and not plan.relays_kv_params
    legs = VllmDialect().pair_legs(CALL, prefill, random.Random(5))  # what the planner drew
    assert (plan.prefill_call, plan.decode_call) == (legs.prefill_call, legs.decode_call)
    assert plan.decode_after(Finished(FinishReason.LENGTH, 4, 1)) == plan.decode_call
    assert plan.decode_call.disaggregation is not None
    second = json.loads(plan.decode_call.disaggregation.kv_transfer_params_json or "")
    assert second["remote_engine_id"] == "engine-p"
