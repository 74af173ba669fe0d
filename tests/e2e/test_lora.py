"""End to end: LoRA adapters served under their own names, on simulated SGLang engines.

``chat`` runs on two SGLang simulators holding one adapter each at most
(``max_loras = 1``) and a vLLM simulator, whose contract carries no adapter;
its adapters ``chat-sql`` and ``chat-law`` are loaded on demand. ``solo`` runs
on one SGLang simulator holding two, to compare caches on one engine. What the
simulators hold and how often they loaded is read from the simulators.
"""

from __future__ import annotations

import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.daemon import Daemon, free_port, running_daemon

FAST = "decode_us_per_token = 0\nprefill_us_per_token = 0\neos_probability = 0.0"
#: long enough for several 16-token blocks of prefix cache
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)


def engine(name: str, kind: str, model: str, max_loras: int = 0) -> str:
    lora = f"\nmax_loras = {max_loras}\nlora_load_ms = 5" if max_loras else ""
    return textwrap.dedent(f"""\
        [[engine]]
        name = "{name}"
        url = "grpc://127.0.0.1:{free_port()}"
        kind = "{kind}"
        model = "{model}"
        simulate = true
        [engine.simulator]
        """) + FAST + lora


def lora_fleet(model_dir: Path) -> str:
    head = textwrap.dedent(f"""\
        [frontend]
        listen = "127.0.0.1:0"
        tokenizer = "{model_dir}"

        [frontend.probe]
        interval_s = 0.2
        timeout_s = 1.0

        [frontend.faults]
        wait_for_engine_s = 0.2

        [[model]]
        name = "chat"
        [[model.adapter]]
        name = "chat-sql"
        path = "/adapters/sql"
        [[model.adapter]]
        name = "chat-law"
        path = "/adapters/law"

        [[model]]
        name = "solo"
        [[model.adapter]]
        name = "solo-a"
        path = "/adapters/a"
        [[model.adapter]]
        name = "solo-b"
        path = "/adapters/b"
        [[model.adapter]]
        name = "solo-preloaded"
        """)
    engines = [
        engine("sg-1", "sglang", "chat", max_loras=1),
        engine("sg-2", "sglang", "chat", max_loras=1),
        engine("vl-1", "vllm", "chat"),
        engine("solo-1", "sglang", "solo", max_loras=2),
    ]
    return head + "\n" + "\n\n".join(engines) + "\n"


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("lora"), lora_fleet(model_dir)) as d:
        d.wait_serving(4)
        yield d


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def sims(daemon: Daemon) -> dict[str, object]:
    return daemon.run_sync(lambda: dict(daemon.supervisor.simulators))  # type: ignore[no-any-return]


def held(daemon: Daemon) -> dict[str, list[str]]:
    """The adapter ids each simulated SGLang engine holds."""
    out: dict[str, list[str]] = {}
    for name, sim in sims(daemon).items():
        loras = sim.core.loras  # type: ignore[attr-defined]
        if loras is not None:
            out[name] = loras.ids
    return out


def requests(daemon: Daemon) -> dict[str, int]:
    return {name: sim.stats.requests for name, sim in sims(daemon).items()}  # type: ignore[attr-defined]


def cached(client: openai.OpenAI, model: str) -> int:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert reply.model == model
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_adapters_are_listed_as_models_of_their_base(daemon: Daemon) -> None:
    with urllib.request.urlopen(daemon.url + "/v1/models", timeout=10) as response:
        listing = {m["id"]: m for m in json.loads(response.read())["data"]}
    assert listing["chat-sql"]["parent"] == "chat"
    assert listing["solo-a"]["parent"] == "solo"
    assert "parent" not in listing["chat"]


def test_an_adapter_loads_on_demand_then_sticks_to_the_engine_holding_it(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    before = requests(daemon)
    for _ in range(4):
        client.completions.create(model="chat-sql", prompt="select", max_tokens=2)
    after = requests(daemon)
    grew = {n for n in after if after[n] > before.get(n, 0)}
    assert len(grew) == 1 and grew <= {"sg-1", "sg-2"}, grew  # never vLLM: no LoRA field
    (engine,) = grew
    assert held(daemon)[engine] == ["chat-sql"]
    assert sims(daemon)[engine].core.loras.stats.loads == 1  # type: ignore[attr-defined]


def test_loads_stay_within_each_engines_cap(daemon: Daemon, client: openai.OpenAI) -> None:
    for model in ("chat-law", "chat-sql", "chat-law", "chat-sql", "chat"):
        client.completions.create(model=model, prompt="x", max_tokens=1)
        assert all(len(ids) <= 1 for name, ids in held(daemon).items() if name != "solo-1")
    holding = held(daemon)
    assert sorted(holding["sg-1"] + holding["sg-2"]) == ["chat-law", "chat-sql"]


def test_an_adapters_cache_never_credits_another(daemon: Daemon, client: openai.OpenAI) -> None:
    assert cached(client, "solo-a") == 0
    assert cached(client, "solo-a") > 0  # the same engine, the same adapter: a prefix hit
    assert cached(client, "solo-b") == 0  # same engine and prompt, another adapter: none
    assert cached(client, "solo") == 0  # nor the base model
    assert sorted(held(daemon)["solo-1"]) == ["solo-a", "solo-b"]


def test_an_adapter_no_engine_holds_or_can_load_is_a_503(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="solo-preloaded", prompt="x", max_tokens=1)
    assert caught.value.status_code == 503


def test_per_adapter_metrics(daemon: Daemon, client: openai.OpenAI) -> None:
    client.completions.create(model="chat-sql", prompt="x", max_tokens=1)
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'direct_frontend_model_requests_total{model="chat-sql",status="200"}' in metrics
