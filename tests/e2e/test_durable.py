"""End to end: stored state survives SIGKILL and restarts, and replicas share it in PostgreSQL.

The daemons here are real processes (``direct-frontend run``), killed with
SIGKILL: no shutdown code runs. The first test runs the quick-start fleet
file as shipped (config/fleet.toml, only its ports moved), its SQLite file
in the state directory systemd would give it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from direct_frontend.state.sqlite import SqliteStore
from tests.support.daemon import PROCESS_S, fleet_text, free_port, sim_engine, wait_for
from tests.support.http import http, sdk_http
from tests.support.postgres import PostgresServer, running_postgres

ROOT = Path(__file__).resolve().parents[2]
DAEMON = str(Path(sys.executable).with_name("direct-frontend"))
SLOW = {"decode_us_per_token": 20000, "prefill_us_per_token": 0, "eos_probability": 0.0}


class Process:
    """One ``direct-frontend run`` of a fleet file, on the port it names."""

    def __init__(self, fleet: Path, port: int, env: dict[str, str] | None = None) -> None:
        self.fleet, self.port = fleet, port
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Process:
        self.proc = subprocess.Popen([DAEMON, "run", str(self.fleet), "--no-watch"],
                                     env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "the daemon exited"
            try:
                return http.get(self.url + "/ready").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, PROCESS_S, "the daemon to serve")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    @contextlib.contextmanager
    def client(self) -> Iterator[openai.OpenAI]:
        with openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                           http_client=sdk_http()) as c:
            yield c


@contextlib.contextmanager
def running(process: Process) -> Iterator[Process]:
    try:
        yield process.start()
    finally:
        process.kill()


def quick_start(tmp_path: Path) -> tuple[Path, int]:
    """config/fleet.toml as shipped, on free ports, its tokenizer found from anywhere."""
    text = (ROOT / "config" / "fleet.toml").read_text()
    port = free_port()
    text = text.replace('listen = "127.0.0.1:8000"', f'listen = "127.0.0.1:{port}"')
    text = re.sub(r"grpc://127\.0\.0\.1:\d+", lambda _: f"grpc://127.0.0.1:{free_port()}", text)
    text = text.replace('tokenizer = "demo-model"',
                        f'tokenizer = "{ROOT / "config" / "demo-model"}"')
    assert 'backend = "sqlite"' in text and "\npath" not in text
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(text)
    return fleet, port


def fleet_with(port: int, engine: dict[str, object], responses: str) -> str:
    """One simulated engine's fleet on ``port``, with these ``[frontend.responses]`` keys."""
    text = fleet_text(ROOT / "config" / "demo-model", [engine],
                      frontend_extra=f"[frontend.responses]\n{responses}\n")
    return text.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"')


def test_the_quick_start_keeps_responses_chains_and_conversations_through_sigkill(
        tmp_path: Path) -> None:
    fleet, port = quick_start(tmp_path)
    state = tmp_path / "state"
    daemon = Process(fleet, port, {"STATE_DIRECTORY": str(state)})
    with running(daemon), daemon.client() as client:
        first = client.responses.create(model="demo", input="My name is Ada.",
                                        max_output_tokens=8)
        second = client.responses.create(model="demo", input="And yours?",
                                         previous_response_id=first.id, max_output_tokens=8)
        conversation = client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "Remember 42."}],
            metadata={"run": "1"})
        turn = client.responses.create(model="demo", input="What number?",
                                       conversation=conversation.id, max_output_tokens=8)
        assert first.store and second.store and turn.store
        daemon.kill()  # SIGKILL: nothing of the daemon's runs after the answers above
    assert (state / "responses.db").exists()

    with running(daemon), daemon.client() as client:
        assert client.responses.retrieve(first.id).output[0].id == first.output[0].id
        assert client.responses.retrieve(second.id).previous_response_id == first.id
        with pytest.raises(openai.BadRequestError):  # not a background one, as before
            client.responses.cancel(first.id)
        history = [i.id for i in client.responses.input_items.list(second.id, order="asc")]
        assert first.output[0].id in history
        third = client.responses.create(model="demo", input="Still there?",
                                        previous_response_id=second.id, max_output_tokens=8)
        chain = [i.id for i in client.responses.input_items.list(third.id, order="asc",
                                                                 limit=100)]
        assert chain[:len(history)] == history and second.output[0].id in chain
        assert client.conversations.retrieve(conversation.id).metadata == {"run": "1"}
        read = [i.id for i in client.responses.input_items.list(turn.id, order="asc")]
        assert len(read) == 2 and read[0] == next(iter(client.conversations.items.list(
            conversation.id, order="asc"))).id  # its history: the conversation's item
        items = [i.id for i in client.conversations.items.list(conversation.id, order="asc")]
        assert len(items) == 3 and items[-1] == turn.output[0].id
        client.responses.create(model="demo", input="Again?", conversation=conversation.id,
                                max_output_tokens=4)
        assert len(list(client.conversations.items.list(conversation.id))) == 5
    store = SqliteStore(state / "responses.db")
    assert store.integrity_check() == "ok"
    store.close()


def test_a_background_response_running_at_sigkill_comes_back_failed(tmp_path: Path) -> None:
    port = free_port()
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(fleet_with(port, sim_engine("slow", **SLOW), 'backend = "sqlite"\n'
                                'path = "state/r.db"\nlease_s = 0.5'))
    daemon = Process(fleet, port)
    with running(daemon), daemon.client() as client:
        started = client.responses.create(model="demo", input="go", background=True,
                                          max_output_tokens=2000)
        assert started.status in ("queued", "in_progress")
        assert client.responses.retrieve(started.id).status in ("queued", "in_progress")
        daemon.kill()
    with running(daemon), daemon.client() as client:
        wait_for(lambda: client.responses.retrieve(started.id).status == "failed", 10,
                 "the dead response's lease to run out")
        failed = client.responses.retrieve(started.id)
        assert failed.error is not None and failed.error.code == "response_lost"  # type: ignore[comparison-overlap]
        assert client.responses.cancel(started.id).status == "failed"  # it ended so


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


def test_two_daemons_on_one_postgres_continue_each_others_state(
        tmp_path: Path, postgres: PostgresServer) -> None:
    url = postgres.new_url()
    daemons = []
    for name in ("a", "b"):
        port = free_port()
        (tmp_path / name).mkdir()
        (tmp_path / name / "fleet.toml").write_text(fleet_with(
            port, sim_engine(name, decode_us_per_token=0),
            f'backend = "postgres"\ndsn = "{url}"'))
        daemons.append(Process(tmp_path / name / "fleet.toml", port))
    a, b = daemons
    with running(b), b.client() as on_b:
        with running(a), a.client() as on_a:
            conversation = on_a.conversations.create(
                items=[{"type": "message", "role": "user", "content": "Remember 42."}])
            turn = on_a.responses.create(model="demo", input="What number?",
                                         conversation=conversation.id, max_output_tokens=4)
            first = on_a.responses.create(model="demo", input="hi", max_output_tokens=4)
            a.kill()
        items = [i.id for i in on_b.conversations.items.list(conversation.id, order="asc")]
        assert items[-1] == turn.output[0].id and len(items) == 3
        on_b.responses.create(model="demo", input="And now?", conversation=conversation.id,
                              max_output_tokens=4)
        assert len(list(on_b.conversations.items.list(conversation.id))) == 5
        assert on_b.responses.retrieve(first.id).id == first.id
        follow = on_b.responses.create(model="demo", input="more", previous_response_id=first.id,
                                       max_output_tokens=4)
        assert first.output[0].id in [i.id for i in on_b.responses.input_items.list(follow.id)]
        on_b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            on_b.responses.retrieve(first.id)


def test_workers_share_one_sqlite_file(model_dir: Path, tmp_path: Path) -> None:
    from tests.e2e.test_workers import worker_service

    extra = f'[frontend.responses]\nbackend = "sqlite"\npath = "{tmp_path / "r.db"}"\n'
    with worker_service(tmp_path, model_dir, 2, frontend_extra=extra) as (base, _, _):
        def post(path: str, body: dict[str, object]) -> dict[str, object]:
            answer = http.post(base + path, json=body)  # a connection of its own: any worker
            assert answer.status_code == 200, answer.text
            result: dict[str, object] = answer.json()
            return result

        ask = {"model": "demo", "max_output_tokens": 2}
        for _ in range(4):
            conversation = post("/v1/conversations", {})["id"]
            previous = None
            for turn in range(3):
                post("/v1/responses", {**ask, "input": f"turn {turn}",
                                       "conversation": conversation})
                previous = post("/v1/responses", {**ask, "input": "chain",
                                                  **({"previous_response_id": previous}
                                                     if previous else {})})["id"]
            listed = http.get(f"{base}/v1/conversations/{conversation}/items?limit=100").json()
            assert len(listed["data"]) == 6


def test_a_cancel_on_one_daemon_stops_a_background_response_running_on_another(
        tmp_path: Path, postgres: PostgresServer) -> None:
    url = postgres.new_url()
    daemons = []
    for name in ("a", "b"):
        port = free_port()
        (tmp_path / name).mkdir()
        (tmp_path / name / "fleet.toml").write_text(fleet_with(
            port, sim_engine(name, **SLOW), f'backend = "postgres"\ndsn = "{url}"'))
        daemons.append(Process(tmp_path / name / "fleet.toml", port))
    a, b = daemons
    with running(a), running(b), a.client() as on_a, b.client() as on_b:
        started = on_a.responses.create(model="demo", input="go", background=True,
                                        max_output_tokens=2000)  # 40 s of decoding
        assert on_b.responses.retrieve(started.id).status in ("queued", "in_progress")
        wait_for(lambda: bool(on_b.responses.retrieve(started.id).output), 10,
                 "the output so far to reach the other daemon through the database")
        stopped = on_b.responses.cancel(started.id)
        assert stopped.status == "cancelled"
        assert on_a.responses.retrieve(started.id).status == "cancelled"
