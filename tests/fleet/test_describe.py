"""How a fleet is shown (``check``, ``check --json``, ``/fleet``, the log): never a credential."""

from __future__ import annotations

import json
import logging
import textwrap
import types
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from direct_frontend import daemon
from direct_frontend.control.replicas import LinkNews, ReplicaLink
from direct_frontend.fleet.describe import describe_fleet, to_jsonable
from direct_frontend.fleet.load import FleetError, parse_fleet
from direct_frontend.routing.peers import PlacementShare
from tests.support.sim import run_trio

NATS_PASSWORD = "nats-pa55word-123"
OTLP_PASSWORD = "otlp-pa55word-456"
OTLP_TOKEN = "otlp-query-token-789"
SECRETS = (NATS_PASSWORD, OTLP_PASSWORD, OTLP_TOKEN)

FLEET = textwrap.dedent(f"""\
    [frontend]
    served_model_name = "demo"
    tokenizer = "m"

    [frontend.tracing]
    otlp_endpoint = "https://otel:{OTLP_PASSWORD}@otel.example:4318/v1/traces?api_key={OTLP_TOKEN}"

    [frontend.replicas]
    nats = "nats://router:{NATS_PASSWORD}@nats.example:4222"

    [[engine]]
    url = "grpc://10.0.0.1:50051"
    kind = "sglang"
    """)


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text


def test_credentials_in_urls_reach_no_output(caplog: pytest.LogCaptureFixture) -> None:
    fleet = parse_fleet(FLEET, Path("fleet.toml"))
    text, shown = describe_fleet(fleet), json.dumps(to_jsonable(fleet))
    assert_no_secret(text)  # check
    assert_no_secret(shown)  # check --json, and the "fleet" of GET /fleet
    assert "share over nats://<redacted>@nats.example:4222" in text
    assert "https://<redacted>@otel.example:4318/v1/traces?api_key=<redacted>" in text
    # the reload's own diff still sees the real values (a rotated password is a change)
    assert NATS_PASSWORD in str(to_jsonable(fleet, redact=False))
    # the "replicas" of GET /fleet, and the log lines of the link and of tracing at start
    stub: Any = types.SimpleNamespace(fault_listeners=[])
    link = ReplicaLink(fleet.frontend.replicas, stub, PlacementShare(), LinkNews(),
                       replica_id="r1")
    status = cast(dict[str, Any], link.status())
    assert status["nats"] == "nats://<redacted>@nats.example:4222"
    with caplog.at_level(logging.INFO):
        tracing = daemon._open_tracing(fleet.frontend.tracing)
        assert tracing is not None
        tracing.shutdown()
    assert "spans go to https://<redacted>@otel.example" in caplog.text
    assert_no_secret(caplog.text)


def test_the_replica_link_logs_its_nats_url_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = parse_fleet(FLEET.replace("nats.example:4222", "127.0.0.1:1"), Path("fleet.toml"))
    stub: Any = types.SimpleNamespace(fault_listeners=[])
    link = ReplicaLink(fleet.frontend.replicas, stub, PlacementShare(), LinkNews(),
                       replica_id="r1")
    with caplog.at_level(logging.INFO):
        # nothing listens there: the client retries until its time is up (on a mock clock)
        assert not run_trio(link._connect, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "cannot reach NATS at nats://<redacted>@127.0.0.1:1" in caplog.text
    assert_no_secret(caplog.text)


def test_a_url_the_loader_refuses_is_quoted_without_its_credentials() -> None:
    text = FLEET.replace("grpc://10.0.0.1:50051", f"grpc://u:{NATS_PASSWORD}@10.0.0.1:50051")
    text = text.replace("https://otel:", "ftp://otel:")
    with pytest.raises(FleetError) as caught:
        parse_fleet(text, Path("fleet.toml"))
    message = str(caught.value)
    assert "engine[1].url: 'grpc://<redacted>@10.0.0.1:50051' is not a valid URL" in message
    assert "frontend.tracing.otlp_endpoint: 'ftp://<redacted>@otel.example" in message
    assert_no_secret(message)
