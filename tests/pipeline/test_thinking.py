"""The reasoning budget with data only: the cut, the verdict, the output held past it."""

from __future__ import annotations

from direct_frontend.engines.neutral import Finished, FinishReason, TokenDelta, TokenLogprob
from direct_frontend.openai.parsers.registry import ChoiceParser
from direct_frontend.pipeline.thinking import ThinkingBudget

IDS = (1, 2, 3, 4, 5)
LOGPROBS = tuple(TokenLogprob(t, -t / 8) for t in IDS)


def test_a_batch_that_crosses_the_budget_is_cut_exactly_there() -> None:
    event = TokenDelta(IDS, cached_tokens=3, logprobs=LOGPROBS)
    within = ThinkingBudget(7)
    assert within.cut(event, produced=2, merged=0) is event and within.held is None
    budget = ThinkingBudget(5)
    cut = budget.cut(event, produced=2, merged=1)  # room for 2 behind the batch's first
    assert cut == TokenDelta(IDS[:2], cached_tokens=3, logprobs=LOGPROBS[:2])
    assert budget.held == TokenDelta(IDS[2:], cached_tokens=3, logprobs=LOGPROBS[2:])
    assert budget.release() == TokenDelta(IDS[2:], cached_tokens=3, logprobs=LOGPROBS[2:])
    assert budget.held is None and budget.release() is None


def test_a_batch_at_the_budget_or_past_it_is_taken_whole() -> None:
    event = TokenDelta(IDS)
    assert ThinkingBudget(0).cut(event, produced=0, merged=0) is event  # a budget of 0
    assert ThinkingBudget(3).cut(event, produced=4, merged=0) is event  # past it already
    at = ThinkingBudget(4)
    assert at.cut(event, produced=2, merged=2) == TokenDelta(())  # at it, behind others
    assert at.held == event


def test_the_engines_last_event_is_cut_too_and_its_end_held() -> None:
    budget = ThinkingBudget(2)
    end = Finished(FinishReason.STOP, 4, 5, token_ids=IDS)
    assert budget.cut(end, produced=0, merged=0) == TokenDelta(IDS[:2], 4, 5)
    assert isinstance(budget.held, Finished) and budget.held.token_ids == IDS[2:]


def test_the_verdict_closes_an_open_block_and_drops_what_was_held() -> None:
    parser = ChoiceParser(reasoning_parser="qwen3")
    parser.feed("<think>one two three")
    budget = ThinkingBudget(3)
    budget.held = TokenDelta((9,))
    assert budget.due(2, parser) is None  # not spent yet
    assert budget.due(3, parser) == "</think>" and budget.held is None
    budget.closed()
    assert budget.limit is None and budget.due(10, parser) is None  # once


def test_no_block_open_at_the_budget_lets_the_held_output_go_on() -> None:
    parser = ChoiceParser(reasoning_parser="qwen3")
    parser.feed("<think>short</think> the answer")
    budget = ThinkingBudget(3)
    budget.held = held = TokenDelta((9,))
    assert budget.due(3, parser) is None and budget.limit is None  # done with
    assert budget.held is held  # taken next ...
    budget.drop()
    assert budget.release() is None  # ... unless its engine failed: the next makes it again
