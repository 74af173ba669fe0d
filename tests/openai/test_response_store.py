"""The stored-responses memory: its budget, its clock, shared history, and its wire form."""

from __future__ import annotations

import re

import msgspec
import pytest

from direct_frontend.openai.response_store import (
    CANCELLED,
    NOT_BACKGROUND,
    PART_OVERHEAD,
    RECORD_OVERHEAD,
    ResponseStore,
    StoredResponse,
    decode_items,
    decode_record,
    encode_record,
    holder_of,
)

A = ""  # the one owner of a server without API keys


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(response_id: str, size: int = 100,
           history: tuple[bytes, ...] = (), owner: str = A) -> StoredResponse:
    item = b'{"type":"message","id":"%b","x":"%b"}' % (response_id.encode(), b"a" * size)
    return StoredResponse(response_id, b'{"id":"%b"}' % response_id.encode(), (item,),
                          (*history, b'{"type":"message","id":"in-%b"}' % response_id.encode()),
                          owner=owner)


def cost(r: StoredResponse) -> int:
    parts = (r.response, *r.output, *r.conversation, *r.events)
    return RECORD_OVERHEAD + sum(len(p) + PART_OVERHEAD for p in parts)


def test_a_record_is_kept_and_found_until_deleted() -> None:
    store = ResponseStore(10_000, 60)
    first = record("resp_1")
    assert store.put(first)
    assert store.get("resp_1", A) is first and len(store) == 1
    assert store.bytes == cost(first)
    assert store.delete("resp_1", A) and not store.delete("resp_1", A)
    assert store.get("resp_1", A) is None and store.bytes == 0


def test_the_oldest_leave_first_when_the_budget_needs_room() -> None:
    evicted: list[None] = []
    one = cost(record("resp_1"))
    store = ResponseStore(one * 2, 60, on_evict=lambda: evicted.append(None))
    for n in (1, 2, 3):
        assert store.put(record(f"resp_{n}"))
    assert store.get("resp_1", A) is None
    assert store.get("resp_2", A) is not None and store.get("resp_3", A) is not None
    assert store.bytes <= store.max_bytes and store.evicted == 1 and len(evicted) == 1


def test_a_record_larger_than_the_budget_is_refused_and_evicts_nothing() -> None:
    store = ResponseStore(2_000, 60)
    assert store.put(record("resp_1"))
    assert not store.put(record("resp_big", size=2_000))
    assert store.get("resp_1", A) is not None and store.get("resp_big", A) is None


def test_a_record_is_gone_when_its_time_is_up() -> None:
    clock = Clock()
    store = ResponseStore(10_000, 60, clock=clock)
    store.put(record("resp_1"))
    clock.now = 30
    store.put(record("resp_2"))
    clock.now = 61
    assert store.get("resp_1", A) is None
    assert store.get("resp_2", A) is not None
    assert len(store) == 1 and store.bytes == cost(record("resp_2"))


def test_a_follow_up_shares_its_history_and_costs_only_what_it_adds() -> None:
    """A long conversation is held once, not once per turn."""
    store = ResponseStore(1_000_000, 60)
    first = record("resp_1", size=5_000)
    store.put(first)
    second = record("resp_2", size=10, history=first.history())
    store.put(second)
    added = RECORD_OVERHEAD + 3 * PART_OVERHEAD + len(second.response) + len(
        second.output[0]) + len(second.conversation[-1])
    assert store.bytes == cost(first) + added
    store.delete("resp_1", A)  # the history lives on in the follow-up, and is still counted
    assert store.bytes == cost(second)
    store.delete("resp_2", A)
    assert store.bytes == 0


def test_ids_carry_their_holder_then_128_random_bits() -> None:
    store = ResponseStore(1_000, 60, holder="0a1b2c3d")
    made = store.new_id()
    assert re.fullmatch(r"resp_0a1b2c3d[0-9a-f]{32}", made) and made != store.new_id()
    assert holder_of(made) == "0a1b2c3d"
    for foreign in ("resp_1", "resp_", "chatcmpl-0a1b2c3d0123", "resp_ZZZZZZZZ0123"):
        assert holder_of(foreign) is None
    assert len(ResponseStore(1, 1).holder) == 8


def test_the_wire_form_round_trips_and_garbage_is_none() -> None:
    first = record("resp_1")
    assert decode_record(encode_record(first)) == first
    assert decode_record(b"\x00not a record") is None
    assert decode_items(first.history()) == [
        {"type": "message", "id": "in-resp_1"},
        {"type": "message", "id": "resp_1", "x": "a" * 100},
    ]


@pytest.mark.parametrize("again", [True, False])
def test_putting_an_id_again_replaces_it(again: bool) -> None:
    store = ResponseStore(10_000, 60)
    store.put(record("resp_1"))
    if again:
        store.put(record("resp_1", size=10))
    assert len(store) == 1
    assert store.bytes == cost(record("resp_1", size=10 if again else 100))


async def test_a_running_background_response_is_seen_as_it_is_now_and_cancelled_by_its_runner(
) -> None:
    store = ResponseStore(10_000, 60)
    kept = msgspec.structs.replace(record("resp_bg"), status="in_progress", background=True)
    store.put(kept)
    now = msgspec.structs.replace(kept, events=(b"event: a\n\n",))
    running = {"resp_bg": now}
    cancelled: list[str] = []

    class Runner:
        def record(self, response_id: str) -> StoredResponse | None:
            return running.get(response_id)

        async def cancel(self, response_id: str) -> str | None:
            cancelled.append(response_id)
            running.pop(response_id)
            return CANCELLED

    store.connect(Runner(), None)
    assert store.get("resp_bg", A) is now and now.running  # the runner's view, not the last put
    assert await store.cancel("resp_bg", A) == CANCELLED and cancelled == ["resp_bg"]
    assert store.get("resp_bg", A) is kept
    ended = msgspec.structs.replace(kept, status="cancelled")
    store.put(ended)
    assert await store.cancel("resp_bg", A) == CANCELLED and cancelled == ["resp_bg"]  # as it ended
    store.put(record("resp_fg"))
    assert await store.cancel("resp_fg", A) == NOT_BACKGROUND
    assert await store.cancel("resp_none", A) is None


def test_a_background_records_events_count_in_its_cost() -> None:
    store = ResponseStore(10_000, 60)
    plain = record("resp_1")
    logged = msgspec.structs.replace(plain, background=True, events=(b"x" * 500,))
    store.put(logged)
    assert store.bytes == cost(plain) + 500 + PART_OVERHEAD
    assert decode_record(encode_record(logged)) == logged
