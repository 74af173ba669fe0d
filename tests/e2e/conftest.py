"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.daemon import Daemon
from tests.support.models import openai_client


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    """The official client on the module's ``daemon`` fixture (modules may define their own)."""
    with openai_client(daemon) as client:
        yield client
