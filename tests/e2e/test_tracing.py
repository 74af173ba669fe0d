"""Tracing end to end: the real daemon's spans, as an OTLP/HTTP collector receives them.

A streaming request migrates off an engine that dies mid-stream; its spans
must form one tree under the client's ``traceparent``, and each engine leg
must have carried its own span's ``traceparent`` to the simulated engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from direct_frontend.simulator.faults import FaultPlan
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine
from tests.support.http import http
from tests.support.otlp import OtlpReceiver, ReceivedSpan, receiving

PACED = {"decode_us_per_token": 300, "prefill_us_per_token": 0, "eos_probability": 0.0}
CHAT = [{"role": "user", "content": "Tell me a long story about the sea."}]
TOKENS = 40
DIES_AFTER = 17
STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
SERVER, CLIENT = 2, 3  # Span.SPAN_KIND_SERVER, SPAN_KIND_CLIENT


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    yield from receiving()


def tracing_fleet(model_dir: Path, receiver: OtlpReceiver | None) -> str:
    tracing = "" if receiver is None else (
        f'\n[frontend.tracing]\notlp_endpoint = "{receiver.endpoint}"\n'
        'service_name = "df-under-test"\n'
    )
    engines = [sim_engine(name, "sglang", **PACED) for name in "abc"]
    return fleet_text(model_dir, engines, frontend_extra=tracing,
                      probe="interval_s = 0.1\ntimeout_s = 1.0")


def stream(daemon: Daemon, traceparent: str | None = None) -> str:
    """One streaming chat request; its text."""
    headers = {} if traceparent is None else {"traceparent": traceparent}
    body = {"model": "demo", "messages": CHAT, "max_tokens": TOKENS, "stream": True}
    text = []
    with http.stream("POST", daemon.url + "/v1/chat/completions", json=body,
                      headers=headers, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id]


def test_a_migrated_stream_is_one_trace_under_the_clients_traceparent(
    model_dir: Path, tmp_path: Path, receiver: OtlpReceiver
) -> None:
    parents = {os.urandom(16).hex(): os.urandom(8).hex() for _ in range(3)}
    with running_daemon(tmp_path, tracing_fleet(model_dir, receiver)) as daemon:
        daemon.wait_serving(3)
        sims = daemon.supervisor.simulators
        expected = stream(daemon)  # the uninterrupted text (traced too, with no parent)
        for name in "ab":  # round robin reaches a dying engine within three requests
            sims[name].faults = dataclasses.replace(
                FaultPlan(die_after_tokens=DIES_AFTER, only_request=1)
            )
        for trace_id, span_id in parents.items():
            assert stream(daemon, f"00-{trace_id}-{span_id}-01") == expected
        received_metadata = {name: dict(sim.stats.traceparents) for name, sim in sims.items()}
    # The daemon's shutdown flushed the exporter: every span has arrived.
    spans = receiver.received()
    roots = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert len(roots) == 4
    assert {s.service_name for s in spans} == {"df-under-test"}
    migrated = [r for r in roots if any(name == "migration" for name, _ in r.events)]
    assert len(migrated) >= 1
    for root in roots:
        assert root.kind == SERVER
        assert root.attributes["http.response.status_code"] == 200
        assert root.attributes["http.route"] == "/v1/chat/completions"
        assert root.attributes["gen_ai.request.model"] == "demo"
        assert root.attributes["request.id"]
        assert root.attributes["gen_ai.usage.output_tokens"] == TOKENS
        assert root.attributes["gen_ai.usage.input_tokens"] > 0
        assert [name for name, _ in root.events].count("first token") == 1
        if root.trace_id in parents:  # the client's trace: the request's span is its child
            assert root.parent_span_id == parents[root.trace_id]
        else:
            assert root.parent_span_id == ""
        steps = {s.name: s for s in children(spans, root) if s.name != "engine leg"}
        assert sorted(steps) == ["admission", "preprocess", "route"]
        assert steps["preprocess"].attributes["prompt_tokens"] == (
            root.attributes["gen_ai.usage.input_tokens"]
        )
        assert steps["route"].attributes["route.policy"] == "round_robin"
        assert steps["route"].attributes["route.spilled"] is False
        assert all(s.trace_id == root.trace_id for s in children(spans, root))
        # the steps run in order, inside the request
        assert (root.start_ns <= steps["preprocess"].start_ns <= steps["admission"].start_ns
                <= steps["route"].start_ns <= steps["route"].end_ns <= root.end_ns)

    for root in migrated:
        legs = sorted((s for s in children(spans, root) if s.name == "engine leg"),
                      key=lambda s: s.start_ns)
        route = next(s for s in children(spans, root) if s.name == "route")
        assert legs[0].attributes["engine.name"] == route.attributes["route.engine"]
        assert {leg.kind for leg in legs} == {CLIENT}
        moves = [attrs for name, attrs in root.events if name == "migration"]
        assert len(legs) == len(moves) + 1  # each dying engine died after DIES_AFTER tokens
        prompt = root.attributes["gen_ai.usage.input_tokens"]
        for number, (move, failed, taker) in enumerate(zip(moves, legs, legs[1:], strict=False)):
            assert failed.status_code == STATUS_ERROR
            assert failed.attributes["error.type"] == "unavailable"
            assert move["from_engine"] == failed.attributes["engine.name"]
            assert move["to_engine"] == taker.attributes["engine.name"]
            assert move["tokens_so_far"] == DIES_AFTER * (number + 1)
            # the continuation's prompt is the client's and the tokens produced so far
            assert taker.attributes["leg.prompt_tokens"] == prompt + move["tokens_so_far"]
        assert legs[-1].status_code != STATUS_ERROR
        assert legs[-1].attributes["engine.name"] != legs[-2].attributes["engine.name"]

    # Every leg carried its own span to its engine as the W3C traceparent metadata.
    legs = [s for s in spans if s.name == "engine leg"]
    for leg in legs:
        engine, request_id = leg.attributes["engine.name"], leg.attributes["engine.request_id"]
        version, trace_id, span_id, flags = received_metadata[engine][request_id].split("-")
        assert (version, trace_id, span_id) == ("00", leg.trace_id, leg.span_id)
        assert int(flags, 16) & 1  # sampled
    assert sum(len(seen) for seen in received_metadata.values()) == len(legs)


def test_tracing_off_sends_no_trace_metadata(model_dir: Path, tmp_path: Path) -> None:
    with running_daemon(tmp_path, tracing_fleet(model_dir, None)) as daemon:
        daemon.wait_serving(3)
        assert daemon.app is not None and daemon.app.tracing is None
        stream(daemon, f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01")
        sims = daemon.supervisor.simulators.values()
        assert sum(len(sim.stats.request_ids) for sim in sims) == 1
        assert all(sim.stats.traceparents == {} for sim in sims)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_both_legs_of_a_prefill_decode_pair_have_their_own_spans(
    model_dir: Path, tmp_path: Path, receiver: OtlpReceiver, kind: str
) -> None:
    engines = [{**sim_engine("p", kind, **PACED), "role": "prefill"},
               {**sim_engine("d", kind, **PACED), "role": "decode"}]
    tracing = f'\n[frontend.tracing]\notlp_endpoint = "{receiver.endpoint}"\n'
    text = fleet_text(model_dir, engines, frontend_extra=tracing,
                      probe="interval_s = 0.1\ntimeout_s = 1.0")
    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(2)
        stream(daemon)
        sims = daemon.supervisor.simulators
        received_metadata = {name: dict(sim.stats.traceparents) for name, sim in sims.items()}
    spans = receiver.received()
    (root,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    legs = {s.attributes["engine.role"]: s for s in children(spans, root)
            if s.name == "engine leg"}
    assert sorted(legs) == ["decode", "prefill"]
    assert legs["prefill"].attributes["engine.name"] == "p"
    assert legs["decode"].attributes["engine.name"] == "d"
    for leg in legs.values():
        assert leg.attributes["leg.disaggregated"] is True
        assert leg.attributes["engine.kind"] == kind
        engine, request_id = leg.attributes["engine.name"], leg.attributes["engine.request_id"]
        assert received_metadata[engine][request_id].split("-")[1:3] == [leg.trace_id,
                                                                          leg.span_id]


def test_an_embeddings_request_is_one_trace_with_a_leg_per_input(
    model_dir: Path, tmp_path: Path, receiver: OtlpReceiver
) -> None:
    tracing = (f'\n[frontend.tracing]\notlp_endpoint = "{receiver.endpoint}"\n'
               'service_name = "df-under-test"\n')
    engines = [sim_engine(name, "vllm", embedding_dim=8) for name in "ab"]
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    with running_daemon(tmp_path, fleet_text(model_dir, engines, frontend_extra=tracing)) as d:
        d.wait_serving(2)
        reply = http.post(d.url + "/v1/embeddings", timeout=30,
                           headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                           json={"model": "demo", "input": ["one text", "another", "a third"]})
        assert reply.status_code == 200
        sims = d.supervisor.simulators
        received = {name: dict(sim.stats.traceparents) for name, sim in sims.items()}
    spans = receiver.received()
    (root,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert (root.trace_id, root.parent_span_id, root.kind) == (trace_id, parent, SERVER)
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == "demo"
    tokens = reply.json()["usage"]["prompt_tokens"]
    assert root.attributes["gen_ai.usage.input_tokens"] == tokens
    steps = {s.name: s for s in children(spans, root) if s.name != "engine leg"}
    assert sorted(steps) == ["admission", "preprocess"]
    assert steps["preprocess"].attributes["prompt_tokens"] == tokens
    legs = [s for s in children(spans, root) if s.name == "engine leg"]
    request_id = root.attributes["request.id"]
    assert sorted(leg.attributes["engine.request_id"] for leg in legs) == [
        f"{request_id}-{k}" for k in range(3)]
    for leg in legs:  # each carried its own span to the engine that embedded its input
        seen = received[leg.attributes["engine.name"]][leg.attributes["engine.request_id"]]
        assert seen.split("-")[1:3] == [leg.trace_id, leg.span_id] and leg.kind == CLIENT
