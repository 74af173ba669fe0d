"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from direct_frontend.text.demo_model import build_model_dir
from direct_frontend.text.model_dir import TextModel


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
    directory of the run's own, never the user's."""
    directory = tmp_path_factory.mktemp("state")
    before = os.environ.get("STATE_DIRECTORY")
    os.environ["STATE_DIRECTORY"] = str(directory)
    yield directory
    if before is None:
        os.environ.pop("STATE_DIRECTORY", None)
    else:
        os.environ["STATE_DIRECTORY"] = before
