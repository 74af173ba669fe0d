"""Stored Responses: what ``previous_response_id`` and ``GET /v1/responses/{id}`` read (sans-IO).

The Responses API stores a response unless the request says ``store: false``,
and clients lean on that: the next turn names the previous response instead
of sending the conversation again. A router has no database, so the store is
this process's memory, bounded by bytes and by age. Each record keeps the
Response object as it was answered, its output items, and the conversation
it was generated from (earlier turns included), all as JSON bytes: a
follow-up decodes them once, a ``GET`` sends them as they are, and what the
budget counts is what the memory holds. A follow-up's record shares its
history's bytes with the record it continues, so a long conversation costs
its items once, not once per turn: the budget counts every distinct bytes
object once, however many records hold it.

Records leave oldest first, when the budget needs room or their time is up.
A process's ids carry its ``owner`` tag, so a sibling process (``run
--workers``, ``[frontend.replicas]``) that is asked for a response it does
not hold knows whom to ask (:class:`RemoteResponses`, over NATS).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import msgspec

PREFIX: Final = "resp_"
#: hex characters of the owner tag that leads every id this process makes
OWNER_CHARS: Final = 8
#: what a record costs beyond its bytes (the record, its slots, the map entry)
RECORD_OVERHEAD: Final = 200
#: a cancel's answers: the response has ended (cancelled, or it had ended before)
CANCELLED: Final = "cancelled"
#: … it was not run in the background, so it cannot be cancelled
NOT_BACKGROUND: Final = "not_background"
#: the statuses of a response that has not ended (only a background one is seen so)
RUNNING: Final = frozenset({"queued", "in_progress"})


class StoredResponse(msgspec.Struct, frozen=True):
    """One stored response; every field is what the API returns, as JSON bytes."""

    id: str
    response: bytes  # the Response object, as GET /v1/responses/{id} returns it
    output: tuple[bytes, ...]  # its output items: the next turn's history ends with them
    conversation: tuple[bytes, ...]  # the input items it answered, earlier turns' included
    #: where it is: ``queued`` and ``in_progress`` until it ends (a background response)
    status: str = "completed"
    background: bool = False  # run with ``background: true``: cancellable, its events kept
    #: a background response's stream events so far, SSE-encoded, one per sequence number
    events: tuple[bytes, ...] = ()

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    def history(self) -> tuple[bytes, ...]:
        """What a follow-up continues: the conversation, then this response's output."""
        return self.conversation + self.output


class RemoteResponses(Protocol):
    """A sibling process's store, reached by its owner tag (control/replicas.py)."""

    async def fetch(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...

    async def cancel(self, owner: str, response_id: str) -> str | None:
        """The sibling's answer to a cancel (:meth:`ResponseStore.cancel`); None: not held."""
        ...


#: a running background response's record as it is now (None: no such response runs here)
Live = Callable[[str], "StoredResponse | None"]
#: cancels a background response this process runs: its :data:`Cancelled` answer
Canceller = Callable[[str], Awaitable[str | None]]


def owner_of(response_id: str) -> str | None:
    """The owner tag an id of ours carries; None for an id no process of ours made."""
    if not response_id.startswith(PREFIX) or len(response_id) <= len(PREFIX) + OWNER_CHARS:
        return None
    tag = response_id[len(PREFIX):len(PREFIX) + OWNER_CHARS]
    return tag if all(c in "0123456789abcdef" for c in tag) else None


@dataclasses.dataclass(slots=True)
class _Held:
    """A bytes object some records hold, counted once."""

    data: bytes
    holders: int


class ResponseStore:
    """This process's stored responses: at most ``max_bytes``, none older than ``ttl_s``."""

    def __init__(self, max_bytes: int, ttl_s: float, *, owner: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.on_evict = on_evict  # a record left early, for the budget (a metric counts it)
        self.owner = owner or secrets.token_hex(OWNER_CHARS // 2)
        self.clock = clock
        #: a sibling's store (set when a replica link runs)
        self.remote: RemoteResponses | None = None
        #: the background responses running here, as they are now (http/background.py)
        self.live: Live | None = None
        #: cancels one of them (http/background.py)
        self.canceller: Canceller | None = None
        self.bytes = 0
        self.evicted = 0
        self._records: OrderedDict[str, tuple[StoredResponse, float]] = OrderedDict()
        self._held: dict[int, _Held] = {}  # id() of a held bytes object -> it, and its holders

    def __len__(self) -> int:
        return len(self._records)

    def new_id(self, request_id: str) -> str:
        """The id of a response this process answers: its owner tag, then the request id."""
        return f"{PREFIX}{self.owner}{request_id}"

    def put(self, record: StoredResponse) -> bool:
        """Keep ``record``; False if it alone is larger than the whole budget."""
        if self._cost(record) > self.max_bytes:
            return False
        self.delete(record.id)
        self._records[record.id] = (record, self.clock())
        self.bytes += RECORD_OVERHEAD
        for data in self._parts(record):
            held = self._held.get(id(data))
            if held is None:
                self._held[id(data)] = _Held(data, 1)
                self.bytes += len(data)
            else:
                held.holders += 1
        self._expire()
        while self.bytes > self.max_bytes and self._records:
            self._drop(next(iter(self._records)))
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The record if this process holds it and its time is not up.

        A background response still running is seen as it is now, not as its
        last kept record.
        """
        if self.live is not None and (running := self.live(response_id)) is not None:
            return running
        entry = self._records.get(response_id)
        if entry is None:
            return None
        record, stored_at = entry
        if self.clock() - stored_at > self.ttl_s:
            self._expire()
            return None
        return record

    async def cancel(self, response_id: str) -> str | None:
        """Cancel a background response held here: ``cancelled`` once it has ended (or it
        had ended already), ``not_background`` for one that was not run so; None: not held."""
        record = self.get(response_id)
        if record is None:
            return None
        if not record.background:
            return NOT_BACKGROUND
        if record.running and self.canceller is not None:
            return await self.canceller(response_id)
        return CANCELLED

    def delete(self, response_id: str) -> bool:
        if response_id not in self._records:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        """Drop records whose time is up: the oldest lead, so stop at the first that is not."""
        deadline = self.clock() - self.ttl_s
        while self._records:
            oldest = next(iter(self._records))
            if self._records[oldest][1] >= deadline:
                return
            self._drop(oldest)

    def _drop(self, response_id: str) -> None:
        record, _ = self._records.pop(response_id)
        self.bytes -= RECORD_OVERHEAD
        for data in self._parts(record):
            held = self._held[id(data)]
            held.holders -= 1
            if held.holders == 0:
                del self._held[id(data)]
                self.bytes -= len(data)

    @staticmethod
    def _parts(record: StoredResponse) -> list[bytes]:
        """The record's bytes objects, each once (a record may hold one twice)."""
        seen: dict[int, bytes] = {}
        for data in (record.response, *record.output, *record.conversation, *record.events):
            seen.setdefault(id(data), data)
        return list(seen.values())

    def _cost(self, record: StoredResponse) -> int:
        return RECORD_OVERHEAD + sum(len(d) for d in self._parts(record))


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(StoredResponse)
_json_decoder: Final = msgspec.json.Decoder(dict[str, Any])


def encode_record(record: StoredResponse) -> bytes:
    """A record for a sibling that asked for it."""
    return _encoder.encode(record)


def decode_record(data: bytes) -> StoredResponse | None:
    """A sibling's answer; None if it is not a record (counted and skipped by the caller)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, ValueError):
        return None


def decode_items(items: tuple[bytes, ...]) -> list[dict[str, Any]]:
    """Stored items as the objects a request's input is read from."""
    return [_json_decoder.decode(item) for item in items]
