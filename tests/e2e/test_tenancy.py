"""Two API keys on one daemon: what one stores the other can neither see nor touch, and one
key's flood of background work leaves the other's requests and records alone.

Every call goes through the official client (or raw HTTP where the client has no verb) with
the key it would use; the engine decodes a token every 20 ms, so background work runs while
the test looks at it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.support.daemon import Daemon, wait_for
from tests.support.http import http, sdk_http
from tests.support.metrics import sample
from tests.support.models import engine_table, scripted_daemon

SLOW = "decode_us_per_token = 20000\nprefill_us_per_token = 0\neos_probability = 0.0"
ALICE, BOB = "alice-key-0f1e2d3c4b5a", "bob-key-a5b4c3d2e1f0"
SETTINGS = f"""
[frontend.auth]
api_keys = ["{ALICE}", "{BOB}"]

[frontend.limits]
max_in_flight = 8

[[frontend.tenants.tenant]]
api_key_env = "TENANCY_ALICE_KEY"
name = "alice"
priority = true

[frontend.responses]
max_bytes = 60000
max_background_per_owner = 4

[[model]]
name = "agent"
"""


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    os.environ["TENANCY_ALICE_KEY"] = ALICE  # the fleet file names her tenant by its variable
    try:
        with scripted_daemon(model_dir, tmp_path_factory.mktemp("tenancy"), SETTINGS,
                             engine_table("sim", "vllm", "agent", SLOW), {}) as daemon:
            yield daemon
    finally:
        del os.environ["TENANCY_ALICE_KEY"]


@contextlib.contextmanager
def client_of(daemon: Daemon, key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0,
                       http_client=sdk_http()) as client:
        yield client


def headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def status(response: Any) -> str:
    return str(response.status)


def test_another_key_gets_not_found_for_every_stored_and_background_operation(
    daemon: Daemon,
) -> None:
    with client_of(daemon, ALICE) as alice, client_of(daemon, BOB) as bob:
        stored = alice.responses.create(model="agent", input="hi", max_output_tokens=4)
        running = alice.responses.create(model="agent", input="go on", background=True,
                                         max_output_tokens=300)
        for response_id in (stored.id, running.id):
            with pytest.raises(openai.NotFoundError) as missing:
                bob.responses.retrieve(response_id)
            with pytest.raises(openai.NotFoundError) as never:  # the same answer as no such id
                bob.responses.retrieve(response_id[:-4] + "0000")
            assert str(missing.value).replace(response_id, "") == str(never.value).replace(
                response_id[:-4] + "0000", "")
            with pytest.raises(openai.NotFoundError):
                bob.responses.input_items.list(response_id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.cancel(response_id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.delete(response_id)
            followed = http.get(f"{daemon.url}/v1/responses/{response_id}",
                                 params={"stream": "true"}, headers=headers(BOB))
            assert followed.status_code == 404
            with pytest.raises(openai.BadRequestError) as continued:
                bob.responses.create(model="agent", input="more", max_output_tokens=4,
                                     previous_response_id=response_id)
            assert continued.value.code == "previous_response_not_found"
        # alice still has all of it, running or not
        assert alice.responses.retrieve(stored.id).output_text == stored.output_text
        assert status(alice.responses.retrieve(running.id)) in ("queued", "in_progress")
        follow = alice.responses.create(model="agent", input="more", max_output_tokens=4,
                                        previous_response_id=stored.id)
        assert follow.previous_response_id == stored.id and follow.output_text
        assert status(alice.responses.cancel(running.id)) == "cancelled"
        alice.responses.delete(stored.id)


def test_a_flood_of_background_work_leaves_another_keys_requests_and_records_alone(
    daemon: Daemon,
) -> None:
    """Alice asks for 40 background responses at once, each a long answer; bob's stored
    conversation stays, and his foreground requests are admitted while hers run."""
    with client_of(daemon, ALICE) as alice, client_of(daemon, BOB) as bob:
        kept = bob.responses.create(model="agent", input="remember me", max_output_tokens=8)
        started: list[str] = []
        refused: list[httpx.Response] = []

        async def flood() -> None:
            async with httpx.AsyncClient(base_url=daemon.url, headers=headers(ALICE),
                                         timeout=30) as client:
                async def one() -> None:
                    answer = await client.post("/v1/responses", json={
                        "model": "agent", "input": "write a lot", "background": True,
                        "max_output_tokens": 3000})
                    if answer.status_code == 200:
                        started.append(answer.json()["id"])
                    else:
                        refused.append(answer)

                async with trio.open_nursery() as nursery:
                    for _ in range(40):
                        nursery.start_soon(one)

        trio.run(flood)
        assert len(started) == 4 and len(refused) == 36  # at most 4 per key at once
        assert all(r.status_code == 429 and "max_background_per_owner" in r.text
                   for r in refused)
        wait_for(lambda: all(status(alice.responses.retrieve(i)) == "in_progress"
                             for i in started), timeout=20, what="her responses running")
        for _ in range(3):  # four slots are hers; the other four stay for bob
            answers = _concurrently(daemon, BOB, 4)
            assert [a.status_code for a in answers] == [200] * 4
        # her logs outgrow her share of the store: hers are stopped (and the oldest of what
        # is left of them leave), bob's record stays
        def ended(response_id: str) -> str:
            answer = http.get(f"{daemon.url}/v1/responses/{response_id}",
                               headers=headers(ALICE))
            return "gone" if answer.status_code == 404 else str(answer.json()["status"])

        wait_for(lambda: {ended(i) for i in started} <= {"failed", "gone"}, timeout=60,
                 what="her responses stopped")
        failed = [alice.responses.retrieve(i) for i in started if ended(i) == "failed"]
        assert failed and all(r.error is not None and r.error.code == "response_too_large"
                              for r in failed)
        assert bob.responses.retrieve(kept.id).output_text == kept.output_text
        more = bob.responses.create(model="agent", input="and now?", max_output_tokens=4,
                                    previous_response_id=kept.id)
        assert more.previous_response_id == kept.id and more.output_text


def _concurrently(daemon: Daemon, key: str, count: int) -> list[httpx.Response]:
    answers: list[httpx.Response] = []

    async def send() -> None:
        async with httpx.AsyncClient(base_url=daemon.url, headers=headers(key),
                                     timeout=10) as client:
            async def one() -> None:
                answers.append(await client.post("/v1/chat/completions", json={
                    "model": "agent", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "quick"}]}))

            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(one)

    trio.run(send)
    return answers


def test_every_answer_names_its_request_and_no_cursor_is_a_500(daemon: Daemon) -> None:
    for method, path, code in (("GET", "/nowhere", 404), ("GET", "/v1/chat/completions", 405),
                               ("GET", "/v1/models", 401)):
        answer = http.request(method, daemon.url + path)
        assert answer.status_code == code
        assert len(answer.headers["x-request-id"]) == 16
    with client_of(daemon, ALICE) as alice:
        made = alice.responses.create(model="agent", input="hi", max_output_tokens=2)
    url = f"{daemon.url}/v1/responses/{made.id}"
    for params in ({"stream": "true", "starting_after": "9" * 5000},
                   {"stream": "true", "starting_after": "\u00b2"},
                   {"stream": "true", "starting_after": "-2"}):
        answer = http.get(url, params=params, headers=headers(ALICE))
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "starting_after"
    for limit in ("9" * 5000, "\u00b2", "0", "101"):
        answer = http.get(url + "/input_items", params={"limit": limit}, headers=headers(ALICE))
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit"


def test_a_keys_burst_does_not_queue_another_key_behind_it(daemon: Daemon) -> None:
    """Alice holds every slot and queues 32 more streams; each of bob's requests goes in at
    the next free slot, not after her backlog (it ends while most of hers still wait: in one
    queue first come, first served, none of hers would)."""
    served = daemon.control.models.get("agent")
    assert served is not None
    admission = served.settings.admission

    def waiting() -> int:
        return int(daemon.run_sync(lambda: admission.waiting))

    body = {"model": "agent", "max_tokens": 30, "stream": True,
            "messages": [{"role": "user", "content": "go on"}]}
    done: list[int] = []

    async def flood() -> None:
        async with httpx.AsyncClient(base_url=daemon.url, headers=headers(ALICE),
                                     timeout=60) as client:
            async def one() -> None:
                async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                    async for _ in reply.aiter_bytes():
                        pass
                    done.append(reply.status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(40):
                    nursery.start_soon(one)

    thread = threading.Thread(target=trio.run, args=(flood,))
    thread.start()
    try:
        wait_for(lambda: waiting() >= 30, timeout=20, what="her backlog")
        for _ in range(3):
            (answer,) = _concurrently(daemon, BOB, 1)
            assert answer.status_code == 200
            assert waiting() >= 6  # his went in ahead of most of hers
    finally:
        thread.join(60)
    assert done == [200] * 40


def test_every_answer_reports_the_service_tier_it_was_served_at(daemon: Daemon) -> None:
    """Alice may have priority and gets it; bob asks for it and is served (and told) default;
    flex is flex on chat, completions and Responses; a tier OpenAI does not have is a 400
    naming the field. /metrics counts them by tenant name (bob's key is "other")."""
    messages: Any = [{"role": "user", "content": "hi"}]
    with client_of(daemon, ALICE) as alice, client_of(daemon, BOB) as bob:
        chat = alice.chat.completions.create(model="agent", messages=messages, max_tokens=2,
                                             service_tier="priority")
        assert chat.service_tier == "priority"
        chunks = list(alice.chat.completions.create(
            model="agent", messages=messages, max_tokens=2, service_tier="priority",
            stream=True, stream_options={"include_usage": True}))
        assert {chunk.service_tier for chunk in chunks} == {"priority"}
        asked = bob.chat.completions.create(model="agent", messages=messages, max_tokens=2,
                                            service_tier="priority")
        assert asked.service_tier == "default"
        plain = bob.chat.completions.create(model="agent", messages=messages, max_tokens=2)
        assert plain.service_tier == "default"
        legacy = bob.completions.create(model="agent", prompt="hi", max_tokens=2,
                                        extra_body={"service_tier": "flex"})
        assert legacy.model_extra == {"service_tier": "flex"}
        response = bob.responses.create(model="agent", input="hi", max_output_tokens=2,
                                        service_tier="flex", store=False)
        assert response.service_tier == "flex"
        with pytest.raises(openai.BadRequestError) as bad:
            bob.chat.completions.create(model="agent", messages=messages, max_tokens=2,
                                        extra_body={"service_tier": "gold"})
        assert bad.value.param == "service_tier"
    text = http.get(daemon.url + "/metrics").text
    assert sample(text, "direct_frontend_tenant_admitted_total", model="agent",
                  tenant="alice", tier="priority") == 2
    assert sample(text, "direct_frontend_tenant_admitted_total", model="agent",
                  tenant="other", tier="flex") == 2
    assert ALICE not in text and BOB not in text
