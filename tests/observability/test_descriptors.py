"""Descriptor count and limit (observability/descriptors.py); limits set in a child process."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys

import pytest

from direct_frontend.observability import descriptors

SOFT, HARD = resource.getrlimit(resource.RLIMIT_NOFILE)
RAISE = """
import json, logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
from direct_frontend.observability.descriptors import raise_soft_limit
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
returned = raise_soft_limit()
print(json.dumps([returned, *resource.getrlimit(resource.RLIMIT_NOFILE)]))
"""


def _raise_in_child(soft: int, hard: int) -> tuple[list[int], str]:
    """Start a process with these limits, and raise its soft limit there."""
    done = subprocess.run(
        [sys.executable, "-c", RAISE, str(soft), str(hard)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout), done.stderr


@pytest.mark.skipif(HARD == resource.RLIM_INFINITY or HARD < 512, reason="needs a hard limit")
def test_the_soft_limit_is_raised_to_the_hard_one_and_logged() -> None:
    (returned, soft, hard), log = _raise_in_child(256, HARD)
    assert returned == soft == hard == HARD
    assert f"raised the open-file limit (RLIMIT_NOFILE) from 256 to {HARD}" in log


def test_a_low_hard_limit_is_a_warning() -> None:
    (returned, soft, hard), log = _raise_in_child(200, 300)
    assert returned == soft == hard == 300
    assert "WARNING the open-file limit is only 300" in log


def test_open_count_follows_sockets_opened_and_closed() -> None:
    before = descriptors.open_count()
    with socket.socket() as a, socket.socket() as b:
        assert a.fileno() != b.fileno()
        assert descriptors.open_count() == before + 2
    assert descriptors.open_count() == before


def test_soft_limit_is_the_rlimit() -> None:
    assert descriptors.soft_limit() == (float("inf") if SOFT == resource.RLIM_INFINITY else SOFT)
