"""End to end: a batch running when its daemon is killed (SIGKILL) resumes after a restart,
running only the lines that had no result yet.

The daemon is a real process on a SQLite file. Before the restart, the test reads which
lines had their results committed; after it, the restarted daemon's own counter of the
lines it ran is the rest exactly, and the output file holds every line once, those
answered before the kill as they were answered then.
"""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path

import httpx

from tests.e2e.test_durable import Process, fleet_with, running
from tests.support.daemon import free_port, sim_engine, wait_for
from tests.support.metrics import sample

LINES = 40
#: 30 tokens of 5 ms: a line takes 0.15 s, four at once, so the batch takes about 1.5 s
ENGINE = {"decode_us_per_token": 5000, "prefill_us_per_token": 0, "eos_probability": 0.0}


def lines_run(daemon: Process) -> int:
    """The lines this daemon process ran to an answer (its /metrics)."""
    text = httpx.get(daemon.url + "/metrics").text
    return int(sample(text, "direct_frontend_batch_lines_total", outcome="completed"))


def test_a_batch_resumes_its_unfinished_lines_after_sigkill(tmp_path: Path) -> None:
    port = free_port()
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(fleet_with(port, sim_engine("slow", **ENGINE),
                                'backend = "sqlite"\npath = "state/r.db"\n\n'
                                "[frontend.batches]\nconcurrency = 4\nlease_s = 1.0"))
    requests = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "demo", "prompt": f"prompt {i}", "max_tokens": 30}}
                for i in range(LINES)]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in requests)
    daemon = Process(fleet, port)
    with running(daemon), daemon.client() as client:
        file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                      completion_window="24h")

        def some_done() -> bool:
            counts = client.batches.retrieve(batch.id).request_counts
            return counts is not None and counts.completed >= 8

        wait_for(some_done, 20, "some of the batch's lines to finish")
        daemon.kill()
    with sqlite3.connect(tmp_path / "state" / "r.db") as db:
        kept = dict(db.execute("SELECT custom_id, result FROM batch_lines WHERE batch = ? AND "
                               "result IS NOT NULL", (batch.id,)).fetchall())
    assert 8 <= len(kept) < LINES  # the kill came while lines were left

    with running(daemon), daemon.client() as client:
        def finished() -> bool:
            return client.batches.retrieve(batch.id).status == "completed"

        wait_for(finished, 30, "the batch to finish after the restart")
        done = client.batches.retrieve(batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (LINES, LINES)
        assert lines_run(daemon) == LINES - len(kept)  # only the unfinished lines ran again
        assert done.output_file_id is not None
        output = client.files.content(done.output_file_id).text.splitlines()
    by_id = {json.loads(line)["custom_id"]: line for line in output}
    assert sorted(by_id) == sorted(r["custom_id"] for r in requests)
    for custom_id, result in kept.items():
        assert by_id[custom_id].encode() == bytes(result)  # answered once, before the kill
