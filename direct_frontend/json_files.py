"""A model directory's JSON files (tokenizer, model and processor configs), read as objects."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """The JSON object ``path`` holds; ``error`` naming the file if it is missing, unreadable,
    or holds another JSON value."""
    if not path.is_file():
        raise error(f"{path}: file missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
