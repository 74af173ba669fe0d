"""Stored responses across replicas: ask the sibling that holds one, answer for ours.

A stored response (the Responses API) stays with the replica that answered
it; its id carries that replica's holder tag (openai/response_store.py). A
sibling asked for it asks the holder over NATS (:meth:`ResponseRpc.fetch`,
``delete``, ``cancel``: the store's ``remote``), the one request that does
wait on NATS, and only for as long as ``RESPONSE_TIMEOUT_S``. The holder
says yes or no, then sends the record to the asker's inbox in chunks (a long
conversation outgrows a NATS message).

The link (control/replicas.py) owns the connection; this module speaks
through what :class:`~direct_frontend.control.bus.Link` names of it, and the
link hands it every message on :attr:`ResponseRpc.subject`.
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # before nats, see cli.py

# isort: split
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import ClassVar

import trio

from direct_frontend.control.bus import ChunkInbox, Link
from direct_frontend.control.replica_wire import ResponseQuery, decode, encode
from direct_frontend.kv.snapshot import CHUNK_BYTES, split
from direct_frontend.openai.response_store import (
    CANCELLED,
    ResponseStore,
    StoredResponse,
    decode_record,
    encode_record,
)

log = logging.getLogger("direct_frontend.replicas")

#: how long a request waits for the sibling that holds the stored response it names
RESPONSE_TIMEOUT_S = 1.0


class ResponseRpc:
    """One replica's side of the stored-response RPC, over ``link``, for ``store``."""

    def __init__(self, link: Link, store: ResponseStore) -> None:
        self.link = link
        self.store = store
        #: where siblings ask about the responses ``store`` holds
        self.subject = link.subjects.responses(store.holder)
        self.chunk_bytes = CHUNK_BYTES  # a stored response goes to a sibling in pieces this big

    # -- asking a sibling (the store's ``remote``) ----------------------------------------

    async def fetch(self, holder: str, response_id: str, owner: str) -> StoredResponse | None:
        """``owner``'s stored response a sibling holds; None if it does not, is gone or is
        silent."""
        nc = self.link.connection
        if nc is None:
            return None
        try:
            inbox = await ChunkInbox.open(nc)
        except Exception as exc:
            log.debug("replicas: subscribe: %s", exc)
            return None
        try:
            with trio.move_on_after(RESPONSE_TIMEOUT_S * 2):
                query = ResponseQuery(self.link.replica, "get", response_id, inbox.subject, owner)
                if await self._ask(holder, query) != b"ok":
                    return None
                record = decode_record(await inbox.reassembled())
                if record is None or record.id != response_id or record.owner != owner:
                    self.link.malformed("stored response")
                    return None
                self.link.counts["responses_fetched"] += 1
                return record
            self._failed(response_id, "its chunks did not arrive")
            return None
        except ValueError:
            self.link.malformed("stored response")
            return None
        finally:
            await inbox.close()

    async def delete(self, holder: str, response_id: str, owner: str) -> bool:
        """Ask the sibling that holds ``owner``'s stored response to drop it; True if it did."""
        query = ResponseQuery(self.link.replica, "delete", response_id, owner=owner)
        return await self._ask(holder, query) == b"1"

    async def cancel(self, holder: str, response_id: str, owner: str) -> str | None:
        """Ask the sibling that runs ``owner``'s background response to cancel it; its
        answer (openai/response_store.py ``ResponseStore.cancel``), None if it does not hold
        it."""
        query = ResponseQuery(self.link.replica, "cancel", response_id, owner=owner)
        answer = await self._ask(holder, query)
        return answer.decode() if answer else None

    async def _ask(self, holder: str, query: ResponseQuery) -> bytes | None:
        """The holder's answer to ``query``; None if nobody answers for ``holder``."""
        nc = self.link.connection
        if nc is None:
            return None
        import nats.errors

        try:
            with trio.fail_after(RESPONSE_TIMEOUT_S * 2):  # nats' own timeout comes first
                msg = await trio_asyncio.aio_as_trio(nc.request)(
                    self.link.subjects.responses(holder), encode(query),
                    timeout=RESPONSE_TIMEOUT_S,
                )
        except nats.errors.NoRespondersError:
            return None  # nobody answers for that holder any more: its responses went with it
        except (nats.errors.Error, trio.TooSlowError, OSError) as exc:
            self._failed(query.id, exc.__class__.__name__)
            return None
        data: bytes = msg.data
        return data

    def _failed(self, response_id: str, why: str) -> None:
        self.link.counts["response_fetches_failed"] += 1
        log.warning("replicas: no answer about stored response %s from the replica holding it "
                    "(%s)", response_id, why)

    # -- answering for ours ---------------------------------------------------------------

    async def serve(self, data: bytes, reply: str) -> None:
        """Answer a sibling's query about a response ``store`` holds."""
        query = decode(ResponseQuery, data)
        answer = None if query is None or not reply else self._answers.get(query.op)
        if query is None or answer is None:
            return self.link.malformed("stored-response query")
        await answer(self, query, reply)
        self.link.counts["responses_served"] += 1
        return None

    async def _get(self, query: ResponseQuery, reply: str) -> None:
        record = self.store.get(query.id, query.owner)
        if record is None or not query.inbox:
            await self.link.publish(reply, b"")
            return
        data = encode_record(record)  # one synchronous look
        await self.link.publish(reply, b"ok")
        for chunk in split(data, self.chunk_bytes):
            await self.link.publish(query.inbox, chunk)

    async def _delete(self, query: ResponseQuery, reply: str) -> None:
        deleted = self.store.delete(query.id, query.owner)
        await self.link.publish(reply, b"1" if deleted else b"0")

    async def _cancel(self, query: ResponseQuery, reply: str) -> None:
        """Answered once the response has ended, or soon (the cancel is then under way)."""
        answer: str | None = CANCELLED
        with trio.move_on_after(RESPONSE_TIMEOUT_S / 2):
            answer = await self.store.cancel(query.id, query.owner)
        await self.link.publish(reply, (answer or "").encode())

    #: how each query is answered, by its ``op``
    _answers: ClassVar[Mapping[str, Answer]] = {"get": _get, "delete": _delete,
                                                "cancel": _cancel}


Answer = Callable[[ResponseRpc, ResponseQuery, str], Awaitable[None]]
