"""Retry/migrate decisions and token-exact continuations (sans-IO)."""

from __future__ import annotations

import dataclasses
import random

from direct_frontend.engines.neutral import GenerateCall, SamplingOptions
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import FaultsConfig
from direct_frontend.pipeline.failover import (
    Decision,
    FailoverConfig,
    FailoverState,
    continuation,
    replay,
)
from direct_frontend.routing.catalog import Catalog
from tests.support.fleet import engine


def err(kind: ErrorKind, engine: str = "a") -> EngineError:
    return EngineError(kind, "boom", engine=engine)


def test_failure_before_the_first_token_is_retried_a_bounded_number_of_times() -> None:
    state = FailoverState(FailoverConfig.from_fleet(FaultsConfig(max_retries=2)))
    assert state.decide(err(ErrorKind.UNAVAILABLE, "a"), 0) is Decision.RETRY
    assert state.decide(err(ErrorKind.TIMEOUT, "b"), 0) is Decision.RETRY
    assert state.decide(err(ErrorKind.UNAVAILABLE, "c"), 0) is Decision.GIVE_UP
    assert state.tried == {"a", "b", "c"}


def test_failure_after_tokens_migrates_up_to_the_limit() -> None:
    state = FailoverState(FailoverConfig.from_fleet(FaultsConfig(max_migrations=1)))
    assert state.decide(err(ErrorKind.PROTOCOL), 5) is Decision.MIGRATE
    assert state.decide(err(ErrorKind.PROTOCOL, "b"), 9) is Decision.GIVE_UP


def test_a_constrained_request_is_retried_but_never_migrated() -> None:
    state = FailoverState(
        FailoverConfig.from_fleet(FaultsConfig(max_retries=2, max_migrations=3)),
        unmigratable="constraint",
    )
    assert state.decide(err(ErrorKind.UNAVAILABLE), 0) is Decision.RETRY
    assert not state.refused_migration
    assert state.decide(err(ErrorKind.UNAVAILABLE, "b"), 4) is Decision.GIVE_UP
    assert state.refused_migration and state.migrations == 0


def test_client_errors_and_cancellation_are_never_retried() -> None:
    for kind in (ErrorKind.BAD_REQUEST, ErrorKind.CANCELLED, ErrorKind.INTERNAL):
        state = FailoverState(FailoverConfig.from_fleet(FaultsConfig()))
        assert state.decide(err(kind), 0) is Decision.GIVE_UP


def test_overload_is_tracked_so_the_client_can_get_a_429() -> None:
    state = FailoverState(FailoverConfig.from_fleet(FaultsConfig(max_retries=5)))
    state.decide(err(ErrorKind.OVERLOADED, "a"), 0)
    assert state.all_overloaded
    state.decide(err(ErrorKind.UNAVAILABLE, "b"), 0)
    assert not state.all_overloaded


def test_backoff_is_jittered_and_capped() -> None:
    default = FailoverConfig.from_fleet(FaultsConfig())
    config = dataclasses.replace(default, backoff_base_s=0.1, backoff_max_s=0.3)
    state = FailoverState(config, random.Random(7))
    for _ in range(6):
        state.decide(err(ErrorKind.UNAVAILABLE), 0)
        assert 0 <= state.backoff() <= 0.3


def test_continuation_resumes_from_the_generated_tokens() -> None:
    call = GenerateCall("req", (1, 2, 3), SamplingOptions(max_tokens=10, min_tokens=4))
    first = continuation(call, (7, 8, 9), 1)
    assert first.input_ids == (1, 2, 3, 7, 8, 9)
    assert first.sampling.max_tokens == 7 and first.sampling.min_tokens == 1
    assert first.request_id == "req~1"
    second = continuation(call, (7, 8, 9, 10, 11), 2)  # always from the original call
    assert second.input_ids == (1, 2, 3, 7, 8, 9, 10, 11)
    assert second.sampling.max_tokens == 5 and second.sampling.min_tokens == 0
    assert second.request_id == "req~2"


def test_a_request_excludes_the_serving_stints_it_failed_in() -> None:
    a, b = engine("a"), engine("b")
    state = FailoverState(FailoverConfig.from_fleet(FaultsConfig()))
    state.decide(err(ErrorKind.UNAVAILABLE, "a"), 0, a)
    state.decide(err(ErrorKind.UNAVAILABLE, "b"), 0)  # its stint not known: by name
    assert state.excluded(Catalog(1, (a, b))) == {"a", "b"}
    a_back, b_back = engine("a"), engine("b")  # both restarted: new handles
    assert state.excluded(Catalog(2, (a_back, b_back))) == {"b"}
    assert state.excluded(Catalog(3, ())) == set()


def test_a_continuation_asks_for_logprobs_again_and_not_for_the_prompts() -> None:
    sampling = SamplingOptions(max_tokens=10, logprobs=3, prompt_logprobs=3)
    call = GenerateCall("req", (1, 2, 3), sampling)
    retry = continuation(call, (), 1)  # nothing out yet: the same request again
    assert (retry.sampling.logprobs, retry.sampling.prompt_logprobs) == (3, 3)
    moved = continuation(call, (7, 8), 2)  # the prompt's came with the first tokens
    assert (moved.sampling.logprobs, moved.sampling.prompt_logprobs) == (3, None)


def test_a_migrated_stream_carries_its_images() -> None:
    """A continuation's prompt is the client's plus the tokens produced: the images' runs
    keep their offsets, so the same payload goes to the next engine (and a replay too)."""
    from direct_frontend.multimodal.payload import MediaPayload
    from direct_frontend.multimodal.processors import Batch, Tensor

    media = MediaPayload(Batch(Tensor(b"\0" * 4, (1, 1), "float32")), 9, ((1, 2),), ("h",))
    call = GenerateCall("r", (1, 9, 9, 2), SamplingOptions(max_tokens=8), media=media)
    moved = continuation(call, (5, 6), 1)
    assert moved.input_ids == (1, 9, 9, 2, 5, 6) and moved.media is media
    assert replay(call, 2).media is media
