"""Several choices (``n > 1``) end to end, through the real daemon and the official client.

Each choice is its own engine call sampled with ``seed + i``; the simulator
(vLLM and TRT-LLM kinds carry a seed) is deterministic per seed, so choice
``i`` of a request must equal a lone request with seed ``seed + i``, token
for token, whatever happens to the other choices.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from grpclib import Status

from direct_frontend.simulator.faults import FaultPlan
from tests.support.daemon import (
    Daemon,
    fleet_text,
    in_flight,
    raw_post,
    raw_stream,
    running_daemon,
    sim_engine,
    wait_for,
)
from tests.support.http import http, sdk_http

CHAT = [{"role": "user", "content": "Tell me three stories."}]
PROMPT = "Once upon a time"
TOKENS = 40
SEED = 1234
SAMPLED = {"temperature": 0.8, "seed": SEED, "max_tokens": TOKENS}
PACED = {"decode_us_per_token": 300, "prefill_us_per_token": 0, "eos_probability": 0.0}


@contextlib.contextmanager
def fleet(model_dir: Path, tmp: Path, names: str = "abc", kind: str = "vllm",
          frontend_extra: str = "", **simulator: Any) -> Iterator[Daemon]:
    engines = [sim_engine(name, kind, **{**PACED, **simulator}) for name in names]
    text = fleet_text(model_dir, engines, probe="interval_s = 0.1\ntimeout_s = 1.0",
                      frontend_extra=frontend_extra)
    with running_daemon(tmp, text) as daemon:
        daemon.wait_serving(len(names))
        yield daemon


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with fleet(model_dir, tmp_path_factory.mktemp("choices")) as running:
        yield running


def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="-", max_retries=0,
                         http_client=sdk_http())


def lone_chat(daemon: Daemon, seed: int, **extra: Any) -> tuple[str, str | None]:
    """The text and finish reason of a lone request sampled with ``seed``."""
    fields = {**SAMPLED, "seed": seed, **extra}
    answer = client(daemon).chat.completions.create(model="demo", messages=CHAT, **fields)
    return answer.choices[0].message.content or "", answer.choices[0].finish_reason


def lone_texts(daemon: Daemon, n: int, **extra: Any) -> list[str]:
    return [lone_chat(daemon, SEED + i, **extra)[0] for i in range(n)]


def streamed_chat(daemon: Daemon, **fields: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    """Each choice's text and finish reason, and the usage, from a streamed chat request."""
    chunks = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, stream=True, stream_options={"include_usage": True},
        **fields,
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            assert usage is None and not chunk.choices  # one usage chunk, after every choice
            usage = chunk.usage
        for choice in chunk.choices:
            assert usage is None
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in finishes  # one finish per choice
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, usage


def prompt_tokens(daemon: Daemon) -> int:
    answer = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=1
    )
    assert answer.usage is not None
    return answer.usage.prompt_tokens


def test_three_chat_choices_in_one_body(daemon: Daemon) -> None:
    answer = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, n=3, **SAMPLED
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.message.content for c in answer.choices]
    assert len(set(texts)) == 3  # sampled with seeds 1234, 1235, 1236
    assert texts == lone_texts(daemon, 3)  # each is its seed's, reproducibly
    assert all(c.finish_reason == "length" for c in answer.choices)
    usage = answer.usage
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens(daemon)  # the prompt once
    assert usage.completion_tokens == 3 * TOKENS  # every choice's tokens
    assert usage.total_tokens == usage.prompt_tokens + 3 * TOKENS


def test_three_chat_choices_streamed(daemon: Daemon) -> None:
    texts, finishes, usage = streamed_chat(daemon, n=3, **SAMPLED)
    assert [texts[i] for i in range(3)] == lone_texts(daemon, 3)
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == prompt_tokens(daemon)
    assert usage.completion_tokens == 3 * TOKENS


def streamed_completion(api: openai.OpenAI, **fields: Any) -> tuple[dict[int, str], list[Any]]:
    """Each choice's text, and every usage chunk, of a streamed completions request."""
    texts: dict[int, str] = {}
    usages = []
    for chunk in api.completions.create(
        model="demo", stream=True, stream_options={"include_usage": True}, **fields
    ):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, usages


def test_three_completion_choices_streamed_and_not(daemon: Daemon) -> None:
    api = client(daemon)
    whole = api.completions.create(model="demo", prompt=PROMPT, n=3, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    lone = [
        api.completions.create(model="demo", prompt=PROMPT, **{**SAMPLED, "seed": SEED + i})
        for i in range(3)
    ]
    assert [c.text for c in whole.choices] == [a.choices[0].text for a in lone]
    assert whole.usage is not None and lone[0].usage is not None
    assert whole.usage.prompt_tokens == lone[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == 3 * TOKENS
    texts, usages = streamed_completion(api, prompt=PROMPT, n=3, **SAMPLED)
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert len(usages) == 1 and usages[0].completion_tokens == 3 * TOKENS


def test_the_stream_ends_once(daemon: Daemon) -> None:
    body = {"model": "demo", "messages": CHAT, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLED}
    raw = http.post(daemon.url + "/v1/chat/completions", json=body, timeout=30).text
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    # every choice announces its role first; the usage chunk is the last
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    assert all(c["choices"][0]["delta"].get("role") == "assistant" for c in chunks[:3])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3 * TOKENS
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_strings_apply_to_each_choice_alone(daemon: Daemon) -> None:
    references = lone_texts(daemon, 3)
    # a word of the middle choice's text: it stops there, the others where it appears in theirs
    word = re.findall(r"[a-z]{4,}", references[1])[2]
    expected = []
    for reference in references:
        cut = reference.find(word)
        expected.append((reference, "length") if cut < 0 else (reference[:cut], "stop"))
    answer = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, n=3, stop=[word], **SAMPLED
    )
    got = [(c.message.content, c.finish_reason) for c in answer.choices]
    assert got == expected
    assert got[1][1] == "stop"
    texts, finishes, _ = streamed_chat(daemon, n=3, stop=[word], **SAMPLED)
    assert [(texts[i], finishes[i]) for i in range(3)] == expected


def test_unseeded_choices_each_call_the_engine(daemon: Daemon) -> None:
    sims = daemon.supervisor.simulators.values()
    before = {rid for s in sims for rid in s.stats.request_ids}
    answer = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, n=4, max_tokens=5
    )
    assert len(answer.choices) == 4
    ids = {rid for s in sims for rid in s.stats.request_ids} - before
    assert sorted(rid.rsplit("-", 1)[1] for rid in ids) == ["0", "1", "2", "3"]
    assert len({rid.rsplit("-", 1)[0] for rid in ids}) == 1  # one request's choices


def test_one_choice_migrates_alone_and_exactly(model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path) as daemon:
        expected = lone_texts(daemon, 3)
        sims = daemon.supervisor.simulators
        # the round-robin policy places the three choices on the three engines
        sims["b"].faults = FaultPlan(die_after_tokens=17, only_request=1)
        texts, finishes, usage = streamed_chat(daemon, n=3, **SAMPLED)
        assert [texts[i] for i in range(3)] == expected
        assert finishes == {0: "length", 1: "length", 2: "length"}
        assert usage.completion_tokens == 3 * TOKENS  # the migrated choice's tokens once
        assert sims["b"].fault_stats.died
        resumed = [rid for s in sims.values() for rid in s.stats.request_ids if "~" in rid]
        assert len(resumed) == 1  # only the choice on b moved
        metrics = http.get(daemon.url + "/metrics").text
        migrated = re.findall(r'engine_requests_total\{[^}]*outcome="migrated"[^}]*\} (\S+)',
                              metrics)
        assert sum(float(v) for v in migrated) == 1


def test_a_choice_that_gives_up_fails_the_request(model_dir: Path, tmp_path: Path) -> None:
    no_migration = "[frontend.faults]\nmax_migrations = 0"
    with fleet(model_dir, tmp_path, names="a", frontend_extra=no_migration) as daemon:
        sim = daemon.supervisor.simulators["a"]
        # the second choice's call is refused as invalid: no retry can help
        sim.faults = FaultPlan(status=Status.INVALID_ARGUMENT, only_request=2)
        with pytest.raises(openai.BadRequestError):
            client(daemon).chat.completions.create(model="demo", messages=CHAT, n=3, **SAMPLED)
        wait_for(lambda: sim.stats.running == 0, what="the other choices to be aborted")
        # after the stream started, a choice that may not migrate ends it with an error event
        sim.faults = FaultPlan(status=Status.UNAVAILABLE, status_after_tokens=5, only_request=2)
        with pytest.raises(openai.APIError):
            streamed_chat(daemon, n=3, **SAMPLED)
        wait_for(lambda: sim.stats.running == 0, what="the other choices to be aborted")


def test_client_disconnect_aborts_every_choice(model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path, names="ab", decode_us_per_token=20000) as daemon:
        sims = daemon.supervisor.simulators.values()
        body = {"model": "demo", "messages": CHAT, "n": 3, "max_tokens": 1000, "stream": True}
        with raw_stream(daemon.url, body, events=6):
            wait_for(lambda: sum(s.stats.running for s in sims) == 3,
                     what="the engines to run every choice")
        wait_for(lambda: sum(s.stats.running for s in sims) == 0, what="every slot freed")
        wait_for(lambda: sum(s.stats.aborts_received for s in sims) == 3,
                 what="an Abort for every choice")
        aborted = sorted(rid for s in sims for rid in s.stats.abort_request_ids)
        # one Abort per choice of the one request, each naming its own engine call
        assert [rid.rsplit("-", 1)[1] for rid in aborted] == ["0", "1", "2"]
        assert len({rid.rsplit("-", 1)[0] for rid in aborted}) == 1


# -- a completions batch of prompts: n choices per prompt, numbered prompt by prompt

PROMPTS = ["Once upon a time", "The quick brown fox jumps", "In a hole in the ground"]


def test_a_batch_of_prompts_answers_as_each_prompt_alone(daemon: Daemon) -> None:
    api = client(daemon)
    lone = [api.completions.create(model="demo", prompt=p, n=2, **SAMPLED) for p in PROMPTS]
    expected = [c.text for answer in lone for c in answer.choices]
    assert len(set(expected[::2])) == len(PROMPTS)  # the prompts' answers differ
    whole = api.completions.create(model="demo", prompt=PROMPTS, n=2, **SAMPLED)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == expected
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in lone if a.usage)
    assert whole.usage.completion_tokens == 6 * TOKENS
    texts, usages = streamed_completion(api, prompt=PROMPTS, n=2, **SAMPLED)
    assert [texts[i] for i in range(6)] == expected
    assert len(usages) == 1 and usages[0].prompt_tokens == whole.usage.prompt_tokens
    assert usages[0].completion_tokens == 6 * TOKENS


def test_a_batch_of_token_prompts_echoes_each_with_its_logprobs(daemon: Daemon) -> None:
    """What evaluation harnesses send (lm-eval's loglikelihood): token ids, echo, logprobs."""
    api = client(daemon)
    prompts = [[11, 12, 13, 14], [21, 22], [31, 32, 33]]
    fields: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    lone = [api.completions.create(model="demo", prompt=p, **fields).choices[0] for p in prompts]
    for stream in (False, True):
        response: Any = api.completions.create(model="demo", prompt=prompts, stream=stream,
                                               **fields)
        chunks = list(response) if stream else [response]
        got: dict[int, tuple[str, list[Any]]] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                text, values = got.get(choice.index, ("", []))
                logprobs = choice.logprobs.token_logprobs if choice.logprobs else []
                got[choice.index] = (text + choice.text, values + list(logprobs))
        assert sorted(got) == [0, 1, 2]
        for index, reference in enumerate(lone):
            assert reference.logprobs is not None
            text, values = got[index]
            assert text == reference.text
            assert values == reference.logprobs.token_logprobs
            assert values[0] is None and len(values) == len(prompts[index]) + 1


def test_a_bad_prompt_in_a_batch_is_named(daemon: Daemon) -> None:
    body = {"model": "demo", "prompt": [[1, 2], [3, 10**6]], "max_tokens": 2}
    reply = http.post(daemon.url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt[1]"


def test_no_more_choices_run_at_once_than_the_slots_held(model_dir: Path, tmp_path: Path) -> None:
    """One admission slot: the first prompt's call hangs on the engine, so no other starts."""
    with fleet(model_dir, tmp_path, names="a",
               frontend_extra="[frontend.limits]\nmax_in_flight = 1") as daemon:
        sim = daemon.supervisor.simulators["a"]
        sim.faults = FaultPlan(hang_after_tokens=0, only_request=1)
        with raw_post(daemon.url, "/v1/completions",
                      {"model": "demo", "prompt": PROMPTS, "max_tokens": 4}):
            wait_for(lambda: bool(sim.fault_stats.hung), what="the first prompt's call to hang")
        # the client left: the hung call is cancelled, and no other prompt ever started
        wait_for(lambda: in_flight(daemon) == 0, what="the request to end")
        assert sim.fault_stats.generate_calls == 1
