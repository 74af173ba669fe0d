"""Shared fixtures, and what lets the suite run in parallel (pytest-xdist, ``-n`` in
pyproject's addopts): every worker process has its own state directory (its own
``tmp_path_factory``), its own ports (tests/support/daemon.py ``free_port``) and its own
servers (nats-server, PostgreSQL), so workers share nothing but the machine."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest


def _compile_once() -> None:
    """Where the environment says not to write bytecode beside the sources
    (``PYTHONDONTWRITEBYTECODE``), it goes to a cache folder of its own instead, for this
    process and the ones it starts: else every worker and every daemon the suite starts
    compiles the package again, and pytest rewrites every test module again each run (a
    tenth of the suite's CPU time). The tree is left as the environment wants it."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return
    prefix = str(Path(tempfile.gettempdir()) / f"direct-frontend-pycache-{os.getuid()}")
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


_compile_once()

from direct_frontend.text.demo_model import build_model_dir  # noqa: E402
from direct_frontend.text.model_dir import TextModel  # noqa: E402
from tests.support.order import longest_first  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built demo model directory (byte-level BPE, ChatML template)."""
    return build_model_dir(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def text_model(model_dir: Path) -> TextModel:
    """The demo model loaded once; TextModel is immutable, so sharing is safe."""
    return TextModel.load(model_dir)


@pytest.fixture(scope="session", autouse=True)
def state_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The daemons' state (a fleet file that names no store keeps it in SQLite there): one
    directory of the run's own (of the worker's own, in parallel), never the user's."""
    directory = tmp_path_factory.mktemp("state")
    before = os.environ.get("STATE_DIRECTORY")
    os.environ["STATE_DIRECTORY"] = str(directory)
    yield directory
    if before is None:
        os.environ.pop("STATE_DIRECTORY", None)
    else:
        os.environ["STATE_DIRECTORY"] = before


def _sendable(text: str) -> str:
    """``text`` as UTF-8 can carry it: a worker's report crosses to the controller as
    UTF-8, and a lone surrogate (a test of undecodable input logs one) would end the worker."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[
        None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    report.sections = [(title, _sendable(text)) for title, text in report.sections]
    if report.longrepr is not None:
        shown = str(report.longrepr)
        if _sendable(shown) != shown:
            report.longrepr = _sendable(shown)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that take longest run first, so the workers finish together
    (tests/support/order.py; pyproject's addopts keep xdist from reordering them)."""
    items[:] = longest_first(items)
