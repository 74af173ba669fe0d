"""The stored-responses memory between owners: who sees what, whose records leave, what
the budget counts, and ids nobody can predict."""

from __future__ import annotations

import gc
import random
import secrets
import tracemalloc

import msgspec

from direct_frontend.observability.logging import new_request_id
from direct_frontend.openai.response_store import (
    CANCELLED,
    ResponseStore,
    StoredResponse,
)
from tests.openai.test_response_store import cost, record

ALICE, BOB = "k" + "a" * 32, "k" + "b" * 32


def test_another_owner_neither_sees_nor_deletes_nor_cancels_a_record() -> None:
    store = ResponseStore(100_000, 60)
    store.put(record("resp_a", owner=ALICE))
    assert store.get("resp_a", BOB) is None and not store.delete("resp_a", BOB)
    assert store.get("resp_a", ALICE) is not None
    assert store.delete("resp_a", ALICE) and store.get("resp_a", ALICE) is None


async def test_a_running_response_is_its_owners_alone() -> None:
    store = ResponseStore(100_000, 60)
    running = msgspec.structs.replace(record("resp_bg", owner=ALICE), status="in_progress",
                                      background=True)
    cancelled: list[str] = []

    class Runner:
        def record(self, response_id: str) -> StoredResponse | None:
            return running if response_id == "resp_bg" else None

        async def cancel(self, response_id: str) -> str | None:
            cancelled.append(response_id)
            return CANCELLED

    store.connect(Runner(), None)
    assert store.get("resp_bg", BOB) is None and await store.cancel("resp_bg", BOB) is None
    assert cancelled == []
    assert store.get("resp_bg", ALICE) is running
    assert await store.cancel("resp_bg", ALICE) == CANCELLED and cancelled == ["resp_bg"]


def test_a_flooding_owner_loses_its_own_oldest_and_never_the_others_under_their_share() -> None:
    one = cost(record("resp_x00"))
    store = ResponseStore(one * 10, 60)
    for n in range(3):  # bob: well under half the budget
        assert store.put(record(f"resp_b{n:02d}", owner=BOB))
    for n in range(50):  # alice floods
        assert store.put(record(f"resp_a{n:02d}", owner=ALICE))
    assert all(store.get(f"resp_b{n:02d}", BOB) is not None for n in range(3))
    kept = [n for n in range(50) if store.get(f"resp_a{n:02d}", ALICE) is not None]
    assert kept == list(range(43, 50))  # alice's newest, as many as fit beside bob's
    assert store.bytes <= store.max_bytes and store.evicted == 43


def test_an_owner_over_its_share_gives_way_to_a_newcomer_under_its_share() -> None:
    one = cost(record("resp_x00"))
    store = ResponseStore(one * 10, 60)
    for n in range(10):
        store.put(record(f"resp_a{n:02d}", owner=ALICE))
    for n in range(4):
        store.put(record(f"resp_b{n:02d}", owner=BOB))
    assert all(store.get(f"resp_b{n:02d}", BOB) is not None for n in range(4))
    assert [n for n in range(10) if store.get(f"resp_a{n:02d}", ALICE)] == list(range(4, 10))


def test_no_owner_holds_more_than_its_cap() -> None:
    one = cost(record("resp_x00"))
    store = ResponseStore(one * 100, 60, max_bytes_per_owner=one * 3)
    for n in range(5):
        store.put(record(f"resp_a{n:02d}", owner=ALICE))
    assert store.owner_bytes(ALICE) == one * 3 and store.get("resp_a01", ALICE) is None
    assert not store.put(record("resp_big", size=one * 3, owner=BOB))


def test_a_running_log_counts_against_its_owner_and_is_stopped_when_it_cannot_fit() -> None:
    one = cost(record("resp_x00"))
    store = ResponseStore(one * 10, 60)
    for n in range(4):
        store.put(record(f"resp_b{n:02d}", owner=BOB))
    store.put(record("resp_a00", owner=ALICE))
    assert store.charge(ALICE, one * 6)  # alice's log grows: her own record makes room
    assert store.get("resp_a00", ALICE) is None
    assert store.owner_bytes(ALICE) == one * 6 and store.bytes == one * 10
    assert not store.charge(ALICE, one * 2)  # no more room: bob keeps what he has
    assert all(store.get(f"resp_b{n:02d}", BOB) is not None for n in range(4))
    assert store.charge(ALICE, -one * 8)  # it ended: its log is released
    assert store.owner_bytes(ALICE) == 0 and store.bytes == one * 4


def test_what_the_store_counts_is_what_its_records_take_in_memory() -> None:
    """20,000 small responses of the shape the API stores: the count is within 25 % of the
    memory they take (records, ids, maps, bytes objects), measured by tracemalloc."""
    store = ResponseStore(1 << 40, 1e9)
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for n in range(20_000):
            response_id = store.new_id()
            response = msgspec.json.encode({
                "id": response_id, "object": "response", "created_at": 1_765_000_000 + n,
                "status": "completed", "model": "demo", "usage": {"input_tokens": 5},
                "output": [{"type": "message", "id": f"msg_{secrets.token_hex(8)}",
                            "content": [{"type": "output_text", "text": "hi there"}]}],
            })
            output = (msgspec.json.encode({"type": "message", "id": f"msg_{n}",
                                           "content": [{"type": "output_text",
                                                        "text": "hi there"}]}),)
            conversation = (msgspec.json.encode({"type": "message", "role": "user",
                                                 "content": f"hello {n}"}),)
            store.put(StoredResponse(response_id, response, output, conversation, owner=ALICE))
        gc.collect()
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.75 <= store.bytes / taken <= 1.25, (store.bytes, taken)


# -- ids nobody can predict ---------------------------------------------------------------


def _untemper(value: int) -> int:
    """The Mersenne Twister state word behind one 32-bit output."""
    value ^= value >> 18
    value ^= (value << 15) & 0xEFC60000
    result = value
    for _ in range(5):
        result = value ^ ((result << 7) & 0x9D2C5680)
    value = result
    result = value
    for _ in range(3):
        result = value ^ (result >> 11)
    return result & 0xFFFFFFFF


def _predictor(observed: list[str]) -> random.Random:
    """A generator in the state of the one that drew ``observed`` 64-bit hex ids, if a
    Mersenne Twister did: 312 ids (624 words) recover it whole."""
    words: list[int] = []
    for text in observed[:312]:
        value = int(text, 16)
        words += [value & 0xFFFFFFFF, value >> 32]  # getrandbits(64): the low word first
    clone = random.Random()
    clone.setstate((3, (*(_untemper(w) for w in words), 624), None))
    for _ in observed[312:]:
        clone.getrandbits(64)
    return clone


def test_the_attack_recovers_a_mersenne_twister_from_its_ids() -> None:
    """The harvesting attack below is real: against ids from a seeded ``random`` it
    predicts every next id."""
    victim = random.Random(secrets.randbits(64))
    observed = [f"{victim.getrandbits(64):016x}" for _ in range(10_000)]
    clone = _predictor(observed)
    assert all(f"{clone.getrandbits(64):016x}" == f"{victim.getrandbits(64):016x}"
               for _ in range(100))


def test_no_response_id_is_predicted_from_10000_request_ids() -> None:
    store = ResponseStore(1_000, 60)
    observed = [new_request_id() for _ in range(10_000)]
    clone = _predictor(observed)
    predicted_requests = {f"{clone.getrandbits(64):016x}" for _ in range(1_000)}
    made = [store.new_id() for _ in range(1_000)]
    later_requests = {new_request_id() for _ in range(1_000)}
    assert not predicted_requests & later_requests  # request ids reveal no generator
    tail = len("resp_") + 8  # the random part, after the holder tag
    harvested = [i for i in made if i[tail:tail + 16] in predicted_requests
                 or i[-16:] in predicted_requests]
    assert harvested == []
    assert all(len(i) == len("resp_") + 8 + 32 for i in made)  # 128 random bits each
