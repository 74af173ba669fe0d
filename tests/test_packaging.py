"""What the wheel installs: our package alone, and every module it imports declared."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_installs_no_top_level_package_but_ours() -> None:
    """A top-level ``protos`` (or any other) would collide with another distribution's."""
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(ROOT), include=include)
    assert packages and {name.split(".")[0] for name in packages} == {"direct_frontend"}
    assert "direct_frontend.protos" in packages


def test_every_third_party_module_the_package_imports_is_a_declared_dependency() -> None:
    declared = {_name(spec) for spec in PYPROJECT["project"]["dependencies"]}
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        declared |= {_name(spec) for spec in extra}
    imported: set[str] = set()
    for path in (ROOT / "direct_frontend").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    ours_or_stdlib = {"direct_frontend", *sys.stdlib_module_names, "__future__"}
    distribution = {"google": "protobuf", "zmq": "pyzmq", "yaml": "pyyaml", "nats": "nats-py",
                    "opentelemetry": "opentelemetry-api", "hypercorn": "hypercorn", "PIL": "pillow"}
    missing = sorted(module for module in imported - ours_or_stdlib
                     if distribution.get(module, module).replace("_", "-") not in declared)
    assert missing == []


def _name(spec: str) -> str:
    for stop in "<>=[;! ":
        spec = spec.split(stop)[0]
    return spec.strip().lower().replace("_", "-")
