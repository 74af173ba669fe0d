"""Logprobs end to end: the official client, the real daemon, each simulated engine kind.

The simulator's logprobs are a pure function of the token prefix
(``simulator/logprobs.py``), so a test knows the exact values each engine
sent (float32 wires carry them exactly) and a migrated stream must repeat
the uninterrupted run's logprobs position for position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.simulator.logprobs import output_rows, prompt_rows
from direct_frontend.simulator.model import Generation, StopCriteria
from direct_frontend.text.model_dir import TextModel
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine
from tests.support.http import http, sdk_http

KINDS = ["sglang", "vllm", "trtllm"]
SIM = {"eos_probability": 0.0}
CHAT = [{"role": "user", "content": "Say something about the sea."}]
PROMPT = [5, 77, 300, 41, 9, 120]  # token ids: the test knows the engine's exact prompt


@pytest.fixture(scope="module", params=KINDS)
def daemon(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    names = "ab"
    text = fleet_text(model_dir, [sim_engine(n, request.param, **SIM) for n in names],
                      probe="interval_s = 0.1\ntimeout_s = 1.0")
    with running_daemon(tmp_path_factory.mktemp("logprobs"), text) as running:
        running.wait_serving(len(names))
        yield running


@pytest.fixture(scope="module")
def text_model(model_dir: Path) -> TextModel:
    return TextModel.load(model_dir)


def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="-", max_retries=0,
                         http_client=sdk_http())


def engine_rows(daemon: Daemon, prompt: list[int], tokens: int) -> list[Any]:
    """What the simulated engines generate after ``prompt``: (token, logprob, ranked) rows."""
    sim = next(iter(daemon.supervisor.simulators.values()))
    generation = Generation(sim.core.model, prompt, StopCriteria(max_tokens=tokens))
    output = generation.run()
    rows = output_rows(generation.states, output, sim.core.config.vocab_size)
    return [(t, value, ranked) for t, (value, ranked) in zip(output, rows, strict=True)]


def kind_of(daemon: Daemon) -> str:
    return str(next(iter(daemon.supervisor.simulators.values())).core.config.kind)


def chat_entries(chunks: Any) -> tuple[str, list[Any]]:
    text, entries = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs is not None and choice.logprobs.content:
                entries.extend(choice.logprobs.content)
    return "".join(text), entries


def check_chat_entries(entries: list[Any], top: int) -> None:
    """OpenAI's shape; alternatives sorted; the greedy token is its row's top."""
    for entry in entries:
        assert isinstance(entry.token, str) and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == top
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == entry.logprob
            assert entry.top_logprobs[0].bytes == entry.bytes


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_the_openai_shape_streaming_or_not(
    daemon: Daemon, stream: bool
) -> None:
    api = client(daemon)
    kwargs: dict[str, Any] = {"model": "demo", "messages": CHAT, "max_tokens": 24,
                              "logprobs": True, "top_logprobs": 3}
    full = api.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 24 == full.usage.completion_tokens  # type: ignore[union-attr]
    check_chat_entries(entries, 3)
    # the tokens' bytes are the text, even where a token holds part of a character
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content
    if stream:
        text, streamed = chat_entries(api.chat.completions.create(**kwargs, stream=True))
        assert text == choice.message.content
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]


def test_chat_without_logprobs_has_none(daemon: Daemon) -> None:
    full = client(daemon).chat.completions.create(model="demo", messages=CHAT, max_tokens=4)
    assert full.choices[0].logprobs is None
    entries = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=4, logprobs=True
    ).choices[0].logprobs
    assert entries is not None and entries.content is not None
    assert all(e.top_logprobs == [] for e in entries.content)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_engines_values(
    daemon: Daemon, text_model: TextModel, stream: bool
) -> None:
    rows = engine_rows(daemon, PROMPT, 16)
    response: Any = client(daemon).completions.create(
        model="demo", prompt=PROMPT, max_tokens=16, logprobs=2, stream=stream
    )
    if stream:
        text, tokens, values, tops, offsets = "", [], [], [], []
        for chunk in response:
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    else:
        choice = response.choices[0]
        text, logprobs = choice.text, choice.logprobs
        tokens, values = logprobs.tokens, logprobs.token_logprobs
        tops, offsets = logprobs.top_logprobs, logprobs.text_offset
    names = text_model.token_bytes.completion_token
    assert tokens == [names(t) for t, _, _ in rows]
    assert values == [value for _, value, _ in rows]  # exactly what the engine sent
    for top, (token, value, ranked) in zip(tops, rows, strict=True):
        # the top 2 and the sampled token (here the first of them): OpenAI's "logprobs + 1"
        assert top == {names(t): v for t, v in ranked[:2]}
        assert top[names(token)] == value
    starts = [len(text_model.decode(list(t for t, _, _ in rows[:i]))) for i in range(16)]
    assert offsets == starts
    assert text == text_model.decode([t for t, _, _ in rows])


def test_echo_with_logprobs_leads_with_the_prompt(daemon: Daemon, text_model: TextModel) -> None:
    api = client(daemon)
    if kind_of(daemon) == "trtllm":
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model="demo", prompt=PROMPT, max_tokens=4, logprobs=1,
                                   echo=True)
        assert refused.value.body["param"] == "echo"  # type: ignore[index]
        assert "tensorrt" in str(refused.value).lower() or "trtllm" in str(refused.value)
        echoed = api.completions.create(model="demo", prompt=PROMPT, max_tokens=4, echo=True)
        assert echoed.choices[0].text.startswith(text_model.decode(PROMPT))
        return
    sim = next(iter(daemon.supervisor.simulators.values()))
    expected_prompt = prompt_rows(sim.core.model, PROMPT, sim.core.config.vocab_size)
    rows = engine_rows(daemon, PROMPT, 4)
    for stream in (False, True):
        response: Any = api.completions.create(
            model="demo", prompt=PROMPT, max_tokens=4, logprobs=1, echo=True, stream=stream
        )
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks)
        values = [v for c in chunks if c.choices[0].logprobs
                  for v in c.choices[0].logprobs.token_logprobs]
        offsets = [o for c in chunks if c.choices[0].logprobs
                   for o in c.choices[0].logprobs.text_offset]
        prompt_text = text_model.decode(PROMPT)
        assert text == prompt_text + text_model.decode([t for t, _, _ in rows])
        assert values[0] is None  # the first prompt token has no logprob
        assert values[1:len(PROMPT)] == [r[0] for r in expected_prompt[1:]]  # type: ignore[index]
        assert values[len(PROMPT):] == [value for _, value, _ in rows]
        assert offsets[len(PROMPT)] == len(prompt_text)  # the output starts after the echo


def test_an_echo_of_no_tokens_is_the_prompt_alone_scored(
    daemon: Daemon, text_model: TextModel
) -> None:
    """``max_tokens`` 0 with ``echo``: what scoring tools send (OpenAI's legacy API)."""
    api = client(daemon)
    if kind_of(daemon) == "trtllm":
        echoed = api.completions.create(model="demo", prompt=PROMPT, max_tokens=0, echo=True)
        assert echoed.choices[0].text == text_model.decode(PROMPT)
        return
    sim = next(iter(daemon.supervisor.simulators.values()))
    expected = prompt_rows(sim.core.model, PROMPT, sim.core.config.vocab_size)
    second = [PROMPT[0], *PROMPT[2:]]
    for stream in (False, True):
        response: Any = api.completions.create(
            model="demo", prompt=[PROMPT, second], max_tokens=0, logprobs=1, echo=True,
            stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        chunks = list(response) if stream else [response]
        first = [c for chunk in chunks for c in chunk.choices if c.index == 0]
        assert "".join(c.text for c in first) == text_model.decode(PROMPT)
        values = [v for c in first if c.logprobs for v in c.logprobs.token_logprobs]
        assert values == [None, *(r[0] for r in expected[1:])]  # type: ignore[index]
        assert [c.finish_reason for c in first if c.finish_reason] == ["length"]
        other = "".join(c.text for chunk in chunks for c in chunk.choices if c.index == 1)
        assert other == text_model.decode(second)
        usage = next(chunk.usage for chunk in chunks if chunk.usage is not None)
        assert (usage.prompt_tokens, usage.completion_tokens) == (2 * len(PROMPT) - 1, 0)


def test_stop_strings_keep_logprobs_aligned_with_the_text(daemon: Daemon) -> None:
    api = client(daemon)
    base: dict[str, Any] = {"model": "demo", "messages": CHAT, "max_tokens": 40,
                            "logprobs": True, "top_logprobs": 1}
    reference = api.chat.completions.create(**base).choices[0]
    text = reference.message.content or ""
    stop = text[len(text) // 2: len(text) // 2 + 3]
    for stream in (False, True):
        if stream:
            cut, entries = chat_entries(api.chat.completions.create(**base, stop=stop,
                                                                    stream=True))
        else:
            choice = api.chat.completions.create(**base, stop=stop).choices[0]
            cut = choice.message.content or ""
            entries = choice.logprobs.content if choice.logprobs else []  # type: ignore[assignment]
        assert cut == text[: text.index(stop)]
        spelled = b"".join(bytes(e.bytes) for e in entries)
        before_last = b"".join(bytes(e.bytes) for e in entries[:-1])
        # every emitted token's text starts before the cut, and every token before it is out
        assert spelled.startswith(cut.encode()) and len(before_last) < len(cut.encode())
        assert [e.model_dump() for e in entries] == [
            e.model_dump() for e in (reference.logprobs.content or [])[: len(entries)]  # type: ignore[union-attr]
        ]


def test_a_migrated_stream_keeps_its_logprobs_exact(daemon: Daemon) -> None:
    api = client(daemon)
    kwargs: dict[str, Any] = {"model": "demo", "messages": CHAT, "max_tokens": 40,
                              "logprobs": True, "top_logprobs": 2, "stream": True}
    text, expected = chat_entries(api.chat.completions.create(**kwargs))
    sims = daemon.supervisor.simulators
    for sim in sims.values():  # whichever engine the stream lands on dies after 13 tokens
        sim.faults = dataclasses.replace(FaultPlan(die_after_tokens=13, only_request=1))
    try:
        again, entries = chat_entries(api.chat.completions.create(**kwargs))
    finally:
        daemon.wait_serving(len(sims), timeout=15)
    assert any(s.fault_stats.died for s in sims.values())
    metrics = http.get(daemon.url + "/metrics").text
    assert 'outcome="migrated"' in metrics
    assert again == text
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in expected]


def test_a_mixed_fleet_sends_prompt_logprobs_only_where_they_come_back(
    model_dir: Path, tmp_path: Path
) -> None:
    engines = [sim_engine("t", "trtllm", **SIM), sim_engine("v", "vllm", **SIM)]
    with running_daemon(tmp_path, fleet_text(model_dir, engines)) as daemon:
        daemon.wait_serving(2)
        api = client(daemon)
        for _ in range(4):  # round robin would reach the TensorRT-LLM engine
            r = api.completions.create(model="demo", prompt=PROMPT, max_tokens=2, logprobs=1,
                                       echo=True)
            assert r.choices[0].logprobs is not None
            assert r.choices[0].logprobs.token_logprobs[0] is None
        sims = daemon.supervisor.simulators
        assert sims["t"].stats.requests == 0 and sims["v"].stats.requests == 4
        for _ in range(2):  # without echo both serve
            api.completions.create(model="demo", prompt=PROMPT, max_tokens=2, logprobs=1)
        assert sims["t"].stats.requests == 1
