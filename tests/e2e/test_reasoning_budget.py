"""End to end: a thinking budget closes the reply's reasoning block, on an engine that has none.

The scripted engine thinks at length and then answers late; once a prompt
carries the closed block (``</think>``), as the router's continuation does, it
answers at once. So a reply whose budget ran out shows a short reasoning
and the prompt answer, and one within its budget is untouched.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from direct_frontend.simulator.faults import FaultPlan
from tests.support.daemon import Daemon
from tests.support.http import http, sdk2_http
from tests.support.models import (
    engine_table,
    openai_client,
    scripted_daemon,
    simulators,
)

THOUGHT = " ".join(f"step{i}" for i in range(40))
SCRIPTS = {  # the first marker found wins: a continuation carries both
    "</think>": "The answer is 42.",
    "[ponder]": f"<think>{THOUGHT}</think>Late answer.",
}
ASK = [{"role": "user", "content": "Think it over. [ponder]"}]
BUDGET = 6


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    models = ('[[model]]\nname = "thinker"\nreasoning_parser = "qwen3"\n'
              f"[model.sampling.effort_budgets]\nlow = {BUDGET}\n")
    with scripted_daemon(model_dir, tmp_path_factory.mktemp("budget"), models,
                         engine_table("sim", "vllm", "thinker"), SCRIPTS) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def cut_thought(tokenizer: Tokenizer, tokens: int) -> str:
    """The reasoning a reply shows when its block is closed after ``tokens`` tokens."""
    ids = tokenizer.encode(SCRIPTS["[ponder]"], add_special_tokens=False).ids
    return str(tokenizer.decode(ids[:tokens])).removeprefix("<think>").strip()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon) as client:
        yield client


def engine_calls(daemon: Daemon) -> int:
    return int(simulators(daemon)["sim"].stats.requests)


def closed_total(daemon: Daemon) -> float:
    scrape = http.get(daemon.url + "/metrics").text
    line = next(line for line in scrape.splitlines()
                if line.startswith("direct_frontend_reasoning_budget_closed_total "))
    return float(line.split()[1])


def reasoning_of(message: Any) -> str:
    return str(getattr(message, "reasoning_content", None) or message.model_extra.get(
        "reasoning_content") or "")


@pytest.mark.parametrize("stream", [False, True])
def test_a_spent_budget_closes_the_reasoning_and_the_answer_follows(
    daemon: Daemon, client: openai.OpenAI, tokenizer: Tokenizer, stream: bool
) -> None:
    """Exactly at the budget, however the engine's tokens came in batches."""
    calls, closed = engine_calls(daemon), closed_total(daemon)
    extra = {"thinking_token_budget": BUDGET}
    if stream:
        chunks = list(client.chat.completions.create(
            model="thinker", messages=ASK, stream=True, extra_body=extra,
            stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(reasoning_of(d) for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(model="thinker", messages=ASK, extra_body=extra)
        message = reply.choices[0].message
        reasoning, content = reasoning_of(message), message.content
        usage = reply.usage
    assert content == "The answer is 42."
    assert reasoning == cut_thought(tokenizer, BUDGET)
    assert engine_calls(daemon) == calls + 2  # the thinking, then the answer after the block
    assert closed_total(daemon) == closed + 1
    answer_alone = client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "</think>"}]).usage
    closing = len(tokenizer.encode("\n</think>\n\n", add_special_tokens=False).ids)
    assert usage is not None and answer_alone is not None
    assert usage.completion_tokens == BUDGET + closing + answer_alone.completion_tokens
    assert usage.prompt_tokens == client.chat.completions.create(
        model="thinker", messages=ASK, max_tokens=1).usage.prompt_tokens  # the client's prompt


def test_a_reply_within_its_budget_or_without_one_is_untouched(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    for extra in ({}, {"thinking_token_budget": 10_000}, {"thinking_token_budget": -1}):
        calls = engine_calls(daemon)
        reply = client.chat.completions.create(model="thinker", messages=ASK, extra_body=extra)
        message = reply.choices[0].message
        assert reasoning_of(message) == THOUGHT and message.content == "Late answer."
        assert engine_calls(daemon) == calls + 1


def test_a_messages_thinking_budget_is_kept_too(daemon: Daemon, tokenizer: Tokenizer) -> None:
    client = anthropic.Anthropic(http_client=sdk2_http(), base_url=daemon.url, api_key="unused")
    reply = client.messages.create(
        model="thinker", max_tokens=200, messages=[{"role": "user", "content": ASK[0]["content"]}],
        thinking={"type": "enabled", "budget_tokens": BUDGET})
    kinds = [block.type for block in reply.content]
    assert kinds == ["thinking", "text"]
    assert reply.content[0].thinking == cut_thought(tokenizer, BUDGET)  # type: ignore[union-attr]
    assert reply.content[1].text == "The answer is 42."  # type: ignore[union-attr]


def test_a_bad_budget_is_a_400_naming_it(daemon: Daemon) -> None:
    bad = http.post(daemon.url + "/v1/chat/completions", json={
        "model": "thinker", "messages": ASK, "thinking_token_budget": -2})
    assert bad.status_code == 400 and "thinking_token_budget" in json.dumps(bad.json())
    worse = http.post(daemon.url + "/v1/messages", json={
        "model": "thinker", "max_tokens": 10, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": "lots"}})
    assert worse.status_code == 400 and "budget_tokens" in worse.text


def test_logprobs_stay_in_step_with_the_closed_block(
    daemon: Daemon, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    """One entry per output token; the closing marker's were not sampled (logprob 0)."""
    reply = client.chat.completions.create(
        model="thinker", messages=ASK, logprobs=True,
        extra_body={"thinking_token_budget": BUDGET, "include_reasoning": False})
    entries = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and reply.usage is not None
    closing = tokenizer.encode("\n</think>\n\n", add_special_tokens=False).ids
    assert reply.choices[0].message.content == "The answer is 42."
    text = "".join(entry.token for entry in entries)
    assert text.removesuffix("<|im_end|>").endswith("\n</think>\n\nThe answer is 42.")
    at = text.index("\n</think>")
    assert sum(len(e.token) for e in entries[:BUDGET]) == at  # the budget's tokens, then ours
    assert [e.logprob for e in entries[BUDGET:BUDGET + len(closing)]] == [0.0] * len(closing)


def test_a_models_effort_budget_keeps_reasoning_effort_and_the_client_may_lift_it(
    daemon: Daemon, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    """``[model.sampling.effort_budgets]``: ``low`` is this model's BUDGET; other efforts,
    and a request's own ``thinking_token_budget`` of -1, are unlimited."""
    low = client.chat.completions.create(model="thinker", messages=ASK, reasoning_effort="low")
    assert reasoning_of(low.choices[0].message) == cut_thought(tokenizer, BUDGET)
    assert low.choices[0].message.content == "The answer is 42."
    for ask in ({"reasoning_effort": "high"},
                {"reasoning_effort": "low", "extra_body": {"thinking_token_budget": -1}}):
        reply = client.chat.completions.create(model="thinker", messages=ASK, **ask)
        assert reasoning_of(reply.choices[0].message) == THOUGHT


def test_a_continued_reply_whose_engine_dies_migrates_unbroken(
    model_dir: Path, tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """The continuation after the closed block is a stream like any other: its engine dying
    two tokens into the answer moves it to the other engine, and the client sees one reply.

    The prompt is long (about 20 blocks), so the engine that thought holds enough of it to
    take the continuation whatever load it still shows for the thought just aborted there
    (up to two requests' worth: ours until its call ends, the engine's own report until the
    next probe)."""
    models = ('[frontend.routing]\npolicy = "kv_aware"\n\n'
              '[[model]]\nname = "thinker"\nreasoning_parser = "qwen3"\n')
    engines = engine_table("a", "vllm", "thinker") + "\n" + engine_table("b", "vllm", "thinker")
    with scripted_daemon(model_dir, tmp_path, models, engines, SCRIPTS) as daemon, \
            openai_client(daemon) as client:
        daemon.wait_serving(2)
        for sim in simulators(daemon).values():  # each engine's second call: a continuation
            sim.faults = FaultPlan(die_after_tokens=2, only_request=2)
        long_ask = [{"role": "user", "content": " ".join(f"fact{i}." for i in range(60))
                     + " Think it over. [ponder]"}]
        chunks = list(client.chat.completions.create(
            model="thinker", messages=long_ask, stream=True,
            stream_options={"include_usage": True},
            extra_body={"thinking_token_budget": BUDGET}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(reasoning_of(d) for d in deltas) == cut_thought(tokenizer, BUDGET)
        assert "".join(d.content or "" for d in deltas) == "The answer is 42."
        calls = {name: sim.fault_stats.generate_calls
                 for name, sim in simulators(daemon).items()}
        assert sorted(calls.values()) == [1, 2]  # thought and died on one, answered on the other
        usage = chunks[-1].usage
        closing = len(tokenizer.encode("\n</think>\n\n", add_special_tokens=False).ids)
        answer = len(tokenizer.encode("The answer is 42.", add_special_tokens=False).ids)
        assert usage is not None and usage.completion_tokens == BUDGET + closing + answer + 1
