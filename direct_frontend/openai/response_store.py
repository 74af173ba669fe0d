"""Stored Responses: what ``previous_response_id`` and ``GET /v1/responses/{id}`` read (sans-IO).

The Responses API stores a response unless the request says ``store: false``,
and clients lean on that: the next turn names the previous response instead
of sending the conversation again. This store is this process's memory,
bounded by bytes and by age: all there is with the ``memory`` backend, and
the cache in front of a database with the others (:class:`DurableResponses`,
state/; the HTTP shell writes there first). Each record keeps the
Response object as it was answered, its output items, and the conversation
it was generated from (earlier turns included), all as JSON bytes: a
follow-up decodes them once, a ``GET`` sends them as they are, and what the
budget counts is what the memory holds. A follow-up's record shares its
history's bytes with the record it continues, so a long conversation costs
its items once, not once per turn: the budget counts every distinct bytes
object once, however many records hold it.

Every record has an owner: the identity of the API key (and tenant) that
made it (http/identity.py). Only its owner sees it: for anyone else every
method here answers as if it did not exist, so the HTTP shell's answer is
OpenAI's own 404 and existence never leaks. Ids are 128 bits from the OS's
CSPRNG behind the holding process's tag, so no id can be guessed or
predicted from others.

The budget is shared fairly between owners. An owner's share is the budget
divided among the owners holding anything; when the store needs room, the
owner that asked for it gives up its own oldest records first if it is over
its share, else the owner furthest over its share does: an owner under its
share never loses a record to another's traffic. A background response's
event log counts against its owner while it runs (:meth:`ResponseStore.charge`).
Records also leave when their time is up.

A process's ids carry its ``holder`` tag, so a sibling process (``run
--workers``, ``[frontend.replicas]``) that is asked for a response it does
not hold knows whom to ask (:class:`RemoteResponses`, over NATS), and that
sibling checks the owner the same way.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import msgspec

PREFIX: Final = "resp_"
#: hex characters of the holder tag that leads every id this process makes
HOLDER_CHARS: Final = 8
#: random bytes behind the tag: 128 bits from ``secrets``, never from a seeded generator
ID_RANDOM_BYTES: Final = 16
#: the owner of everything when the server has no API keys (one owner, as a single-user proxy)
ANONYMOUS: Final = ""
#: what a record costs beyond its bytes: the record and its id, the map entries, its slots
RECORD_OVERHEAD: Final = 800
#: what each distinct bytes object a record holds costs beyond its length: the object's
#: header and allocation, and the entry counting its holders
PART_OVERHEAD: Final = 160
#: a cancel's answers: the response has ended (cancelled, or it had ended before)
CANCELLED: Final = "cancelled"
#: … it was not run in the background, so it cannot be cancelled
NOT_BACKGROUND: Final = "not_background"
#: the statuses of a response that has not ended (only a background one is seen so)
RUNNING: Final = frozenset({"queued", "in_progress"})



class Item(msgspec.Struct, frozen=True):
    """One item of a conversation: its id and its JSON bytes (openai/conversations.py)."""

    id: str
    data: bytes

class StoredResponse(msgspec.Struct, frozen=True):
    """One stored response; every field but ``owner`` is what the API returns, as JSON bytes."""

    id: str
    response: bytes  # the Response object, as GET /v1/responses/{id} returns it
    output: tuple[bytes, ...]  # its output items: the next turn's history ends with them
    conversation: tuple[bytes, ...]  # the input items it answered, earlier turns' included
    #: where it is: ``queued`` and ``in_progress`` until it ends (a background response)
    status: str = "completed"
    background: bool = False  # run with ``background: true``: cancellable, its events kept
    #: a background response's stream events so far, SSE-encoded, one per sequence number
    events: tuple[bytes, ...] = ()
    #: who made it (http/identity.py): nobody else sees it
    owner: str = ANONYMOUS

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    def history(self) -> tuple[bytes, ...]:
        """What a follow-up continues: the conversation, then this response's output."""
        return self.conversation + self.output


class Lineage(msgspec.Struct, frozen=True):
    """Where a record's history came from, so a database stores only what the record adds.

    ``parent``: the response it continues (``previous_response_id``); else
    ``conversation``, whose items numbered below ``upto`` were the first
    ``inherited`` items of its history when it was read.
    """

    parent: str | None = None
    conversation: str | None = None
    upto: int = 0
    inherited: int = 0


class RemoteResponses(Protocol):
    """A sibling process's store, reached by its holder tag (control/response_rpc.py).

    Each call names the owner asking; the sibling answers as its own store
    does, so another owner's response is not held.
    """

    async def fetch(self, holder: str, response_id: str, owner: str) -> StoredResponse | None: ...

    async def delete(self, holder: str, response_id: str, owner: str) -> bool: ...

    async def cancel(self, holder: str, response_id: str, owner: str) -> str | None:
        """The sibling's answer to a cancel (:meth:`ResponseStore.cancel`); None: not held."""
        ...


class DurableResponses(Protocol):
    """Where stored responses outlive the process (state/shell.py): a database.

    With one, this store is the cache in front of it: a record is written
    there before its id is answered, and a record this process does not hold
    is read from there.
    """

    async def put(self, record: StoredResponse, running: bool = False,
                  lineage: Lineage | None = None) -> bool:
        """Commit ``record`` (``running``: under a lease its process renews; ``lineage``:
        where its history is stored already); False: not stored."""
        ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def has(self, response_id: str, owner: str) -> bool: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...

    #: how long a running response's row is believed without its process renewing it
    lease_s: float

    async def renew(self, response_ids: Sequence[str],
                    progress: Sequence[StoredResponse] = ()) -> Sequence[str]:
        """Renew the leases of these running responses, writing the ``progress`` (records
        as they are now) of some; those of them to cancel."""
        ...

    async def request_cancel(self, response_id: str, owner: str) -> bool: ...


class ConversationLog(Protocol):
    """Conversations a response's turn is added to (state/shell.py)."""

    async def add_items(self, conversation_id: str, owner: str,
                        items: Sequence[Item]) -> bool: ...


class Running(Protocol):
    """The background responses this process runs (http/background.py)."""

    def record(self, response_id: str) -> StoredResponse | None:
        """A running response's record as it is now; None: no such response runs here."""
        ...

    async def cancel(self, response_id: str) -> str | None:
        """Cancel a response running here: :data:`CANCELLED` once it has ended."""
        ...


def new_response_id(holder: str = "") -> str:
    """A response id: ``holder``'s tag, then 128 bits from the OS's CSPRNG."""
    return f"{PREFIX}{holder}{secrets.token_hex(ID_RANDOM_BYTES)}"


def holder_of(response_id: str) -> str | None:
    """The holder tag an id of ours carries; None for an id no process of ours made."""
    if not response_id.startswith(PREFIX) or len(response_id) <= len(PREFIX) + HOLDER_CHARS:
        return None
    tag = response_id[len(PREFIX):len(PREFIX) + HOLDER_CHARS]
    return tag if all(c in "0123456789abcdef" for c in tag) else None


@dataclasses.dataclass(slots=True)
class _Held:
    """A bytes object some records of one owner hold, counted once."""

    data: bytes
    holders: int


@dataclasses.dataclass(slots=True)
class _Owner:
    """What one owner holds: its bytes (records and running logs) and its records' ids."""

    bytes: int = 0
    live: int = 0  # of ``bytes``: its running background responses' event logs
    records: OrderedDict[str, None] = dataclasses.field(default_factory=OrderedDict)


class ResponseStore:
    """This process's stored responses: at most ``max_bytes``, none older than ``ttl_s``.

    ``max_bytes_per_owner``: no owner holds more (None: the whole budget, so
    a server with one owner uses all of it). ``durable``: the database behind
    this store (None: this memory is all there is); ``conversations``: where a
    response that names a conversation adds its turn. The background
    responses and the siblings' stores each hold this store, so they come
    after it, through :meth:`connect`.
    """

    def __init__(self, max_bytes: int, ttl_s: float, *, holder: str | None = None,
                 max_bytes_per_owner: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[], None] | None = None,
                 durable: DurableResponses | None = None,
                 conversations: ConversationLog | None = None) -> None:
        self.max_bytes = max_bytes
        self.owner_cap = min(max_bytes, max_bytes_per_owner or max_bytes)
        self.ttl_s = ttl_s
        self.on_evict = on_evict  # a record left early, for the budget (a metric counts it)
        self.holder = holder or secrets.token_hex(HOLDER_CHARS // 2)
        self.clock = clock
        #: the database behind this store (None: this memory is all there is)
        self.durable = durable
        #: where a response that names a conversation adds its turn (state/shell.py)
        self.conversations = conversations
        #: the background responses running here, as they are now (:meth:`connect`)
        self.running: Running | None = None
        #: the siblings' stores, reached by holder tag (:meth:`connect`; None: no link)
        self.remote: RemoteResponses | None = None
        self.bytes = 0
        self.evicted = 0
        self._records: OrderedDict[str, tuple[StoredResponse, float]] = OrderedDict()
        self._owners: dict[str, _Owner] = {}
        #: (owner, id() of a held bytes object) -> it, and its holders
        self._held: dict[tuple[str, int], _Held] = {}

    def connect(self, running: Running | None, remote: RemoteResponses | None) -> None:
        """Give the store the objects built after it that hold it: the background responses
        ``running`` here, and the ``remote`` stores of the sibling processes (the replica
        link's). Called once, by the daemon that built them, before any task runs."""
        self.running = running
        self.remote = remote

    def __len__(self) -> int:
        return len(self._records)

    def new_id(self) -> str:
        """The id of a response this process answers: its holder tag, then 128 random bits."""
        return new_response_id(self.holder)

    def owner_bytes(self, owner: str) -> int:
        """What ``owner`` holds now: its records and its running responses' logs."""
        usage = self._owners.get(owner)
        return 0 if usage is None else usage.bytes

    def put(self, record: StoredResponse) -> bool:
        """Keep ``record``; False if it alone is larger than its owner may hold."""
        if self._cost(record) > self.owner_cap:
            return False
        self._remove(record.id)
        self._records[record.id] = (record, self.clock())
        usage = self._usage(record.owner)
        usage.records[record.id] = None
        added = RECORD_OVERHEAD
        for data in self._parts(record):
            held = self._held.get((record.owner, id(data)))
            if held is None:
                self._held[(record.owner, id(data))] = _Held(data, 1)
                added += len(data) + PART_OVERHEAD
            else:
                held.holders += 1
        self._add(usage, added)
        self._expire()
        self._make_room(record.owner)
        return True

    def charge(self, owner: str, delta: int) -> bool:
        """Count ``delta`` more (or, negative, fewer) bytes of a running response's log
        against ``owner``, making room as :meth:`put` does.

        False when the logs cannot fit: the owner's running logs alone are over
        what it may hold, or everyone's over the budget (its caller stops the
        response, which must not grow).
        """
        usage = self._usage(owner)
        usage.live += delta
        self._add(usage, delta)
        if usage.bytes == 0 and not usage.records:
            del self._owners[owner]
        if delta <= 0:
            return True
        self._make_room(owner)
        return usage.live <= self.owner_cap and self.bytes <= self.max_bytes

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The record if this process holds it for ``owner`` and its time is not up.

        A background response still running is seen as it is now, not as its
        last kept record.
        """
        record: StoredResponse | None = None
        if self.running is not None:
            record = self.running.record(response_id)
        if record is None:
            entry = self._records.get(response_id)
            if entry is None:
                return None
            record, stored_at = entry
            if self.clock() - stored_at > self.ttl_s:
                self._expire()
                return None
        return record if record.owner == owner else None

    async def cancel(self, response_id: str, owner: str) -> str | None:
        """Cancel ``owner``'s background response held here: ``cancelled`` once it has ended
        (or it had ended already), ``not_background`` for one that was not run so; None:
        not held."""
        record = self.get(response_id, owner)
        if record is None:
            return None
        if not record.background:
            return NOT_BACKGROUND
        if record.running and self.running is not None:
            return await self.running.cancel(response_id)
        return CANCELLED

    def delete(self, response_id: str, owner: str) -> bool:
        """Drop ``owner``'s record; False if none of that id is held for ``owner``."""
        entry = self._records.get(response_id)
        if entry is None or entry[0].owner != owner:
            return False
        self._remove(response_id)
        return True

    def _usage(self, owner: str) -> _Owner:
        return self._owners.setdefault(owner, _Owner())

    def _add(self, usage: _Owner, delta: int) -> None:
        usage.bytes += delta
        self.bytes += delta

    def _make_room(self, owner: str) -> None:
        """Evict until the budget and ``owner``'s cap hold (see the module's text)."""
        while (victim := self._victim(owner)) is not None:
            self._remove(next(iter(self._owners[victim].records)))
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict()

    def _victim(self, owner: str) -> str | None:
        """Whose oldest record leaves next to make room for ``owner``; None: room enough
        (or nothing that may leave)."""
        mine = self._owners.get(owner)
        if mine is not None and mine.records and mine.bytes > self.owner_cap:
            return owner
        if self.bytes <= self.max_bytes:
            return None
        share = self.max_bytes / len(self._owners)
        if mine is not None and mine.records and mine.bytes > share:
            return owner
        over = [(usage.bytes, name) for name, usage in self._owners.items()
                if usage.records and usage.bytes > share]
        if over:
            return max(over)[1]
        return owner if mine is not None and mine.records else None

    def _expire(self) -> None:
        """Drop records whose time is up: the oldest lead, so stop at the first that is not."""
        deadline = self.clock() - self.ttl_s
        while self._records:
            oldest = next(iter(self._records))
            if self._records[oldest][1] >= deadline:
                return
            self._remove(oldest)

    def _remove(self, response_id: str) -> None:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return
        record = entry[0]
        usage = self._owners[record.owner]
        del usage.records[response_id]
        freed = RECORD_OVERHEAD
        for data in self._parts(record):
            key = (record.owner, id(data))
            held = self._held[key]
            held.holders -= 1
            if held.holders == 0:
                del self._held[key]
                freed += len(data) + PART_OVERHEAD
        self._add(usage, -freed)
        if usage.bytes == 0 and not usage.records:
            del self._owners[record.owner]

    @staticmethod
    def _parts(record: StoredResponse) -> list[bytes]:
        """The record's bytes objects, each once (a record may hold one twice)."""
        seen: dict[int, bytes] = {}
        for data in (record.response, *record.output, *record.conversation, *record.events):
            seen.setdefault(id(data), data)
        return list(seen.values())

    def _cost(self, record: StoredResponse) -> int:
        return RECORD_OVERHEAD + sum(len(d) + PART_OVERHEAD for d in self._parts(record))


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
