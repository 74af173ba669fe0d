"""End to end: LoRA adapters served under their own names, on simulated SGLang engines.

``chat`` runs on two SGLang simulators holding one adapter each at most
(``max_loras = 1``) and a vLLM simulator, whose contract carries no adapter;
its adapters ``chat-sql`` and ``chat-law`` are loaded on demand. ``solo`` runs
on one SGLang simulator holding two, to compare caches on one engine. What the
simulators hold and how often they loaded is read from the simulators.
"""

from __future__ import annotations

import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.daemon import Daemon, running_daemon
from tests.support.models import (
    FAST,
    engine_requests,
    engine_table,
    frontend_table,
    get_json,
    simulators,
)

#: long enough for several 16-token blocks of prefix cache
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)


def engine(name: str, kind: str, model: str, max_loras: int = 0) -> str:
    lora = f"\nmax_loras = {max_loras}\nlora_load_ms = 5" if max_loras else ""
    return engine_table(name, kind, model, FAST + lora)


def lora_fleet(model_dir: Path) -> str:
    head = frontend_table(model_dir, textwrap.dedent("""\
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
        """))
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


def held(daemon: Daemon) -> dict[str, list[str]]:
    """The adapter ids each simulated SGLang engine holds."""
    out: dict[str, list[str]] = {}
    for name, sim in simulators(daemon).items():
        loras = sim.core.loras  # type: ignore[attr-defined]
        if loras is not None:
            out[name] = loras.ids
    return out


def cached(client: openai.OpenAI, model: str) -> int:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert reply.model == model
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_adapters_are_listed_as_models_of_their_base(daemon: Daemon) -> None:
    listing = {m["id"]: m for m in get_json(daemon.url + "/v1/models")["data"]}
    assert listing["chat-sql"]["parent"] == "chat"
    assert listing["solo-a"]["parent"] == "solo"
    assert "parent" not in listing["chat"]
    assert get_json(daemon.url + "/v1/models/chat-sql") == listing["chat-sql"]


def test_an_adapter_loads_on_demand_then_sticks_to_the_engine_holding_it(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    before = engine_requests(daemon)
    for _ in range(4):
        client.completions.create(model="chat-sql", prompt="select", max_tokens=2)
    after = engine_requests(daemon)
    grew = {n for n in after if after[n] > before.get(n, 0)}
    assert len(grew) == 1 and grew <= {"sg-1", "sg-2"}, grew  # never vLLM: no LoRA field
    (engine,) = grew
    assert held(daemon)[engine] == ["chat-sql"]
    assert simulators(daemon)[engine].core.loras.stats.loads == 1  # type: ignore[attr-defined]


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
    assert 'direct_frontend_model_requests_total{code="200",model="chat-sql"}' in metrics
