"""End to end: one daemon serving three models on simulated engines of mixed kinds.

``chat`` runs on two SGLang simulators, ``coder`` (alias ``code``) on a vLLM
and an SGLang simulator, ``small`` on a TensorRT-LLM simulator (which reports
no served name: its ``model`` key says). Each request must land only on its
own model's engines (the simulators' own counters say), ``/v1/models`` lists
every name, an unknown model is OpenAI's 404, and a model added and removed
by editing the file under load fails no request of another model.
"""

from __future__ import annotations

import textwrap
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.daemon import Daemon, free_port, running_daemon, wait_for
from tests.support.http import http
from tests.support.models import (
    FAST,
    engine_requests,
    engine_table,
    frontend_table,
    get_json,
    openai_client,
)

SLOW = FAST.replace("decode_us_per_token = 0", "decode_us_per_token = 20000")


def engine(name: str, kind: str, model: str | None = None, *, sim_model: str | None = None,
           slow: bool = False) -> str:
    simulator = SLOW if slow else FAST
    if sim_model is not None:
        simulator += f'\nserved_model_name = "{sim_model}"'
    return engine_table(name, kind, model, simulator)


def models_fleet(model_dir: Path, *, extra_model: bool = False) -> str:
    """Three models (four with ``extra_model``), their engines after them."""
    head = frontend_table(model_dir, textwrap.dedent("""\
        [[model]]
        name = "chat"
        owned_by = "team-chat"
        context_length = 2048

        [[model]]
        name = "coder"
        aliases = ["code", "org/coder-7b"]
        [model.routing]
        policy = "least_loaded"
        [model.sampling]
        max_tokens = 5

        [[model]]
        name = "small"
        [model.limits]
        max_in_flight = 1
        max_queue = 0
        """))
    if extra_model:
        head += '\n[[model]]\nname = "extra"\n'
    engines = [
        engine("chat-1", "sglang", "chat"),
        engine("chat-2", "sglang", sim_model="chat"),
        engine("coder-1", "vllm", "coder"),
        engine("coder-2", "sglang", "code"),
        engine("small-1", "trtllm", "small", slow=True),
    ]
    if extra_model:
        engines.append(engine("extra-1", "vllm", "extra"))
    return head + "\n" + "\n\n".join(engines) + "\n"


ENGINES = {"chat": ("chat-1", "chat-2"), "coder": ("coder-1", "coder-2"), "small": ("small-1",)}


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("models"), models_fleet(model_dir)) as d:
        d.wait_serving(5)
        yield d


def requests_by_engine(daemon: Daemon) -> dict[str, int]:
    return engine_requests(daemon)


def test_each_request_lands_only_on_its_models_engines(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    for model, names in ENGINES.items():
        before = requests_by_engine(daemon)
        for _ in range(4):
            reply = client.completions.create(model=model, prompt="hello there", max_tokens=3)
            assert reply.model == model
        after = requests_by_engine(daemon)
        grew = {name for name in after if after[name] > before.get(name, 0)}
        assert grew and grew <= set(names), (model, grew)
        assert sum(after[n] - before.get(n, 0) for n in names) == 4


def test_an_alias_reaches_its_model_and_its_sampling_defaults_apply(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    before = requests_by_engine(daemon)
    reply = client.completions.create(model="code", prompt="def f():")
    assert reply.usage is not None and reply.usage.completion_tokens == 5  # [model.sampling]
    after = requests_by_engine(daemon)
    assert {n for n in after if after[n] > before.get(n, 0)} <= set(ENGINES["coder"])


def test_models_lists_every_model_with_owner_and_context(daemon: Daemon) -> None:
    listing = get_json(daemon.url + "/v1/models")
    by_id = {entry["id"]: entry for entry in listing["data"]}
    assert set(by_id) == {"chat", "coder", "code", "org/coder-7b", "small"}
    assert by_id["chat"]["owned_by"] == "team-chat"
    assert by_id["chat"]["max_model_len"] == 2048  # the model's own, over the engines'
    assert by_id["coder"]["max_model_len"] == 4096  # the simulators' default
    assert by_id["small"]["owned_by"] == "direct-frontend"


def test_each_model_is_retrieved_by_its_id_as_it_is_listed(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    listing = {entry["id"]: entry for entry in get_json(daemon.url + "/v1/models")["data"]}
    for model_id, entry in listing.items():  # "org/coder-7b": an id with a slash
        assert client.models.retrieve(model_id).model_dump(exclude_unset=True) == entry
        assert get_json(f"{daemon.url}/v1/models/{model_id}") == entry
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert caught.value.code == "model_not_found" and "'nope'" in caught.value.message
    assert http.get(daemon.url + "/v1/models/").status_code == 404  # no id: no route
    reply = http.post(daemon.url + "/v1/models/chat", json={})
    assert reply.status_code == 405 and reply.headers["allow"] == "GET"
    metrics = http.get(daemon.url + "/metrics").text
    assert 'code="200",endpoint="/v1/models/{model}"' in metrics  # one label, not one per id
    assert 'code="404",endpoint="/v1/models/{model}"' in metrics
    assert "/v1/models/chat" not in metrics


def test_an_unknown_model_is_openais_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"


def test_per_model_metrics_and_fleet_view(daemon: Daemon, client: openai.OpenAI) -> None:
    client.completions.create(model="small", prompt="hi", max_tokens=2)
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'direct_frontend_model_requests_total{code="200",model="small"}' in metrics
    assert 'direct_frontend_model_engines_serving{model="coder"} 2.0' in metrics
    assert 'direct_frontend_model_time_to_first_token_seconds_count{model="small"}' in metrics
    status = get_json(daemon.url + "/fleet")
    models = {m["name"]: m for m in status["models"]}
    assert models["coder"]["policy"] == "least_loaded"
    assert models["coder"]["engines"] == ["coder-1", "coder-2"]
    assert {e["name"]: e["model"] for e in status["engines"]}["small-1"] is not None


def test_a_busy_model_does_not_starve_another(daemon: Daemon, client: openai.OpenAI) -> None:
    """``small`` admits one request and queues none; ``chat`` keeps answering meanwhile."""
    served = daemon.control.models.get("small")
    stream = client.completions.create(model="small", prompt="hi", max_tokens=100, stream=True)
    try:
        next(iter(stream))  # the one slot is taken while the stream runs (slow decode)
        assert served.settings.admission.in_flight == 1
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="small", prompt="hi", max_tokens=1)
        reply = client.completions.create(model="chat", prompt="hi", max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens == 2
    finally:
        stream.close()
    wait_for(lambda: served.settings.admission.in_flight == 0, what="small's slot freed")


def test_a_model_added_and_removed_live_under_load(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    path = daemon.fleet.source
    original = path.read_text()
    failures: list[BaseException] = []
    done = [0]
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model="chat", prompt="steady", max_tokens=2)
                done[0] += 1
            except Exception as exc:  # any failure fails the test
                failures.append(exc)
                return

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_for(lambda: done[0] > 0, what="load running")
        path.write_text(original + '\n[[model]]\nname = "extra"\n\n'
                        + engine("extra-1", "vllm", "extra") + "\n")
        wait_for(lambda: daemon.control.models.get("extra") is not None, what="extra added")
        daemon.wait_serving(6, timeout=15)
        reply = client.completions.create(model="extra", prompt="new", max_tokens=2)
        assert reply.model == "extra"
        path.write_text(original)
        wait_for(lambda: daemon.control.models.get("extra") is None, what="extra removed")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="extra", prompt="gone", max_tokens=1)
        daemon.wait_serving(5, timeout=15)
        at_removal = done[0]
        wait_for(lambda: done[0] > at_removal, what="load going on")
    finally:
        stop.set()
        worker.join(30)
    assert not failures, failures


def test_the_shipped_multi_model_example_runs_as_it_is(tmp_path: Path) -> None:
    """config/examples/multi-model.toml on free ports: every model listed, each answers."""
    example = Path(__file__).resolve().parents[2] / "config" / "examples" / "multi-model.toml"
    text = example.read_text().replace("127.0.0.1:8000", "127.0.0.1:0")
    text = text.replace('"../demo-model"', f'"{example.parent.parent / "demo-model"}"')
    for port in range(50081, 50086):
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}")
    with running_daemon(tmp_path, text) as daemon:
        daemon.wait_serving(5, timeout=20)
        listed = {m["id"] for m in get_json(daemon.url + "/v1/models")["data"]}
        assert listed == {"chat", "assistant", "chat-sql", "coder", "small"}
        with openai_client(daemon) as client:
            for model in sorted(listed):
                reply = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                assert reply.choices[0].message.content


def test_an_engine_whose_discovery_disagrees_with_the_file_is_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    head = frontend_table(model_dir, '[[model]]\nname = "chat"\n\n[[model]]\nname = "coder"\n')
    engines = [
        engine("chat-1", "sglang", "chat"),
        engine("liar", "vllm", "chat", sim_model="coder"),  # says chat, serves coder
    ]
    with running_daemon(tmp_path, head + "\n" + "\n\n".join(engines) + "\n") as daemon:
        daemon.wait_serving(1)

        def liar() -> dict[str, object]:
            view = get_json(daemon.url + "/fleet")
            return next(e for e in view["engines"] if e["name"] == "liar")

        wait_for(lambda: liar()["state"] == "refused", what="the engine refused")
        assert liar()["last_error"] == (
            "discovery reports model 'coder' but the fleet file says model = 'chat'"
        )
        with openai_client(daemon) as client:
            for _ in range(4):
                client.completions.create(model="chat", prompt="hi", max_tokens=2)
        assert engine_requests(daemon)["liar"] == 0


def test_a_stream_of_a_removed_model_runs_to_its_end(model_dir: Path, tmp_path: Path) -> None:
    head = frontend_table(model_dir, '[[model]]\nname = "chat"\n\n[[model]]\nname = "extra"\n')
    kept = engine("chat-1", "sglang", "chat")
    text = head + "\n" + kept + "\n\n" + engine("extra-1", "vllm", "extra", slow=True) + "\n"
    with running_daemon(tmp_path, text) as daemon, openai_client(daemon) as client:
        daemon.wait_serving(2)
        stream = client.completions.create(
            model="extra", prompt="long", max_tokens=60, stream=True,  # 1.2 s at 20 ms a token
            stream_options={"include_usage": True},
        )
        pieces = [next(iter(stream)).choices[0].text]
        chat_before = engine_requests(daemon)["chat-1"]
        daemon.fleet.source.write_text(head.replace('\n\n[[model]]\nname = "extra"\n', "\n")
                                       + "\n" + kept + "\n")
        wait_for(lambda: daemon.control.models.get("extra") is None, what="extra removed")
        finish, completion = None, None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
        assert (finish, completion) == ("length", 60)  # drained, not cut
        assert "".join(pieces)
        assert engine_requests(daemon)["chat-1"] == chat_before  # never on another model's engine
