"""Structured outputs and every sampling field, through the real daemon to simulated engines.

The simulator writes text that satisfies the constraint it receives
(simulator/constraints.py), so output that validates proves the constraint
reached the engine in its contract's shape and came back intact; what each
engine received is read from its own record of the request.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from google.protobuf.json_format import MessageToDict

from direct_frontend.simulator.faults import FaultPlan
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine
from tests.support.http import http, sdk_http

KINDS = ["sglang", "vllm", "trtllm"]
CHAT = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1},
        "code": {"type": "string", "pattern": "[A-Z]{2}[0-9]{3}"},
    },
    "required": ["name", "age", "tags", "code"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                          "strict": True}}
QUIET = {"eos_probability": 0.0}


@pytest.fixture(scope="module", params=KINDS)
def daemon(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("a", request.param, **QUIET)])
    with running_daemon(tmp_path_factory.mktemp(request.param), text) as running:
        running.wait_serving(1)
        yield running


def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="-", max_retries=0,
                         http_client=sdk_http())


def chat_text(daemon: Daemon, stream: bool, **kwargs: Any) -> str:
    api = client(daemon)
    if not stream:
        reply = api.chat.completions.create(model="demo", messages=CHAT, max_tokens=300, **kwargs)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""
    chunks = api.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=300, stream=True, **kwargs
    )
    return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)


def last_request(daemon: Daemon) -> dict[str, Any]:
    """What the fleet's one engine last received, as its contract's JSON."""
    sim = daemon.supervisor.simulators["a"]
    message = list(sim.stats.received.values())[-1]
    return MessageToDict(message, preserving_proto_field_name=True)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(daemon: Daemon, stream: bool) -> None:
    text = chat_text(daemon, stream, response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_json_mode_gives_a_json_object(daemon: Daemon, stream: bool) -> None:
    text = chat_text(daemon, stream, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_constraints_hold(daemon: Daemon, stream: bool) -> None:
    pattern = r"[a-z]{4,8}-[0-9]{2}(x|yz)"
    text = chat_text(daemon, stream, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, text)
    choices = ["north (up)", "south", "a.b|c"]
    assert chat_text(daemon, stream, extra_body={"guided_choice": choices}) in choices


def test_completions_take_constraints_too(daemon: Daemon) -> None:
    reply = client(daemon).completions.create(
        model="demo", prompt="A person:", max_tokens=300,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)


def test_a_malformed_constraint_is_a_400_naming_the_field(daemon: Daemon) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat_text(daemon, False, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": 3}})
    assert info.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    # a regex the engine cannot compile: the engine's refusal is a 400 naming the field
    with pytest.raises(openai.BadRequestError) as info:
        chat_text(daemon, False, extra_body={"guided_regex": "(unclosed"})
    assert info.value.body["param"] == "guided_regex"  # type: ignore[index]


#: every sampling field, with values unlike the defaults
EVERY_FIELD: dict[str, Any] = {
    "temperature": 0.5, "top_p": 0.75, "frequency_penalty": 0.25, "presence_penalty": 0.5,
    "max_completion_tokens": 9, "user": "someone", "metadata": {"team": "a"},
    "stream_options": {"include_usage": True},
}
EXTRA: dict[str, Any] = {
    "top_k": 7, "min_p": 0.125, "repetition_penalty": 1.25, "stop_token_ids": [5, 6],
    "ignore_eos": True, "min_tokens": 3, "skip_special_tokens": False,
}


def test_every_sampling_field_reaches_the_engine(daemon: Daemon) -> None:
    kind = daemon.supervisor.children["a"].cfg.kind
    fields = dict(EVERY_FIELD)
    if kind != "sglang":  # SGLang's contract carries no seed (see the routing test)
        fields["seed"] = 1234
    if kind != "trtllm":  # TensorRT-LLM's carries no logit bias
        fields["logit_bias"] = {"42": -100, "7": 2.5}
    chunks = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, stream=True, extra_body=EXTRA, **fields
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 9
    got = last_request(daemon)
    if kind == "trtllm":
        config = got["sampling_config"]
        assert got["max_tokens"] == 9 and got["stop_token_ids"] == [5, 6] and got["ignore_eos"]
        assert config["temperature"] == 0.5 and config["top_p"] == 0.75
        assert config["top_k"] == 7 and config["min_p"] == 0.125 and config["min_tokens"] == 3
        assert config["repetition_penalty"] == 1.25 and config["seed"] == "1234"
        assert config["frequency_penalty"] == 0.25 and config["presence_penalty"] == 0.5
        return
    params = got["sampling_params"]
    assert params["temperature"] == 0.5 and params["top_p"] == 0.75 and params["top_k"] == 7
    assert params["min_p"] == 0.125 and params["repetition_penalty"] == 1.25
    assert params["frequency_penalty"] == 0.25 and params["presence_penalty"] == 0.5
    assert params["stop_token_ids"] == [5, 6] and params["ignore_eos"]
    assert params["logit_bias"] == {"7": 2.5, "42": -100.0}
    assert "skip_special_tokens" not in params  # False on the wire
    if kind == "sglang":
        assert params["max_new_tokens"] == 9 and params["min_new_tokens"] == 3
    else:
        assert params["max_tokens"] == 9 and params["min_tokens"] == 3 and params["seed"] == 1234


def test_usage_on_every_chunk_with_continuous_usage_stats(daemon: Daemon) -> None:
    chunks = list(client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    ))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content and all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content if c.usage is not None]
    assert counts == sorted(counts) and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_continuous_usage_stats_with_several_choices(daemon: Daemon) -> None:
    chunks = list(client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=4, stream=True, n=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    ))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert {c.choices[0].index for c in content} == {0, 1}
    assert all(c.usage is not None for c in content)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_constrained_choices_each_satisfy_the_constraint(daemon: Daemon) -> None:
    reply = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=300, n=3, response_format=RESPONSE_FORMAT,
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


# -- which engine can carry a request ----------------------------------------------------


def test_routing_sends_each_request_to_a_kind_that_carries_it(
    model_dir: Path, tmp_path: Path
) -> None:
    text = fleet_text(model_dir, [sim_engine("s", "sglang", **QUIET),
                                  sim_engine("t", "trtllm", **QUIET)])
    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(2)
        api = client(daemon)
        sims = daemon.supervisor.simulators
        for _ in range(4):  # round robin would reach both kinds
            api.chat.completions.create(model="demo", messages=CHAT, max_tokens=2, seed=5)
            api.chat.completions.create(
                model="demo", messages=CHAT, max_tokens=2, logit_bias={"3": 1}
            )
        seeded = [r for r in sims["t"].stats.received.values() if r.sampling_config.seed == 5]
        biased = [r for r in sims["s"].stats.received.values() if r.sampling_params.logit_bias]
        assert len(seeded) == 4 and len(biased) == 4
        assert len(sims["s"].stats.received) == len(sims["t"].stats.received) == 4
        # both at once: no engine of this fleet carries the pair
        r = http.post(daemon.url + "/v1/chat/completions", json={
            "model": "demo", "messages": CHAT, "seed": 5, "logit_bias": {"3": 1},
        })
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("seed", "logit_bias")


def test_a_seed_no_serving_engine_can_carry_is_a_400(model_dir: Path, tmp_path: Path) -> None:
    text = fleet_text(model_dir, [sim_engine("s", "sglang", **QUIET)])
    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(1)
        r = http.post(daemon.url + "/v1/chat/completions",
                       json={"model": "demo", "messages": CHAT, "seed": 5})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "seed" and "sglang" in error["message"]
        assert not daemon.supervisor.simulators["s"].stats.received


# -- failures ---------------------------------------------------------------------------


def test_a_constrained_stream_never_continues_unconstrained(
    model_dir: Path, tmp_path: Path
) -> None:
    """A sampled one (temperature 1) whose engine dies mid-stream ends with an error.

    Another engine would not repeat its tokens, so it is neither continued
    unconstrained nor replayed.
    """
    paced = {"decode_us_per_token": 300, "prefill_us_per_token": 0, "eos_probability": 0.0}
    text = fleet_text(model_dir, [sim_engine(n, "vllm", **paced) for n in "ab"],
                      probe="interval_s = 0.1\ntimeout_s = 1.0")
    pattern = "[a-z]{120}"
    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(2)
        whole = chat_text(daemon, True, extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, whole)
        sims = daemon.supervisor.simulators
        for sim in sims.values():
            sim.faults = dataclasses.replace(FaultPlan(die_after_tokens=8, only_request=1))
        received: list[str] = []
        with pytest.raises(openai.APIError):
            chunks = client(daemon).chat.completions.create(
                model="demo", messages=CHAT, max_tokens=300, stream=True,
                extra_body={"guided_regex": pattern},
            )
            for chunk in chunks:
                received.extend(c.delta.content or "" for c in chunk.choices)
        partial = "".join(received)
        assert partial and whole.startswith(partial) and len(partial) < len(whole)
        # no continuation was sent anywhere (a migrated call's id ends in "~<attempt>")
        assert not any("~" in rid for sim in sims.values() for rid in sim.stats.received)
        body = http.get(daemon.url + "/metrics").text
        assert 'direct_frontend_migrations_refused_total{reason="constraint"} 1.0' in body


def test_a_deterministic_constrained_stream_is_replayed_elsewhere_token_exactly(
    model_dir: Path, tmp_path: Path
) -> None:
    """Temperature 0: another engine regenerates it under the constraint; nothing repeats.

    Both engines die 8 tokens into their next request, so the first replay dies
    too (before it has repeated what was streamed) and a second one finishes.
    """
    paced = {"decode_us_per_token": 300, "prefill_us_per_token": 0, "eos_probability": 0.0}
    text = fleet_text(model_dir, [sim_engine(n, "vllm", **paced) for n in "ab"],
                      probe="interval_s = 0.1\ntimeout_s = 1.0")
    pattern = "[a-z]{120}"
    constrained: dict[str, Any] = {
        "model": "demo", "messages": CHAT, "max_tokens": 300, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0,
        "extra_body": {"guided_regex": pattern},
    }

    def streamed(daemon: Daemon) -> tuple[str, Any]:
        chunks = list(client(daemon).chat.completions.create(**constrained))
        return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices), \
            chunks[-1].usage

    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(2)
        whole, whole_usage = streamed(daemon)
        assert re.fullmatch(pattern, whole)
        sims = daemon.supervisor.simulators
        prompt = next(list(r.tokenized.input_ids) for sim in sims.values()
                      for r in sim.stats.received.values())
        for sim in sims.values():
            sim.faults = dataclasses.replace(FaultPlan(die_after_tokens=8, only_request=1))
        text_out, usage = streamed(daemon)
        assert text_out == whole  # every character once, in order, under the constraint
        assert usage.completion_tokens == whole_usage.completion_tokens
        replays = [r for sim in sims.values() for rid, r in sim.stats.received.items()
                   if "~" in rid]
        assert len(replays) == 2
        for replay in replays:  # the client's own prompt and budget again, not prompt + output
            assert list(replay.tokenized.input_ids) == prompt
            assert replay.sampling_params.max_tokens == 300
            assert replay.sampling_params.regex == pattern
        body = http.get(daemon.url + "/metrics").text
        assert "direct_frontend_migrations_refused_total{" not in body


def test_continuous_usage_stats_with_logprobs(daemon: Daemon) -> None:
    chunks = list(client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=5, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    ))
    content = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert content and all(c.usage is not None for c in content)
    positions = [p for c in content for p in (c.choices[0].logprobs.content or [])]  # type: ignore[union-attr]
    assert len(positions) == 5 and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
