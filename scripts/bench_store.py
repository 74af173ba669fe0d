"""The durable store's costs: a stored response's commit, and a follow-up's read of its history.

Runs both backends through the Trio shell (state/shell.py): SQLite in a
temporary file, and a PostgreSQL started as the tests start it
(tests/support/postgres.py: Debian's package). Prints put p50/p99 and the
cost of a chain's 10th and 500th turn (a follow-up stores only what it adds),
and the time a follow-up takes to read a conversation of 10 and of 1,000 items, on
the process that wrote it (cached: only the count is read) and on a cold one.

    PYTHONPATH=. python scripts/bench_store.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from direct_frontend.openai.conversations import Conversation, Item
from direct_frontend.openai.response_store import Lineage, StoredResponse
from direct_frontend.state.postgres import PostgresStore
from direct_frontend.state.shell import Durable
from direct_frontend.state.sql import SqlStore
from direct_frontend.state.sqlite import SqliteStore
from tests.support.postgres import running_postgres

PUTS = 300
READS = 50


async def bench(name: str, sql: SqlStore[Any]) -> None:
    durable = Durable(sql, ttl_s=3600, lease_s=30)
    await durable.open()
    latencies = []
    for i in range(PUTS):
        record = StoredResponse(f"resp_{i}", b'{"id":"x"}' * 50, (b'{"o":1}' * 50,),
                                (b"x" * 2000,), owner="k")
        started = time.perf_counter()
        await durable.put(record)
        latencies.append(time.perf_counter() - started)
    latencies.sort()
    chain: dict[int, float] = {}
    last: StoredResponse | None = None
    for n in range(500):  # a previous_response_id chain: each turn adds 2 KB
        history = () if last is None else last.history()
        record = StoredResponse(f"chain_{n}", b'{"id":"x"}', (b'{"o":"%s"}' % (b"z" * 1000),),
                                (*history, b'{"i":"%s"}' % (b"w" * 1000)), owner="k")
        started = time.perf_counter()
        await durable.put(record, lineage=Lineage(None if last is None else last.id))
        chain[n + 1] = time.perf_counter() - started
        last = record
    started = time.perf_counter()
    assert await durable.get("chain_499", "k") == last  # a cold read: the chain put together
    cold_chain = time.perf_counter() - started
    await durable.create_conversation(Conversation("conv_1", "k", 1), [])
    warm: dict[int, float] = {}
    cold: dict[int, float] = {}
    for n in range(1000):
        await durable.add_items("conv_1", "k", [Item(f"m{n}", b'{"id":"m%d","t":"%s"}' % (
            n, b"y" * 200))])
        if n + 1 in (10, 1000):
            started = time.perf_counter()
            for _ in range(READS):
                await durable.history("conv_1", "k")
            warm[n + 1] = (time.perf_counter() - started) / READS
            fresh = Durable(sql, ttl_s=3600, lease_s=30)
            started = time.perf_counter()
            await fresh.history("conv_1", "k")
            cold[n + 1] = time.perf_counter() - started
    print(f"{name}: put p50 {latencies[PUTS // 2] * 1e3:.2f} ms, p99 "
          f"{latencies[PUTS * 99 // 100] * 1e3:.2f} ms; a chain's turn 10 {chain[10] * 1e3:.2f} "
          f"ms, turn 500 {chain[500] * 1e3:.2f} ms (read cold: {cold_chain * 1e3:.1f} ms); "
          f"a follow-up's history: 10 items "
          f"{warm[10] * 1e3:.2f} ms, 1000 items {warm[1000] * 1e3:.2f} ms; a cold process: "
          f"10 items {cold[10] * 1e3:.2f} ms, 1000 items {cold[1000] * 1e3:.2f} ms")


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        await bench("sqlite", SqliteStore(Path(tmp) / "store.db"))
    with running_postgres() as server:
        await bench("postgres", PostgresStore(server.new_database()))


if __name__ == "__main__":
    trio.run(main)
