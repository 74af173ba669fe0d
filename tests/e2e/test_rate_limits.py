"""Per-tenant rate limits through the official clients: OpenAI's ``x-ratelimit-*`` headers
on every answer (a stream's head too) and ``openai.RateLimitError`` with ``retry-after`` past
the limit; Anthropic's on the Messages API; and across ``run --workers 2`` sharing over NATS,
the limit held within the slack the README documents.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.e2e.test_replicas import FAST, MEMORY_STORE
from tests.e2e.test_workers import _sharing as sharing
from tests.e2e.test_workers import worker_service
from tests.support.daemon import Daemon, fleet_text, running_daemon, sim_engine, wait_for
from tests.support.http import http, sdk2_http, sdk_http
from tests.support.metrics import sample
from tests.support.nats import nats_binary

#: each tenant (named by x-tenant) may send 3 requests a minute; "metered" has a tokens limit
TENANTS = """
[frontend.tenants]
header = "x-tenant"
requests_per_minute = 3

[[frontend.tenants.tenant]]
name = "metered"
requests_per_minute = 0
tokens_per_minute = 600

[[frontend.tenants.tenant]]
name = "leaving"
tokens_per_minute = 600
"""
DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(\d+(?:\.\d+)?)s|(\d+)ms")


def seconds(duration: str) -> float:
    """An OpenAI reset header's duration (``1m0s``, ``20ms``) in seconds."""
    parts = DURATION.fullmatch(duration)
    assert parts is not None, duration
    hours, minutes, whole, ms = parts.groups()
    if ms is not None:
        return int(ms) / 1000
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(whole)


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    text = fleet_text(model_dir, [sim_engine("e0", **FAST)], frontend_extra=TENANTS)
    with running_daemon(tmp_path_factory.mktemp("rate-limits"), text) as daemon:
        daemon.wait_serving(1)
        yield daemon


def client_of(daemon: Daemon, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                         default_headers={"x-tenant": tenant},
                         http_client=sdk_http())


ASK = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_openai_headers_on_every_answer_and_a_rate_limit_error_past_the_limit(
    daemon: Daemon,
) -> None:
    with client_of(daemon, "alice") as client:
        seen = []
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(**ASK)
            seen.append(raw.headers)
        stream = client.chat.completions.with_raw_response.create(**ASK, stream=True)
        seen.append(stream.headers)  # the head of a stream carries them
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream.parse()
                       if chunk.choices)
        assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["2", "1", "0"]
        for headers in seen:
            assert headers["x-ratelimit-limit-requests"] == "3"
            assert "x-ratelimit-limit-tokens" not in headers  # no tokens limit: not told
        resets = [seconds(h["x-ratelimit-reset-requests"]) for h in seen]
        assert 0 < resets[0] < resets[1] < resets[2] <= 60  # until the bucket is full again

        with pytest.raises(openai.RateLimitError) as over:
            client.chat.completions.create(**ASK)
        error = over.value
        assert (error.status_code, error.code, error.type) == (429, "rate_limit_exceeded",
                                                               "requests")
        assert "Rate limit reached on requests per min (RPM): Limit 3" in error.message
        assert 1 <= int(error.response.headers["retry-after"]) <= 20  # a request back in 20 s
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert error.response.headers["x-request-id"]

    with client_of(daemon, "bob") as client:  # another tenant: buckets of its own
        raw = client.completions.with_raw_response.create(model="demo", prompt="hi",
                                                          max_tokens=2)
        assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    scrape = http.get(daemon.url + "/metrics").text
    assert sample(scrape, "direct_frontend_rate_limited_total", limit="requests",
                  tenant="other") == 1


def test_a_tenants_tokens_count_its_prompt_at_once_and_its_output_when_it_ends(
    daemon: Daemon,
) -> None:
    def remaining(headers: httpx.Headers) -> int:
        return int(headers["x-ratelimit-remaining-tokens"])

    with client_of(daemon, "metered") as client:
        first = client.chat.completions.with_raw_response.create(
            **{**ASK, "max_tokens": 100})
        since = time.monotonic()
        usage = first.parse().usage
        assert first.headers["x-ratelimit-limit-tokens"] == "600"
        assert "x-ratelimit-limit-requests" not in first.headers  # 0: no requests limit
        assert remaining(first.headers) == 600 - usage.prompt_tokens  # the output comes later
        assert usage.completion_tokens == 100
        second = client.chat.completions.with_raw_response.create(**ASK)
        refilled = 10 * (time.monotonic() - since) + 1  # 10 tokens a second come back
        # the first one's output was taken when it ended, the second's prompt as it came
        taken = 600 - remaining(second.headers)
        assert 0 <= 2 * usage.prompt_tokens + 100 - taken <= refilled

        with pytest.raises(openai.RateLimitError) as too_large:
            client.completions.create(model="demo", prompt="hi " * 700, max_tokens=1)
        assert too_large.value.type == "tokens"
        assert "retry-after" not in too_large.value.response.headers  # it never fits

    view = http.get(daemon.url + "/fleet").json()["rate_limits"]
    assert view["tenants"]["metered"]["tokens"]["limit"] == 600
    assert view["tenants"]["metered"]["requests"] is None


def tokens_left(daemon: Daemon, tenant: str) -> int:
    """``tenant``'s tokens left as ``/fleet`` shows them (asking spends nothing)."""
    view = http.get(daemon.url + "/fleet").json()["rate_limits"]["tenants"][tenant]
    return int(view["tokens"]["remaining"])


def test_a_background_response_and_a_stream_its_client_left_pay_for_their_output(
    daemon: Daemon,
) -> None:
    def taken_since(left: int, since: float) -> float:
        """At least the tokens taken since ``left`` remained, net of the refill since
        ``since`` (10 a second), a moment before: the refill it counts is never less than
        the bucket's, and what a full bucket did not take in only adds to it."""
        return left + 10 * (time.monotonic() - since) - tokens_left(daemon, "leaving")

    with client_of(daemon, "leaving") as client:  # 600 tokens a minute
        since = time.monotonic()
        raw = client.responses.with_raw_response.create(
            model="demo", input="hi", max_output_tokens=200, background=True)
        left = int(raw.headers["x-ratelimit-remaining-tokens"])
        queued = raw.parse()
        wait_for(lambda: client.responses.retrieve(queued.id).status == "incomplete",
                 timeout=10, what="the background response to end (at max_output_tokens)")
        assert client.responses.retrieve(queued.id).usage.output_tokens == 200
        # its prompt was taken as it was accepted, its output as it ended
        wait_for(lambda: taken_since(left, since) >= 200, timeout=10,
                 what="the background response's output taken")

        since = time.monotonic()
        with client.chat.completions.with_streaming_response.create(
                **{**ASK, "max_tokens": 3000}, stream=True) as stream:
            left = int(stream.headers["x-ratelimit-remaining-tokens"])
            events = (line for line in stream.iter_lines() if line.startswith("data: "))
            for _ in range(30):  # 29 tokens at least (the first may carry the role alone)
                next(events)
        # the client hung up: what was generated until the engine heard of it is taken
        wait_for(lambda: taken_since(left, since) >= 29, timeout=10,
                 what="the abandoned stream's output taken")


def test_the_messages_api_gets_anthropics_headers_and_rate_limit_error(daemon: Daemon) -> None:
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0,
                             default_headers={"x-tenant": "carol"},
                             http_client=sdk2_http()) as client:
        for left in ("2", "1", "0"):
            raw = client.messages.with_raw_response.create(
                model="demo", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            assert raw.headers["anthropic-ratelimit-requests-remaining"] == left
            assert raw.headers["anthropic-ratelimit-requests-limit"] == "3"
            reset = time.strptime(raw.headers["anthropic-ratelimit-requests-reset"],
                                  "%Y-%m-%dT%H:%M:%SZ")
            assert reset >= time.gmtime(time.time() - 1)
            assert not any(name.startswith("x-ratelimit") for name in raw.headers)
        with pytest.raises(anthropic.RateLimitError) as over:
            client.messages.create(model="demo", max_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])
        assert over.value.body["error"]["type"] == "rate_limit_error"
        assert int(over.value.response.headers["retry-after"]) >= 1


# -- across run --workers 2, sharing over the parent's nats-server ------------------------------

#: the limit of each tenant in the workers' test: requests per minute
LIMIT = 8
WORKER_TENANTS = f"""
[frontend.tenants]
header = "x-tenant"
requests_per_minute = {LIMIT}
"""


def pinned(base: str) -> dict[str, httpx.Client]:
    """A keep-alive client on each worker (the kernel picks one per connection), by index."""
    clients: dict[str, httpx.Client] = {}
    for _ in range(40):
        client = httpx.Client(base_url=base, timeout=10)
        worker = client.get("/fleet").json()["replicas"]["replica"].split("-")[0]
        if worker in clients:
            client.close()
        else:
            clients[worker] = client
        if len(clients) == 2:
            return clients
    raise AssertionError("the kernel never gave a connection to both workers")


def completion(client: httpx.Client, tenant: str) -> httpx.Response:
    return client.post("/v1/completions", headers={"x-tenant": tenant},
                       json={"model": "demo", "prompt": "hi", "max_tokens": 1})


def heard(client: httpx.Client, tenant: str, remaining: int) -> bool:
    """The worker ``client`` is on sees ``tenant`` with at most ``remaining`` requests (its
    ``/fleet`` view, which spends nothing; its bucket is there once it has heard of it)."""
    view = client.get("/fleet").json()["rate_limits"]["tenants"].get(tenant)
    return view is not None and view["requests"]["remaining"] <= remaining


@pytest.mark.skipif(nats_binary() is None, reason="needs nats-server")
def test_across_two_workers_a_limit_holds_within_the_documented_slack(
    model_dir: Path, tmp_path: Path,
) -> None:
    tenants = WORKER_TENANTS + "".join(
        f'[[frontend.tenants.tenant]]\nname = "{name}"\n' for name in ("spent", "burst"))
    with worker_service(tmp_path, model_dir, 2, FAST,
                        frontend_extra=MEMORY_STORE + tenants) as (base, _parent, _path):
        wait_for(lambda: sharing(base), timeout=30, what="the workers linked")
        clients = pinned(base)
        try:
            first, second = clients["worker0"], clients["worker1"]
            # a tenant spends its whole minute on one worker ...
            started = time.monotonic()
            for left in range(LIMIT - 1, -1, -1):
                answer = completion(first, "spent")
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-ratelimit-remaining-requests"] == str(left)
            # ... the other hears it (within about one publish interval) ...
            wait_for(lambda: heard(second, "spent", 0), timeout=10,
                     what="the second worker to hear what the first spent")
            # ... and refuses that tenant too: one request comes back every 60/LIMIT s
            refill = int((time.monotonic() - started) * LIMIT / 60)
            answers = [completion(second, "spent") for _ in range(LIMIT)]
            assert sum(a.status_code == 200 for a in answers) <= refill
            refused = next(a for a in answers if a.status_code == 429)
            assert refused.json()["error"]["type"] == "requests"
            assert int(refused.headers["retry-after"]) >= 1

            # A burst from idle on both at once: each worker may spend its whole bucket before
            # it hears the other (README: at most the number of processes times the limit).
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(4 * LIMIT) as pool:
                statuses = list(pool.map(lambda _: fresh_completion(base, "burst").status_code,
                                         range(4 * LIMIT)))
            refill = int((time.monotonic() - started) * LIMIT / 60) * 2
            served = statuses.count(200)
            assert statuses.count(429) == len(statuses) - served
            assert LIMIT <= served <= 2 * LIMIT + refill
        finally:
            for client in clients.values():
                client.close()


def fresh_completion(base: str, tenant: str) -> httpx.Response:
    """A completion on a connection of its own (the kernel picks its worker)."""
    with httpx.Client(base_url=base, timeout=30) as client:
        return client.post("/v1/completions", headers={"x-tenant": tenant, "connection": "close"},
                           json={"model": "demo", "prompt": "hi", "max_tokens": 1})
