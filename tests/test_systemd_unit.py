"""The systemd unit and docs/systemd.md's install steps give the service what it must read.

The install block of docs/systemd.md is read as a small shell program: ``useradd`` makes a
user (and its group), ``install`` makes directories and files with a mode, owner and group.
The POSIX permission rule is then applied to the result for the unit's ``User=``: search
(``x``) on every directory above a path, read on the path itself; the owner's bits if it
owns the path, else the group's if it is in the path's group, else the others'. That is what
the kernel decides when the daemon opens its fleet file, without needing root or a real
systemd here. ``systemd-analyze`` (when installed) then checks the unit file itself.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "config" / "direct-frontend.service"
DOC = ROOT / "docs" / "systemd.md"


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    mode: int
    owner: str
    group: str


@dataclasses.dataclass(slots=True)
class Tree:
    """What the install steps leave behind: paths, and the users they created."""

    nodes: dict[PurePosixPath, Node]
    groups_of: dict[str, set[str]]  # user -> the groups it is in

    def can_read(self, user: str, path: str) -> bool:
        """Whether ``user`` may open ``path`` for reading (a directory: list it)."""
        target = PurePosixPath(path)
        if any(p not in self.nodes for p in (target, *target.parents)):
            return False  # never made
        if user == "root":
            return True
        if not all(self._allows(user, directory, 0o1) for directory in target.parents):
            return False
        return self._allows(user, target, 0o5 if self._is_dir(target) else 0o4)

    def _is_dir(self, path: PurePosixPath) -> bool:
        return any(other.parent == path for other in self.nodes)

    def _allows(self, user: str, path: PurePosixPath, want: int) -> bool:
        node = self.nodes[path]
        if node.owner == user:
            bits = node.mode >> 6
        elif node.group in self.groups_of.get(user, set()):
            bits = node.mode >> 3
        else:
            bits = node.mode
        return bits & want == want


def run_install_steps(script: str) -> Tree:
    """Apply the ``useradd`` and ``install`` commands of a shell script to a tree with ``/etc``."""
    root = Node(0o755, "root", "root")
    tree = Tree({PurePosixPath("/"): root, PurePosixPath("/etc"): root}, {"root": {"root"}})
    for line in script.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["sudo"]:
            words = words[1:]
        if words[:1] == ["useradd"]:
            name = words[-1]
            tree.groups_of[name] = {name}
        elif words[:1] == ["install"]:
            _install(tree, words[1:])
    return tree


def _install(tree: Tree, args: list[str]) -> None:
    mode, owner, group, directory, paths = 0o755, "root", "root", False, []
    options = iter(args)
    for arg in options:
        if arg == "-d":
            directory = True
        elif arg in ("-m", "-o", "-g"):
            value = next(options)
            if arg == "-m":
                mode = int(value, 8)
            elif arg == "-o":
                owner = value
            else:
                group = value
        else:
            paths.append(arg)
    node = Node(mode, owner, group)
    if directory:
        for path in paths:
            tree.nodes[PurePosixPath(path)] = node
        return
    *sources, destination = paths
    for source in sources:
        # "DIR/" receives each source by its name ("*" stands for every file of a glob)
        target = (PurePosixPath(destination) / PurePosixPath(source).name
                  if destination.endswith("/") else PurePosixPath(destination))
        tree.nodes[target] = node


def install_block() -> str:
    """The shell block of docs/systemd.md's "Install" section."""
    section = DOC.read_text().split("## Install", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def unit_values(key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", UNIT.read_text(), re.M)


# The rule itself, on data first: it must be able to say no.

def test_a_root_only_directory_hides_a_group_readable_file() -> None:
    tree = run_install_steps("useradd svc\n"
                             "install -d -m 0750 /etc/app\n"
                             "install -m 0644 -g svc f /etc/app/f\n")
    assert not tree.can_read("svc", "/etc/app/f")
    assert tree.can_read("root", "/etc/app/f")


def test_the_group_reads_what_the_group_is_given_and_others_do_not() -> None:
    tree = run_install_steps("sudo useradd --system svc\n"
                             "sudo install -d -m 0750 -o root -g svc /etc/app\n"
                             "sudo install -m 0640 -o root -g svc a.toml /etc/app/a.toml\n"
                             "sudo install -m 0600 /dev/null /etc/app/env\n")
    assert tree.can_read("svc", "/etc/app/a.toml")
    assert not tree.can_read("svc", "/etc/app/env")
    assert not tree.can_read("nobody", "/etc/app/a.toml")


# The documented install, for the unit's user.

def test_the_units_user_reads_the_fleet_file_and_the_model_but_not_the_secrets() -> None:
    (user,) = unit_values("User")
    (exec_start,) = unit_values("ExecStart")
    fleet = next(word for word in exec_start.split() if word.endswith(".toml"))
    (environment_file,) = unit_values("EnvironmentFile")
    tree = run_install_steps(install_block())
    assert user in tree.groups_of, "the install steps never create the unit's User="
    assert tree.can_read(user, fleet)
    model = PurePosixPath(fleet).parent / "model"
    assert tree.can_read(user, str(model))
    assert tree.can_read(user, str(model / "*"))  # tokenizer.json and the rest
    # systemd reads EnvironmentFile= as root; the service user never needs to
    assert not tree.can_read(user, environment_file.removeprefix("-"))
    assert not tree.can_read("nobody", fleet)


def test_the_unit_uses_a_user_with_a_group_for_its_files() -> None:
    """DynamicUser= would allocate a user of its own, with no group the files could have."""
    assert unit_values("DynamicUser") in ([], ["no"])
    assert unit_values("User") == unit_values("Group")


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian: apt-get install "
                                    "systemd); the unit file is not checked by systemd itself")


def _unit_here(tmp_path: Path) -> Path:
    """The unit with ExecStart= on an executable that exists here (verify checks it does)."""
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", UNIT.read_text(),
                  flags=re.M)
    path = tmp_path / UNIT.name
    path.write_text(text)
    return path


@needs_systemd_analyze
def test_systemd_analyze_verify_finds_nothing(tmp_path: Path) -> None:
    assert SYSTEMD_ANALYZE is not None
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", str(_unit_here(tmp_path))],
                          capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stderr) == (0, "")


@needs_systemd_analyze
def test_systemd_analyze_rates_the_sandbox_ok(tmp_path: Path) -> None:
    """Exposure under 2.0 of 10 ("OK"): the hardening lines do take effect."""
    assert SYSTEMD_ANALYZE is not None
    done = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", "--threshold=20",
                           str(_unit_here(tmp_path))],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout[-400:]
