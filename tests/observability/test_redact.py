"""Credentials out of URLs as they are shown: user info and credential-looking query values."""

from __future__ import annotations

import logging
import socket
import sys

import pytest

from direct_frontend.observability.redact import REDACTED, SecretFilter, redact_url, url_secrets
from direct_frontend.observability.tracing import Tracing

SECRET = "otlp-s3cret-token"


@pytest.mark.parametrize(("url", "shown"), [
    ("nats://user:pa55word@nats.example:4222", f"nats://{REDACTED}@nats.example:4222"),
    ("nats://s3cr3t-token@10.0.0.1:4222", f"nats://{REDACTED}@10.0.0.1:4222"),
    ("https://u:p@ss@otel.example/v1/traces", f"https://{REDACTED}@otel.example/v1/traces"),
    ("https://otel.example/v1/traces?api_key=abc123&region=eu",
     f"https://otel.example/v1/traces?api_key={REDACTED}&region=eu"),
    ("https://otel.example/x?X-Amz-Signature=f00&access_token=t0k#frag",
     f"https://otel.example/x?X-Amz-Signature={REDACTED}&access_token={REDACTED}#frag"),
    ("https://u:p@otel.example/?Token=zz", f"https://{REDACTED}@otel.example/?Token={REDACTED}"),
])
def test_credentials_are_replaced_and_the_rest_is_kept(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", [
    "nats://127.0.0.1:4222", "http://127.0.0.1:4318/v1/traces", "grpc://[::1]:50051",
    "https://otel.example/v1/traces?region=eu&flag", "not a url at all", "", "a/b@c",
])
def test_urls_without_credentials_are_unchanged(url: str) -> None:
    assert redact_url(url) == url


def test_url_secrets_are_what_redact_url_hides() -> None:
    assert url_secrets("https://otel:pa%24s@h/v1/traces?api_key=t0k&region=eu") == {
        "otel:pa%24s", "otel:pa$s", "pa%24s", "pa$s", "t0k"}
    assert url_secrets("nats://s3cr3t@h:4222") == {"s3cr3t"}
    assert url_secrets("http://127.0.0.1:4318/v1/traces") == set()


def test_the_secret_filter_cleans_the_message_and_the_traceback() -> None:
    try:
        raise ConnectionError("Max retries exceeded with url: /v1/traces?api_key=t0k-secret")
    except ConnectionError:
        record = logging.LogRecord("otel", logging.WARNING, __file__, 1, "error %s",
                                   ("t0k-secret",), sys.exc_info())
    plain = logging.LogRecord("otel", logging.INFO, __file__, 1, "fine %s", ("x",), None)
    secret_filter = SecretFilter({"t0k-secret"})
    assert secret_filter.filter(record) and secret_filter.filter(plain)
    assert record.exc_info is None and "t0k-secret" not in record.getMessage()
    assert record.getMessage().startswith(f"error {REDACTED}\nTraceback")
    assert f"url: /v1/traces?api_key={REDACTED}" in record.getMessage()
    assert (plain.msg, plain.args) == ("fine %s", ("x",))  # untouched


def test_the_otlp_exporters_own_errors_never_show_the_endpoints_credentials(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector down: the exporter's retry warning quotes the path and query it sent."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2")  # one retry, then it gives up
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    tracing = Tracing(f"http://otel:pw-{SECRET}@127.0.0.1:{port}/v1/traces?api_key={SECRET}",
                      "test", 1.0)
    with caplog.at_level(logging.WARNING):
        tracing.begin("/v1/completions", [], "req-1").end(200)
        tracing.shutdown()  # exports, fails, retries once
    assert f"/v1/traces?api_key={REDACTED}" in caplog.text
    assert SECRET not in caplog.text
