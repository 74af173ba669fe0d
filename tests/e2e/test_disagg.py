"""Disaggregated serving end to end: prefill and decode engines of SGLang and vLLM.

The daemon runs in-process on loopback (tests/support/daemon.py) with simulated
engines whose roles are set in the fleet file; the simulator is deterministic
from its token prefix, so a disaggregated request must give exactly the text
and usage an aggregated engine gives. Each engine's stats show what its leg
carried (simulator/disagg.py): SGLang's rendezvous, vLLM's
``kv_transfer_params_json`` in and out.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from grpclib import Status
from openai.types.chat import ChatCompletionMessageParam

from direct_frontend.engines.dialects.sglang import ROOM_LIMIT
from direct_frontend.engines.dialects.vllm import PREFILL_PARAMS
from direct_frontend.simulator.faults import FaultPlan
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine, wait_for
from tests.support.http import http, sdk_http

KINDS = ["sglang", "vllm"]
FAST = {"decode_us_per_token": 0, "prefill_us_per_token": 0, "eos_probability": 0.0}
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a long story about the sea."}
]
TOKENS = 40


def role(name: str, kind: str, which: str, **simulator: Any) -> dict[str, Any]:
    return {**sim_engine(name, kind, **{**FAST, **simulator}), "role": which}


@contextlib.contextmanager
def fleet(model_dir: Path, tmp: Path, engines: list[dict[str, Any]]) -> Iterator[Daemon]:
    text = fleet_text(model_dir, engines, probe="interval_s = 0.1\ntimeout_s = 1.0")
    with running_daemon(tmp, text) as daemon:
        daemon.wait_serving(len(engines))
        yield daemon


def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="-", max_retries=0,
                         http_client=sdk_http())


def streamed(daemon: Daemon) -> tuple[str, Any]:
    chunks = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=TOKENS, stream=True,
        stream_options={"include_usage": True},
    )
    text: list[str] = []
    usage: Any = None
    for chunk in chunks:
        usage = chunk.usage or usage
        text.extend(c.delta.content or "" for c in chunk.choices)
    return "".join(text), usage


def whole(daemon: Daemon) -> tuple[str, Any]:
    reply = client(daemon).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=TOKENS,
    )
    return reply.choices[0].message.content or "", reply.usage


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """What one aggregated engine answers (every kind answers the same, test_e2e_mixed)."""
    with fleet(model_dir, tmp_path_factory.mktemp("aggregated"),
               [sim_engine("agg", "sglang", **FAST)]) as daemon:
        text, usage = streamed(daemon)
        assert whole(daemon)[0] == text
    assert usage.completion_tokens == TOKENS
    return text, usage


@pytest.fixture(scope="module", params=KINDS)
def pd(request: pytest.FixtureRequest, model_dir: Path,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Two prefill engines and one decode engine of one kind."""
    kind = request.param
    engines = [role("p1", kind, "prefill"), role("p2", kind, "prefill"), role("d", kind, "decode")]
    with fleet(model_dir, tmp_path_factory.mktemp(f"pd-{kind}"), engines) as daemon:
        yield daemon


@pytest.fixture()
def sims(pd: Daemon) -> Iterator[dict[str, Any]]:
    engines = pd.supervisor.simulators
    yield engines
    for sim in engines.values():
        sim.faults = FaultPlan()
    pd.wait_serving(3)


def kind_of(daemon: Daemon) -> str:
    return str(daemon.fleet.engines[0].kind)


def new_params(sim: Any, before: set[str]) -> dict[str, str]:
    return {k: v for k, v in sim.stats.kv_params_received.items() if k not in before}


def open_stream(daemon: Daemon) -> socket.socket:
    """A streaming chat request on a raw socket, so the test can vanish mid-request."""
    host, port = daemon.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "demo", "messages": CHAT, "max_tokens": TOKENS,
                       "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


# -- the happy path -------------------------------------------------------------------


def test_pd_text_and_usage_equal_the_aggregated_reference(
    pd: Daemon, sims: dict[str, Any], reference: tuple[str, Any]
) -> None:
    expected, usage = reference
    for ask in (streamed, whole):
        before = {name: set(sim.stats.kv_params_received) for name, sim in sims.items()}
        text, got = ask(pd)
        assert text == expected
        assert (got.prompt_tokens, got.completion_tokens) == (
            usage.prompt_tokens, usage.completion_tokens
        )
        # the decode engine reports the prompt it received by transfer as cached
        assert got.prompt_tokens_details.cached_tokens == got.prompt_tokens
        decode = new_params(sims["d"], before["d"])
        prefill = {**new_params(sims["p1"], before["p1"]), **new_params(sims["p2"], before["p2"])}
        assert len(decode) == 1 and decode.keys() == prefill.keys()  # one leg each, same id
        rid = next(iter(decode))
        if kind_of(pd) == "sglang":
            rendezvous = json.loads(decode[rid])
            assert json.loads(prefill[rid]) == rendezvous
            assert rendezvous["bootstrap_host"] == "127.0.0.1"
            assert rendezvous["bootstrap_port"] == 8998  # discovered from the prefill engine
            assert 0 <= rendezvous["bootstrap_room"] < ROOM_LIMIT
        else:
            assert prefill[rid] == PREFILL_PARAMS
            source = sims["p1"] if rid in sims["p1"].stats.kv_params_returned else sims["p2"]
            handoff = source.stats.kv_params_returned[rid]
            assert decode[rid] == handoff  # relayed verbatim
            assert json.loads(handoff)["remote_engine_id"] == source.config.kv_engine_id


def test_a_constraint_rides_on_the_decode_leg(pd: Daemon, sims: dict[str, Any]) -> None:
    """The decode leg's output is the client's: it carries the constraint (and satisfies it)."""
    pattern = "[a-z]{5}-[0-9]{3}"
    reply = client(pd).chat.completions.create(
        model="demo", messages=CHAT, max_tokens=TOKENS, extra_body={"guided_regex": pattern},
    )
    assert re.fullmatch(pattern, reply.choices[0].message.content or "")
    rid = list(sims["d"].stats.received)[-1]
    decode = sims["d"].stats.received[rid].sampling_params
    assert decode.regex == pattern
    prefill = next(s.stats.received[rid] for s in (sims["p1"], sims["p2"])
                   if rid in s.stats.received).sampling_params
    # vLLM's prefill leg's one token is discarded, so it compiles no grammar; SGLang sends
    # one request to both legs
    assert prefill.regex == ("" if kind_of(pd) == "vllm" else pattern)


def test_pairs_rotate_over_the_prefill_engines(pd: Daemon, sims: dict[str, Any]) -> None:
    before = {name: sim.stats.requests for name, sim in sims.items()}
    for _ in range(4):
        streamed(pd)
    assert {name: sim.stats.requests - before[name] for name, sim in sims.items()} == {
        "p1": 2, "p2": 2, "d": 4
    }


# -- failures -------------------------------------------------------------------------


def test_a_prefill_failure_before_the_first_token_retries_the_pair(
    pd: Daemon, sims: dict[str, Any], reference: tuple[str, Any]
) -> None:
    before = len(sims["p1"].fault_stats.failed)
    sims["p1"].faults = FaultPlan(status=Status.RESOURCE_EXHAUSTED, only_request=1)
    for _ in range(2):  # round robin reaches p1 within two requests
        assert streamed(pd)[0] == reference[0]
    [failed] = sims["p1"].fault_stats.failed[before:]
    assert f"{failed}~1" in sims["p2"].stats.request_ids  # the retry paired with p2
    assert f"{failed}~1" in sims["d"].stats.request_ids
    if kind_of(pd) == "sglang":  # the parallel decode leg was cancelled with an Abort
        wait_for(lambda: failed in sims["d"].stats.abort_request_ids, what="the decode abort")
    else:  # sequential: the decode leg never started
        assert failed not in sims["d"].stats.request_ids


def test_a_prefill_error_gives_a_clean_error_and_cancels_the_decode_leg(
    pd: Daemon, sims: dict[str, Any]
) -> None:
    before = {name: len(sims[name].fault_stats.failed) for name in ("p1", "p2")}
    for name in ("p1", "p2"):
        sims[name].faults = FaultPlan(status=Status.INTERNAL, status_message="boom",
                                      only_request=1)
    reply = http.post(pd.url + "/v1/chat/completions", json={
        "model": "demo", "messages": CHAT, "max_tokens": TOKENS, "stream": True,
    })
    assert reply.status_code == 500 and reply.json()["error"]["type"]
    [failed] = [rid for name in ("p1", "p2")
                for rid in sims[name].fault_stats.failed[before[name]:]]
    if kind_of(pd) == "sglang":
        wait_for(lambda: failed in sims["d"].stats.abort_request_ids, what="the decode abort")
    else:
        assert failed not in sims["d"].stats.request_ids


def test_client_leaving_between_the_phases_aborts_both_legs(
    pd: Daemon, sims: dict[str, Any]
) -> None:
    # The prefill leg ends; the decode leg has the request but produces nothing yet.
    hung = sims["d"].fault_stats.hung
    before = len(hung)
    sims["d"].faults = FaultPlan(hang_after_tokens=0)
    with open_stream(pd):
        wait_for(lambda: len(hung) == before + 1, what="the decode leg to hang")
        rid = hung[-1]
        prefill = sims["p1"] if rid in sims["p1"].stats.request_ids else sims["p2"]
        wait_for(lambda: prefill.stats.completed >= 1 and prefill.stats.running == 0,
                 what="the prefill leg to end")
    wait_for(lambda: rid in sims["d"].stats.abort_request_ids, what="the decode abort")
    # its KV was never taken by a decode leg: not left stranded on the prefill engine
    wait_for(lambda: rid in prefill.stats.abort_request_ids, what="the prefill abort")
    wait_for(lambda: sims["d"].stats.running == 0, what="the decode slot to be freed")


@pytest.mark.parametrize("kind", KINDS)
def test_client_leaving_during_the_prefill_aborts_every_leg_started(
    kind: str, model_dir: Path, tmp_path: Path
) -> None:
    # seconds of prefill for the prompt; an SGLang health probe (one token) still takes 0.1 s
    engines = [role("p", kind, "prefill", prefill_us_per_token=100_000), role("d", kind, "decode")]
    with fleet(model_dir, tmp_path, engines) as daemon:
        sims = daemon.supervisor.simulators
        with open_stream(daemon):
            wait_for(lambda: sims["p"].stats.running == 1, what="the prefill leg to run")
            [rid] = sims["p"].stats.request_ids
            if kind == "sglang":  # parallel: the decode leg is waiting for the KV
                wait_for(lambda: rid in sims["d"].stats.request_ids, what="the decode leg")
        wait_for(lambda: rid in sims["p"].stats.abort_request_ids, what="the prefill abort")
        wait_for(lambda: sims["p"].stats.running == 0, what="the prefill slot to be freed")
        if kind == "sglang":
            wait_for(lambda: rid in sims["d"].stats.abort_request_ids, what="the decode abort")
        else:
            assert sims["d"].stats.request_ids == []  # never started


@pytest.mark.parametrize("kind", KINDS)
def test_a_decode_engine_dying_mid_stream_migrates_to_a_new_pair(
    kind: str, model_dir: Path, tmp_path: Path, reference: tuple[str, Any]
) -> None:
    engines = [role("p", kind, "prefill"), role("d1", kind, "decode"),
               role("d2", kind, "decode")]
    with fleet(model_dir, tmp_path, engines) as daemon:
        sims = daemon.supervisor.simulators
        sims["d1"].faults = FaultPlan(die_after_tokens=15, only_request=1)
        for _ in range(2):  # round robin reaches d1 within two requests
            text, usage = streamed(daemon)
            assert text == reference[0] and usage.completion_tokens == TOKENS
        [died] = sims["d1"].fault_stats.died
        # the continuation prefilled prompt + 15 tokens on p, then decoded on d2
        assert f"{died}~1" in sims["p"].stats.request_ids
        assert f"{died}~1" in sims["d2"].stats.request_ids


def test_trtllm_serves_aggregated_beside_a_pair_and_never_gets_a_leg(
    model_dir: Path, tmp_path: Path, reference: tuple[str, Any]
) -> None:
    engines = [role("p", "sglang", "prefill"), role("d", "sglang", "decode"),
               sim_engine("t", "trtllm", **FAST)]
    with fleet(model_dir, tmp_path, engines) as daemon:
        sims = daemon.supervisor.simulators
        assert streamed(daemon)[0] == reference[0]
        assert sims["t"].stats.requests == 0  # a pair serves: P/D is preferred
        # the prefill engine goes down: no pair is left, the aggregated engine serves
        sims["p"].faults = FaultPlan(status=Status.UNAVAILABLE, only_request=1)
        assert streamed(daemon)[0] == reference[0]
        assert sims["t"].stats.requests == 1
        wait_for(lambda: daemon.supervisor.serving_count == 3, what="the prefill engine back")
        assert streamed(daemon)[0] == reference[0]
        assert sims["t"].stats.requests == 1  # and P/D again once a pair serves
