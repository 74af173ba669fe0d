"""Fixtures of the control-plane tests: the Kubernetes API server double."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.kube import ApiServer


@pytest.fixture()
def api() -> Iterator[ApiServer]:
    """The API server double on 127.0.0.1, with bookmarks every 50 ms."""
    server = ApiServer(bookmark_interval_s=0.05).start()
    try:
        yield server
    finally:
        server.stop()
