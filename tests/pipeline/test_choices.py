"""The sans-IO side of several choices: each choice's request id and seed."""

from __future__ import annotations

from direct_frontend.openai.types import CompletionRequest
from direct_frontend.pipeline.choices import choice_request, choice_seed
from direct_frontend.pipeline.preprocess import PreparedRequest

INT64_MAX = 2**63 - 1


def test_choice_seeds_follow_the_request_seed_and_stay_int64() -> None:
    assert [choice_seed(10, i) for i in range(3)] == [10, 11, 12]
    assert choice_seed(None, 5) is None
    assert choice_seed(INT64_MAX, 1) == -(2**63)  # wraps, as the int64 field would
    assert choice_seed(-1, 1) == 0


def test_each_choice_is_a_request_of_its_own() -> None:
    request = CompletionRequest(model="m", prompt="hi", n=3, seed=7)
    prepared = PreparedRequest("completion", "r1", request, (1, 2), "hi")
    second = choice_request(prepared, 1)
    assert second.request_id == "r1-1" and second.request.seed == 8
    assert second.input_ids == prepared.input_ids and second.request.n == 3
    assert prepared.request.seed == 7  # the client's request is untouched
    unseeded = PreparedRequest("completion", "r2", CompletionRequest(model="m", prompt="hi"),
                               (1,), "hi")
    assert choice_request(unseeded, 2).request.seed is None


def test_a_batch_choice_is_numbered_in_the_response_and_seeded_in_its_prompt() -> None:
    request = CompletionRequest(model="m", prompt="hi", n=2, seed=7)
    prepared = PreparedRequest("completion", "r1", request, (1, 2), "hi")
    # choice 1 of the second prompt: index 3 of the response, seeded as choice 1 alone
    third = choice_request(prepared, 3, 1)
    assert third.request_id == "r1-3" and third.request.seed == 8
