"""Credentials out of URLs as they are shown: user info and credential-looking query values."""

from __future__ import annotations

import pytest

from direct_frontend.observability.redact import REDACTED, redact_url


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
