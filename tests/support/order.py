"""The order the suite's files are handed to its workers: the longest first.

pytest-xdist (``--dist loadfile``) gives each worker a whole file at a time, the next one in
the collection's order when it runs short. A file that takes ten seconds handed out last keeps
one worker busy that long after the other has finished; handed out first, the short files fill
in behind it on the other worker. So the files below, which each take seconds (a quiet two-core
run), go first, longest first; every other file follows, the ones with more tests first (what
xdist does by itself), each file's tests together and in their own order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

#: The files that take the longest, longest first (seconds on a quiet two-core run, in workers).
LONG_FILES: tuple[str, ...] = (
    "tests/e2e/test_workers.py",  # 16 s
    "tests/state/test_kill_loop.py",  # 11 s
    "tests/test_cli.py",  # 11 s
    "tests/e2e/test_tenancy.py",  # 10 s
    "tests/e2e/test_durable.py",  # 10 s
    "tests/e2e/test_pods.py",  # 9 s
    "tests/control/test_reload.py",  # 8 s
    "tests/e2e/test_fault_tolerance.py",  # 8 s
    "tests/e2e/test_replicas.py",  # 6 s
    "tests/control/test_pods.py",  # 6 s
    "tests/e2e/test_batch_restart.py",  # 5 s
    "tests/e2e/test_engine_wait.py",  # 5 s
    "tests/test_layering.py",  # 5 s
    "tests/e2e/test_shutdown.py",  # 5 s
    "tests/e2e/test_agents.py",  # 5 s
    "tests/e2e/test_connections.py",  # 4 s
    "tests/state/test_sql.py",  # 4 s
    "tests/e2e/test_models.py",  # 4 s
    "tests/e2e/test_background_responses.py",  # 4 s
    "tests/e2e/test_rate_limits.py",  # 4 s
    "tests/simulator/test_faults.py",  # 3 s
    "tests/control/test_replica_link.py",  # 3 s
    "tests/e2e/test_logprobs.py",  # 3 s
    "tests/e2e/test_structured.py",  # 3 s
    "tests/observability/test_sdnotify.py",  # 3 s
    "tests/engines/test_transport.py",  # 3 s
    "tests/multimodal/test_parity.py",  # 3 s
    "tests/e2e/test_vision.py",  # 3 s
    "tests/e2e/test_tenancy_siblings.py",  # 3 s
    "tests/test_examples.py",  # 3 s
)


class _Item(Protocol):
    @property
    def nodeid(self) -> str: ...


T = TypeVar("T", bound=_Item)


def file_of(nodeid: str) -> str:
    """The test file a node id names (xdist's unit of work under ``--dist loadfile``)."""
    return nodeid.split("::", 1)[0]


def longest_first(items: Sequence[T], long_files: Sequence[str] = LONG_FILES) -> list[T]:
    """``items`` regrouped by file: the ``long_files`` first in their order, then the other
    files, more tests first (ties in collection order); each file's items in their order."""
    rank = {path: index for index, path in enumerate(long_files)}
    by_file: dict[str, list[T]] = {}
    for item in items:
        by_file.setdefault(file_of(item.nodeid), []).append(item)
    order = sorted(by_file, key=lambda path: (rank.get(path, len(rank)), -len(by_file[path])))
    return [item for path in order for item in by_file[path]]
