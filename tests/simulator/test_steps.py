"""Batched scheduler steps: chunked prefill first come first served, one decode batch."""

from __future__ import annotations

import pytest

from direct_frontend.simulator import TimingModel
from direct_frontend.simulator.steps import StepLoop
from tests.simulator.test_engine import generate, output_of
from tests.support.sim import run, serving

STEPPED = TimingModel(prefill_us_per_token=100, decode_us_per_token=500, max_running=8,
                      chunk_tokens=2048, step_us=6000)


def test_a_prefill_waits_for_the_prefills_admitted_before_it() -> None:
    loop = StepLoop(STEPPED)
    first, second = loop.admit(3000, 9), loop.admit(500, 9)
    assert loop.plan() == (2048, [])  # the chunk goes to the first one
    loop.finish([])
    assert (first.turns, second.turns) == (0, 0)
    assert loop.plan() == (952 + 500, [])
    loop.finish([])
    assert (first.turns, second.turns) == (1, 1)  # both first tokens at that step's end
    prefilled, decoded = loop.plan()
    assert prefilled == 0 and decoded == [first, second]


def test_a_request_that_had_all_its_tokens_is_not_decoded_again() -> None:
    loop = StepLoop(STEPPED)
    short, long = loop.admit(10, 2), loop.admit(10, 3)
    for _ in range(2):
        loop.finish(loop.plan()[1])
    assert (short.given, long.given) == (2, 2)
    assert loop.plan()[1] == [long]  # the short one is leaving: it has had its 2


def test_a_step_lasts_longer_with_its_prefill_and_its_batch() -> None:
    loop = StepLoop(STEPPED)
    assert loop.step_seconds(0, 1) == pytest.approx(0.0065)
    assert loop.step_seconds(0, 16) == pytest.approx(0.014)
    assert loop.step_seconds(2048, 16) == pytest.approx(0.014 + 0.2048)


def test_a_request_that_leaves_gets_no_more_steps() -> None:
    loop = StepLoop(STEPPED)
    gone, staying = loop.admit(100, 9), loop.admit(100, 9)
    loop.leave(gone)
    assert loop.plan() == (100, [])
    loop.finish([])
    loop.leave(staying)
    assert loop.plan() == (0, [])
    assert not loop.prefilling and not loop.decoding


def test_stepped_timing_is_not_instant_and_checks_its_values() -> None:
    assert STEPPED.stepped and not STEPPED.instant
    assert not TimingModel(chunk_tokens=512).stepped  # no time at all: instant
    with pytest.raises(ValueError):
        TimingModel(chunk_tokens=-1)
    with pytest.raises(ValueError):
        TimingModel(step_us=-1)


def test_an_engine_in_steps_streams_every_token_one_step_apart() -> None:
    """A prompt of 5 tokens prefills in one step (its first token), then a token per step."""
    timing = TimingModel(prefill_us_per_token=1, decode_us_per_token=1, max_running=4,
                         chunk_tokens=4, step_us=1)

    async def body() -> None:
        async with serving("vllm", timing=timing) as (engine, channel):
            reply = await generate("vllm", channel, max_tokens=6, ignore_eos=True)
            assert len(output_of("vllm", reply, stream=True)) == 6
            # 5 prompt tokens in chunks of 4: 2 steps (the first token), then 5 more tokens
            assert engine.core.steps[0].steps == 2 + 5
            assert not engine.core.steps[0].prefilling and not engine.core.steps[0].decoding

    run(body())
