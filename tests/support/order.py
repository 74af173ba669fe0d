"""The order the suite's files are handed to its workers: the longest first.

pytest-xdist (``--dist loadfile``) gives each worker a whole file at a time, the next one in
the collection's order when it runs short. A file that takes ten seconds handed out last keeps
one worker busy that long after the other has finished; handed out first, the short files fill
in behind it on the other worker. So the files below, which each take a second or more, go
first, longest first; every other file follows, the ones with more tests first (what xdist does
by itself), each file's tests together and in their own order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

#: The files that take about a second or more: the wall time of their tests, setup and teardown
#: included, in a quiet two-core run of the whole suite. A figure only places its file in the
#: order, so a rough one does: a file that got much slower or faster belongs elsewhere here.
LONG_FILES: dict[str, float] = {
    "tests/e2e/test_workers.py": 16.1,
    "tests/state/test_kill_loop.py": 10.7,
    "tests/test_cli.py": 10.6,
    "tests/e2e/test_tenancy.py": 10.5,
    "tests/e2e/test_durable.py": 9.8,
    "tests/e2e/test_pods.py": 9.0,
    "tests/control/test_reload.py": 7.7,
    "tests/e2e/test_fault_tolerance.py": 7.6,
    "tests/e2e/test_replicas.py": 6.3,
    "tests/control/test_pods.py": 5.7,
    "tests/e2e/test_batch_restart.py": 5.3,
    "tests/e2e/test_engine_wait.py": 4.9,
    "tests/test_layering.py": 4.8,
    "tests/e2e/test_shutdown.py": 4.7,
    "tests/e2e/test_agents.py": 4.6,
    "tests/e2e/test_connections.py": 4.3,
    "tests/state/test_sql.py": 4.1,
    "tests/e2e/test_models.py": 3.9,
    "tests/e2e/test_background_responses.py": 3.8,
    "tests/e2e/test_rate_limits.py": 3.6,
    "tests/simulator/test_faults.py": 3.4,
    "tests/control/test_replica_link.py": 3.2,
    "tests/e2e/test_logprobs.py": 2.9,
    "tests/e2e/test_structured.py": 2.9,
    "tests/observability/test_sdnotify.py": 2.8,
    "tests/engines/test_transport.py": 2.8,
    "tests/multimodal/test_parity.py": 2.6,
    "tests/e2e/test_vision.py": 2.6,
    "tests/e2e/test_tenancy_siblings.py": 2.6,
    "tests/test_examples.py": 2.5,
    "tests/multimodal/test_fetch.py": 2.4,
    "tests/http/test_batch_runner.py": 2.4,
    "tests/openai/test_store_owners.py": 2.3,
    "tests/http/test_admin.py": 2.3,
    "tests/kv/test_subscriber.py": 2.2,
    "tests/fleet/test_describe.py": 2.0,
    "tests/e2e/test_bounds.py": 1.9,
    "tests/openai/parsers/test_xml_params.py": 1.9,
    "tests/e2e/test_foreign_load.py": 1.8,
    "tests/e2e/test_engine_restarts.py": 1.7,
    "tests/state/test_batch_sql.py": 1.7,
    "tests/test_routing_sim.py": 1.6,
    "tests/e2e/test_fuzz.py": 1.6,
    "tests/text/test_stops.py": 1.6,
    "tests/pipeline/test_incremental.py": 1.6,
    "tests/e2e/test_responses_api.py": 1.5,
    "tests/e2e/test_tools.py": 1.4,
    "tests/e2e/test_kv.py": 1.4,
    "tests/e2e/test_kv_ranks.py": 1.4,
    "tests/kv/test_index.py": 1.4,
    "tests/e2e/test_disagg.py": 1.3,
    "tests/state/test_backends.py": 1.3,
    "tests/test_deploy.py": 1.3,
    "tests/control/test_supervisor.py": 1.3,
    "tests/text/test_model_dir.py": 1.2,
    "tests/e2e/test_messages_api.py": 1.2,
    "tests/e2e/test_choices.py": 1.2,
    "tests/simulator/test_kvcache.py": 1.2,
    "tests/e2e/test_slow_clients.py": 1.2,
    "tests/simulator/test_engine.py": 1.2,
    "tests/pipeline/test_embed.py": 1.1,
    "tests/observability/test_redact.py": 1.1,
    "tests/openai/test_parse.py": 1.0,
    "tests/openai/parsers/test_properties.py": 0.9,
    "tests/e2e/test_http.py": 0.8,
    "tests/e2e/test_affinity.py": 0.8,
}


class _Item(Protocol):
    @property
    def nodeid(self) -> str: ...


T = TypeVar("T", bound=_Item)


def file_of(nodeid: str) -> str:
    """The test file a node id names (xdist's unit of work under ``--dist loadfile``)."""
    return nodeid.split("::", 1)[0]


def longest_first(items: Sequence[T], long_files: Mapping[str, float] = LONG_FILES) -> list[T]:
    """``items`` regrouped by file: the ``long_files`` first, longest first, then the other
    files, more tests first (ties in collection order); each file's items in their order."""
    by_file: dict[str, list[T]] = {}
    for item in items:
        by_file.setdefault(file_of(item.nodeid), []).append(item)
    order = sorted(by_file, key=lambda path: (-long_files.get(path, 0.0), -len(by_file[path])))
    return [item for path in order for item in by_file[path]]
