"""SIGKILL while writing never loses an acknowledged record nor corrupts the SQLite store.

A writer process stores chains of responses (each follow-up stored as
what it adds to the one it continues) through the daemon's own write path
(``keep``: the durable store's commit, then the cache) and conversation
items through the durable store, and acknowledges each on a pipe once the
call returned, as the daemon answers an id once it returned. The test kills
it with SIGKILL at a random moment once it is writing (after its first
stored response), again and again on the same database;
then every acknowledged record must be there with its whole history, and ``PRAGMA
integrity_check`` must answer ``ok``. Writers are forked from the test
process (all imports done), so hundreds of kills take seconds.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import trio

from direct_frontend.http.stored_responses import keep
from direct_frontend.openai.conversations import Conversation, new_conversation_id
from direct_frontend.openai.response_store import Item, Lineage, ResponseStore, StoredResponse
from direct_frontend.state.shell import Durable
from direct_frontend.state.sqlite import SqliteStore

KILLS = 200
#: a writer is killed this long (seconds, uniformly at random) after its first stored response
KILL_AFTER = (0.0, 0.02)


def _writer(path: Path, ack: int, seed: int) -> None:
    """Store records until killed; write ``r <id> <owner>`` / ``i <conv> <item>`` per commit."""
    rng = random.Random(seed)

    async def main() -> None:
        durable = Durable(SqliteStore(path, connections=3), ttl_s=3600, lease_s=30)
        await durable.open()
        store = ResponseStore(1 << 20, 3600, durable=durable)

        async def responses(owner: str) -> None:
            """Chains of follow-ups, each stored as what it adds to the one before."""
            last: StoredResponse | None = None
            while True:
                size = rng.randrange(10, 20_000)
                said = (os.urandom(size // 2).hex().encode(),)
                history = () if last is None or rng.random() < 0.1 else last.history()
                record = StoredResponse(store.new_id(), b'{"id":"x"}', (b'{"o":1}',),
                                        history + said, owner=owner)
                parent = last.id if history and last is not None else None
                if await keep(store, record, lineage=Lineage(parent)):
                    os.write(ack, f"r {record.id} {owner} {len(record.conversation)}\n"
                             .encode())
                    last = record

        async def items() -> None:
            conversation = Conversation(new_conversation_id(), "k0", 1)
            await durable.create_conversation(conversation, [])
            n = 0
            while True:
                item = Item(f"msg_{seed}_{n}", b'{"id":"msg_%d_%d"}' % (seed, n))
                await durable.add_items(conversation.id, "k0", [item])
                os.write(ack, f"i {conversation.id} {item.id}\n".encode())
                n += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(responses, "k1")
            nursery.start_soon(responses, "k2")
            nursery.start_soon(items)

    trio.run(main)


def _read_first_response(fd: int) -> bytes:
    """What the writer acknowledged up to its first stored response (it is writing by then,
    however long a loaded machine took to start it)."""
    read = b""
    while not (read.startswith(b"r ") or b"\nr " in read):
        chunk = os.read(fd, 65536)
        assert chunk, "the writer ended before storing a response"
        read += chunk
    return read


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_sigkill_while_writing_loses_nothing_acknowledged(tmp_path: Path) -> None:
    path = tmp_path / "state" / "responses.db"
    rng = random.Random(20261204)
    acked: list[list[str]] = []
    started = time.monotonic()
    for kill in range(KILLS):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: it never returns into pytest
            os.close(read)
            try:
                _writer(path, write, kill)
            finally:
                os._exit(0)
        os.close(write)
        first = _read_first_response(read)
        time.sleep(rng.uniform(*KILL_AFTER))  # the random moment of the kill, not a wait
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"writer {kill} ended on its own: {status}"
        lines = (first + _read_all(read)).decode().split("\n")
        os.close(read)
        acked.extend(line.split() for line in lines[:-1])  # the last is cut or empty
    elapsed = time.monotonic() - started

    store = SqliteStore(path)
    try:
        assert store.integrity_check() == "ok"
        missing = []
        for kind, first, second, *length in acked:
            if kind == "r":
                found = store.get_response(first, second)
                if found is None or len(found[0].conversation) != int(length[0]):
                    missing.append(first)
            elif not isinstance(store.get_item(first, "k0", second), Item):
                missing.append(f"{first}/{second}")
    finally:
        store.close()
    responses = sum(1 for a in acked if a[0] == "r")
    print(f"{KILLS} kills in {elapsed:.1f} s: {responses} responses and "
          f"{len(acked) - responses} items acknowledged, {len(missing)} missing")
    assert not missing, f"acknowledged but lost: {missing[:5]}"
    assert responses > KILLS, "the writers hardly wrote: the kills tested little"
