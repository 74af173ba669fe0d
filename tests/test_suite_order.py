"""The suite's file order (tests/support/order.py): the long files first, every file whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.order import LONG_FILES, longest_first

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Node:
    nodeid: str


def test_every_long_file_named_is_a_test_file_of_the_suite() -> None:
    missing = [path for path in LONG_FILES if not (ROOT / path).is_file()]
    assert missing == []
    assert len(set(LONG_FILES)) == len(LONG_FILES)


def test_long_files_go_first_longest_first_then_the_files_with_more_tests() -> None:
    items = [Node(nodeid) for nodeid in (
        "tests/a.py::one", "tests/b.py::one", "tests/b.py::two", "tests/slow.py::one",
        "tests/c.py::one", "tests/slower.py::one", "tests/slower.py::two", "tests/d.py::one")]
    ordered = longest_first(items, long_files={"tests/slow.py": 1.5, "tests/slower.py": 9.0})
    assert [item.nodeid for item in ordered] == [
        "tests/slower.py::one", "tests/slower.py::two", "tests/slow.py::one",
        "tests/b.py::one", "tests/b.py::two", "tests/a.py::one", "tests/c.py::one",
        "tests/d.py::one"]


def test_a_files_tests_stay_together_when_the_collection_interleaves_them() -> None:
    items = [Node(nodeid) for nodeid in ("tests/a.py::one", "tests/b.py::one", "tests/a.py::two")]
    assert [item.nodeid for item in longest_first(items, long_files={})] == [
        "tests/a.py::one", "tests/a.py::two", "tests/b.py::one"]
