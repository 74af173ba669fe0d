"""``POST /v1/embeddings`` end to end: the official client, the real daemon, embedding engines.

The fleet serves two models: ``demo``, a generation model on one simulated
SGLang engine, and ``embed``, an embedding model on two simulated engines
(vLLM and SGLang kinds, ``embedding_dim`` set: they report
``is_generation`` false, answer ``Embed`` and refuse ``Generate``). The
simulator's vector is a pure function of the token ids it gets
(``embedding_of``), so the test knows every expected value: the router must
tokenize as the engines' own servers do (BOS added to text), keep the
inputs' order and pass the values through unchanged, as floats or base64.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpclib import Status

from direct_frontend.simulator.embedding import embedding_of
from direct_frontend.simulator.faults import FaultPlan
from direct_frontend.text.model_dir import TextModel
from tests.support.crossings import crossings
from tests.support.daemon import Daemon, in_flight, raw_post, running_daemon, wait_for
from tests.support.http import http
from tests.support.models import FAST, engine_table, frontend_table, openai_client, simulators

DIM = 24
EMBEDDER = FAST + f"\nembedding_dim = {DIM}\ncontext_length = 64"
TEXTS = ["The quick brown fox", "jumps over", "the lazy dog"]


def fleet(model_dir: Path) -> str:
    head = frontend_table(model_dir, '\n[[model]]\nname = "demo"\n\n[[model]]\nname = "embed"\n')
    engines = [
        engine_table("gen", "sglang", "demo"),
        engine_table("emb-v", "vllm", "embed", EMBEDDER),
        engine_table("emb-s", "sglang", "embed", EMBEDDER),
    ]
    return head + "\n" + "\n\n".join(engines) + "\n"


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("embeddings"), fleet(model_dir)) as d:
        d.wait_serving(3)
        yield d


def expected(text_model: TextModel, text: str) -> list[float]:
    return embedding_of(text_model.encode(text, add_special_tokens=True), DIM)


def embeds(daemon: Daemon) -> dict[str, int]:
    return {name: sim.stats.embeds for name, sim in simulators(daemon).items()}


def test_the_official_client_gets_each_inputs_vector_in_order(
    daemon: Daemon, text_model: TextModel
) -> None:
    before = embeds(daemon)
    with openai_client(daemon) as client:  # asks for base64 and decodes it
        reply = client.embeddings.create(model="embed", input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "embed"
    for data, text in zip(reply.data, TEXTS, strict=True):
        assert data.embedding == pytest.approx(expected(text_model, text), abs=1e-6)
    tokens = sum(len(text_model.encode(t, add_special_tokens=True)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    after = embeds(daemon)
    assert after["gen"] == before["gen"] == 0  # a generation engine never gets one
    assert sum(after.values()) - sum(before.values()) == 3


def test_floats_base64_and_token_ids(daemon: Daemon, text_model: TextModel) -> None:
    ids = [[11, 12, 13], [14, 15]]
    url = daemon.url + "/v1/embeddings"
    floats = http.post(url, json={"model": "embed", "input": ids}, timeout=30).json()
    for data, one in zip(floats["data"], ids, strict=True):
        assert data["embedding"] == pytest.approx(embedding_of(one, DIM), abs=1e-6)
    assert floats["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    packed = http.post(url, json={"model": "embed", "input": "hello", "dimensions": DIM,
                                   "encoding_format": "base64"}, timeout=30).json()
    vector = struct.unpack(f"<{DIM}f", base64.b64decode(packed["data"][0]["embedding"]))
    assert list(vector) == pytest.approx(expected(text_model, "hello"), abs=1e-6)


def test_the_inputs_spread_over_the_models_embedding_engines(daemon: Daemon) -> None:
    before = embeds(daemon)
    with openai_client(daemon) as client:
        client.embeddings.create(model="embed", input=[f"sentence {i}" for i in range(12)])
    after = embeds(daemon)
    grew = {name for name in after if after[name] > before[name]}
    assert grew == {"emb-v", "emb-s"}, (before, after)


def test_an_engine_that_fails_leaves_its_input_to_the_other(
    daemon: Daemon, text_model: TextModel
) -> None:
    sims = simulators(daemon)
    before = embeds(daemon)
    try:
        failures = (("emb-s", Status.RESOURCE_EXHAUSTED), ("emb-v", Status.UNAVAILABLE))
        for failing, status in failures:
            sims[failing].faults = FaultPlan(status=status)  # every Embed call there fails
            with openai_client(daemon) as client:
                reply = client.embeddings.create(model="embed", input=TEXTS)
            for data, text in zip(reply.data, TEXTS, strict=True):
                assert data.embedding == pytest.approx(expected(text_model, text), abs=1e-6)
            sims[failing].faults = FaultPlan()
            assert sims[failing].fault_stats.failed, failing  # it was tried, and failed
            daemon.wait_serving(3)  # an engine that failed as down is back after its probes
    finally:
        sims["emb-v"].faults = FaultPlan()
        sims["emb-s"].faults = FaultPlan()
    after = embeds(daemon)
    assert sum(after.values()) - sum(before.values()) == 6  # each input embedded once
    metrics = http.get(daemon.url + "/metrics").text
    for name, kind in (("emb-s", "overloaded"), ("emb-v", "unavailable")):
        assert f'direct_frontend_engine_errors_total{{engine="{name}",kind="{kind}"}}' in metrics


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        ("/v1/embeddings", {"model": "demo", "input": "hi"}, 400, "model",
         "does not serve embeddings"),
        ("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user",
                                                                  "content": "hi"}]},
         400, "model", "/v1/embeddings"),
        ("/v1/embeddings", {"model": "nope", "input": "hi"}, 404, "model", "nope"),
        ("/v1/embeddings", {"model": "embed", "input": "hi", "dimensions": 8}, 400,
         "dimensions", f"may only be {DIM}"),
        ("/v1/embeddings", {"model": "embed", "input": ["hi", "x " * 80]}, 400, "input[1]",
         "maximum context length"),
        ("/v1/embeddings", {"model": "embed", "input": [[1], [10**7]]}, 400, "input[1]",
         "token ids must be in"),
        ("/v1/embeddings", {"model": "embed", "input": ""}, 400, "input", "must not be empty"),
    ],
)
def test_what_cannot_be_embedded_is_a_clear_4xx(
    daemon: Daemon, path: str, body: dict[str, Any], status: int, param: str, fragment: str
) -> None:
    reply = http.post(daemon.url + path, json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_the_fleet_view_and_metrics_say_what_each_engine_serves(daemon: Daemon) -> None:
    engines = {e["name"]: e for e in http.get(daemon.url + "/fleet").json()["engines"]}
    assert {n: e["serves"] for n, e in engines.items()} == {
        "gen": "generation", "emb-v": "embeddings", "emb-s": "embeddings"}
    models = {m["id"] for m in http.get(daemon.url + "/v1/models").json()["data"]}
    assert models == {"demo", "embed"}
    metrics = http.get(daemon.url + "/metrics").text
    assert 'code="200",endpoint="/v1/embeddings"' in metrics
    assert 'direct_frontend_model_requests_total{code="200",model="embed"}' in metrics


def test_a_batch_runs_no_more_inputs_at_once_than_its_slots(
    model_dir: Path, tmp_path: Path
) -> None:
    """One admission slot: the first input hangs on its engine, so no other input may start."""
    head = frontend_table(model_dir, '\n[[model]]\nname = "embed"\n[model.limits]\n'
                                     'max_in_flight = 1\n')
    with running_daemon(tmp_path, head + "\n" + engine_table("e", "vllm", "embed", EMBEDDER)
                        + "\n") as daemon:
        daemon.wait_serving(1)
        sim = simulators(daemon)["e"]
        sim.faults = FaultPlan(hang_after_tokens=0, only_request=1)
        with raw_post(daemon.url, "/v1/embeddings",
                      {"model": "embed", "input": ["a", "b", "c", "d"]}):
            wait_for(lambda: bool(sim.fault_stats.hung), what="the first input's call to hang")
        # the client left: the hung call is cancelled, and no other input ever started
        wait_for(lambda: in_flight(daemon) == 0, what="the request to end")
        assert sim.fault_stats.embed_calls == 1 and sim.stats.embeds == 0


def test_an_embeddings_request_crosses_into_the_pipeline_once(daemon: Daemon) -> None:
    with crossings(daemon) as seen:
        reply = http.post(daemon.url + "/v1/embeddings",
                           json={"model": "embed", "input": TEXTS}, timeout=10)
    assert reply.status_code == 200, reply.text
    assert seen == {("in", "Stair.embed"), ("out", "Writer.__call__")}
