"""Every ``direct-frontend check`` command an example fleet's header shows runs as written.

A command may need the model under ``/models`` that the example names (a real deployment
has it); then the header must also show the ``--no-tokenizer`` form, which runs anywhere.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.toml"))
DAEMON = str(Path(sys.executable).with_name("direct-frontend"))
#: a header's command line: "#   [VAR=value ...] direct-frontend check ..."
COMMAND = re.compile(r"^#\s+((?:[A-Z_]+=\S+\s+)*)direct-frontend (check .*?)(?:\s+#.*)?$", re.M)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_the_headers_check_commands_run_as_written(example: Path) -> None:
    commands = [(dict(pair.split("=", 1) for pair in match[1].split()), shlex.split(match[2]))
                for match in COMMAND.finditer(example.read_text())]
    for env, argv in commands:
        done = subprocess.run([DAEMON, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={**os.environ, **env})
        if done.returncode == 0:
            continue
        needs_model = "not a model directory" in done.stderr and "/models/" in done.stderr
        assert needs_model, f"{' '.join(argv)}\n{done.stderr}"
        assert any("--no-tokenizer" in other for _, other in commands), (
            f"{example.name}: {' '.join(argv)} needs /models; show the --no-tokenizer form too")
