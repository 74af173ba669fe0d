"""Shared fixtures."""

from __future__ import annotations

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
