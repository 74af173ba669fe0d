"""End to end: ``background: true`` Responses with the official client, polled, followed, cancelled.

The engine decodes a token every 20 ms, so a long answer is still running
while the test looks at it; every wait polls the state it needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.daemon import Daemon, wait_for
from tests.support.http import http
from tests.support.models import (
    engine_table,
    openai_client,
    scripted_daemon,
    simulators,
)

SLOW = "decode_us_per_token = 20000\nprefill_us_per_token = 0\neos_probability = 0.0"
ANSWER = "It is sunny in Zürich, and it will stay so all week."
SCRIPTS = {"[weather]": ANSWER}


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    models = '[[model]]\nname = "agent"\n'
    with scripted_daemon(model_dir, tmp_path_factory.mktemp("background"), models,
                         engine_table("sim", "vllm", "agent", SLOW), SCRIPTS) as daemon:
        yield daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai_client(daemon) as client:
        yield client


def engine(daemon: Daemon) -> Any:
    return simulators(daemon)["sim"]


def running_metric(daemon: Daemon) -> float:
    scrape = http.get(daemon.url + "/metrics").text
    line = next(line for line in scrape.splitlines()
                if line.startswith("direct_frontend_responses_background "))
    return float(line.split()[1])


def poll(client: openai.OpenAI, response_id: str, until: Any) -> Any:
    """The response once ``until`` holds of it (polled as a client polls)."""
    seen: list[Any] = []

    def check() -> bool:
        seen[:] = [client.responses.retrieve(response_id)]
        return bool(until(seen[0]))

    wait_for(check, timeout=30, what=f"response {response_id}")
    return seen[0]


def test_a_background_response_is_answered_at_once_and_polled_to_its_end(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    queued = client.responses.create(model="agent", input="Weather? [weather]", background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = poll(client, queued.id, lambda r: r.status not in ("queued", "in_progress"))
    assert done.status == "completed" and done.background is True
    assert done.output_text == ANSWER
    foreground = client.responses.create(model="agent", input="Weather? [weather]")
    assert foreground.background is False
    assert done.usage is not None and foreground.usage is not None
    assert done.usage.output_tokens == foreground.usage.output_tokens
    wait_for(lambda: running_metric(daemon) == 0, what="the background gauge to drop")
    # a finished one cancels to itself, as often as asked
    assert client.responses.cancel(queued.id).status == "completed"


def test_a_running_response_shows_its_output_so_far_and_a_cancel_reaches_the_engine(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    sim = engine(daemon)
    aborts = sim.stats.aborts_received + sim.stats.cancellations
    made = client.responses.create(model="agent", input="Go on and on.", background=True,
                                   max_output_tokens=2000)
    running = poll(client, made.id, lambda r: r.status == "in_progress" and r.output_text)
    assert running.output[0].status == "in_progress"
    assert running_metric(daemon) == 1
    cancelled = client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert cancelled.output_text.startswith(running.output_text)  # nothing lost, nothing new
    wait_for(lambda: sim.stats.aborts_received + sim.stats.cancellations > aborts,
             what="the engine to hear the cancel")
    assert cancelled.usage is not None and cancelled.usage.output_tokens > 0  # what it used
    again = client.responses.cancel(made.id)
    assert again.status == "cancelled" and again.output_text == cancelled.output_text
    assert client.responses.retrieve(made.id).status == "cancelled"
    assert running_metric(daemon) == 0
    assert sim.stats.running == 0


def test_a_streamed_background_response_resumes_where_the_client_left(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    """The first connection drops after a few events; the generation goes on, and the
    second connection takes up after the last event seen: every event once, in order."""
    seen: list[dict[str, Any]] = []
    body = {"model": "agent", "input": "Weather? [weather]", "background": True,
            "stream": True}
    with http.stream("POST", daemon.url + "/v1/responses", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
                if sum(e["type"] == "response.output_text.delta" for e in seen) == 3:
                    break  # the client goes away mid-answer
    response_id = seen[0]["response"]["id"]
    assert [e["type"] for e in seen[:2]] == ["response.created", "response.queued"]
    rest = list(client.responses.retrieve(response_id, stream=True,
                                          starting_after=seen[-1]["sequence_number"]))
    numbers = [e["sequence_number"] for e in seen] + [e.sequence_number for e in rest]
    assert numbers == list(range(len(numbers)))
    assert rest[-1].type == "response.completed"
    text = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
    text += "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == ANSWER == rest[-1].response.output_text

    # once ended, the whole log is there to read again, from any point
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(numbers)))
    last_but_one = len(numbers) - 2
    tail = list(client.responses.retrieve(response_id, stream=True, starting_after=last_but_one))
    assert [e.type for e in tail] == ["response.completed"]


def test_a_background_response_made_without_stream_can_be_followed(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    made = client.responses.create(model="agent", input="Weather? [weather]", background=True)
    events = list(client.responses.retrieve(made.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ANSWER


def test_what_cannot_be_run_or_cancelled_in_the_background_is_a_clear_error(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as no_store:
        client.responses.create(model="agent", input="hi", background=True, store=False)
    assert no_store.value.body["param"] == "background"  # type: ignore[index]
    foreground = client.responses.create(model="agent", input="Weather? [weather]")
    with pytest.raises(openai.BadRequestError) as not_background:
        client.responses.cancel(foreground.id)
    assert "background" in not_background.value.message
    reply = http.get(f"{daemon.url}/v1/responses/{foreground.id}", params={"stream": "true"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_00000000nothing")
    bad = http.get(f"{daemon.url}/v1/responses/{foreground.id}",
                    params={"stream": "true", "starting_after": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"


def test_a_background_response_that_waits_too_long_for_a_slot_fails_as_rate_limited(
    model_dir: Path, tmp_path: Path
) -> None:
    models = ('[frontend.limits]\nmax_in_flight = 1\nqueue_timeout_s = 1.0\n\n'
              '[[model]]\nname = "agent"\n')
    with scripted_daemon(model_dir, tmp_path, models, engine_table("sim", "vllm", "agent", SLOW),
                         SCRIPTS) as daemon, openai_client(daemon) as client:
        first = client.responses.create(model="agent", input="Go on.", background=True,
                                        max_output_tokens=2000)
        poll(client, first.id, lambda r: r.status == "in_progress")  # it holds the one slot
        second = client.responses.create(model="agent", input="Me too.", background=True)
        failed = poll(client, second.id, lambda r: r.status not in ("queued", "in_progress"))
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "rate_limit_exceeded"
        assert client.responses.cancel(first.id).status == "cancelled"
