"""Background responses: ``background: true`` runs a Responses request beside its client.

A reasoning model's answer can take minutes, longer than a client's (or a
proxy's) patience for one connection. With ``background: true`` the request
is answered at once with a ``queued`` Response; it runs in this service's
nursery, and the client polls ``GET /v1/responses/{id}``, follows its events
(``?stream=true&starting_after=N``, as often as it reconnects) or cancels it
(``POST /v1/responses/{id}/cancel``). A client that leaves cancels nothing;
a cancel reaches the engine as the request's Abort, as a disconnect does for
a foreground request.

Every background response writes its stream events to a log, whether or not
it was created with ``stream: true``: the log is what a follower reads, from
any point, with no event lost or sent twice. While it runs, the store sees
it through :meth:`BackgroundResponses.record` (status, output so far, events
so far), so a sibling process that is asked for it gets it as it is now; when
it ends, its final record (events included) is kept like any stored response.

Each response belongs to its owner (http/identity.py), who alone sees,
follows and cancels it. One owner may have at most ``[frontend.responses]
max_background_per_owner`` queued or running at once, and background work
as a whole holds at most half of a model's admission slots
(pipeline/admission.py), so a flood of them never keeps another client's
foreground requests out. A running response's event log counts against its
owner's share of the store as it grows; a log that cannot fit ends the
response ``failed``.

With a database behind the store (``[frontend.responses] backend``), a
response's ``queued`` record is committed before its id is answered, under
a lease this service renews (every :data:`CANCEL_POLL_S`, at most a third
of ``lease_s``) while it runs: if the process dies, the lease runs out and
every reader sees it ``failed``, never stuck. A cancel asked of another
process through the database is read as the lease is renewed, and the
records of those that moved are written with it, so another process
follows them. Its final record is committed when it ends, and a response
that names a conversation adds its turn there before it is seen ended.

The service's nursery lives as long as the HTTP server; at shutdown the
responses still running get the grace period, then are cancelled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import parse_qs

import msgspec
import trio

from direct_frontend.http.asgi import Headers, Receive, Send, encode_json, log
from direct_frontend.http.identity import Caller
from direct_frontend.http.query import query_int
from direct_frontend.http.responses_api import (
    Event,
    ResponseBuilder,
    SseEvents,
    entries,
    failure,
    outcome,
    usage,
)
from direct_frontend.http.stored_responses import append_turn, find, keep
from direct_frontend.http.stream import SSE_HEADERS, ClientWatch, parsed
from direct_frontend.observability.metrics import Metrics
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    internal_error,
    invalid_request,
    rate_limited,
    response_not_found,
    response_too_large,
    shutting_down,
    store_unavailable,
)
from direct_frontend.openai.response_store import (
    CANCELLED,
    RUNNING,
    ResponseStore,
    StoredResponse,
)
from direct_frontend.openai.responses_api import ResponsesRequest
from direct_frontend.openai.types import ChatRequest
from direct_frontend.pipeline.relay_events import Batch, Failed, Finished, Opened, Usage
from direct_frontend.pipeline.serve import Later
from direct_frontend.pipeline.serve_events import Placed, Prepared, StairEvent
from direct_frontend.state.sql import StoreError
from direct_frontend.text.token_bytes import TokenBytes

#: with a database: how often the leases are renewed at most, which is how soon a cancel
#: asked of another process reaches the one running the response
CANCEL_POLL_S: Final = 1.0


class _Run:
    """One background response: its builder, its event log, and how to stop it; the writer
    of its stair's events (its output goes to the log)."""

    def __init__(self, builder: ResponseBuilder, caller: Caller, store: ResponseStore,
                 tokens: TokenBytes) -> None:
        self.builder = builder
        self.owner = caller.owner
        self.store = store
        self.tokens = tokens  # the model's, to write logprobs with
        self.logged = 0  # the bytes of its event log, counted against its owner in the store
        self.written = 0  # with a database: the events its row held when last written
        self.too_large = False  # its log outgrew what its owner may hold: it is being stopped
        self.status = "queued"
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        #: once placed: the usage so far (the prompt's, then each batch's)
        self.so_far: Usage | Batch | None = None
        self.incomplete: str | None = None
        self.events: list[bytes] = []  # SSE-encoded; index = sequence number
        self.sse = SseEvents()
        self.scope = trio.CancelScope()
        self.ended = trio.Event()
        self.wake = trio.Event()  # set when events are added or it ends, then replaced

    def add(self, events: Sequence[Event]) -> None:
        """Log ``events``, count them against the owner, and wake the followers.

        A log that no longer fits its owner's share stops the response.
        """
        encoded = self.sse.each(events)
        size = sum(map(len, encoded))
        self.logged += size
        if not self.store.charge(self.owner, size) and not self.too_large:
            self.too_large = True
            self.scope.cancel()
        self.events.extend(encoded)
        self.wake.set()
        self.wake = trio.Event()

    def response(self) -> dict[str, Any]:
        response = self.builder.response(self.status, self.usage, self.incomplete)
        if self.error is not None:
            response["error"] = self.error
        return response

    def end(self, status: str, events: list[Event]) -> None:
        """The response ended as ``status``: its last events, the terminal one among them."""
        self.status = status
        so_far = self.so_far
        if self.usage is None and so_far is not None:  # cut short: what it used so far
            self.usage = usage(so_far if isinstance(so_far, Usage) else Usage(
                so_far.prompt_tokens, so_far.completion_tokens, so_far.cached_tokens))
        events.append({"type": f"response.{status}", "response": self.response()})
        self.add(events)

    def fail(self, err: OpenAIHTTPError) -> None:
        self.error, event = failure(err)
        self.end("failed", [*self.builder.finish("failed"), event])

    async def __call__(self, event: StairEvent, index: int = 0) -> None:
        """The stair's next event: the output goes to the log as the stream's events."""
        builder = self.builder
        if type(event) is Batch:
            self.so_far = event
            events = builder.feed(parsed(event), entries(self.tokens, event.logprobs))
            if events:
                self.add(events)
        elif type(event) is Opened:
            self.so_far = event.usage
        elif type(event) is Finished:
            await self._finished(event)
        elif type(event) is Failed:
            self.usage = usage(event.usage)
            self.fail(event.error)
        elif type(event) is Placed:
            self.so_far = Usage(event.prompt_tokens, 0)
            self.status = "in_progress"
            self.add([{"type": "response.in_progress", "response": self.response()}])

    async def _finished(self, end: Finished) -> None:
        """The output is complete: the response ends ``completed`` (or ``incomplete``)."""
        builder = self.builder
        last = end.last
        events = builder.feed(parsed(last), entries(self.tokens, last.logprobs))
        status, self.incomplete = outcome(end)
        self.usage = usage(end.usage)
        closing = builder.finish(status)
        request = builder.request
        with trio.CancelScope(shield=True):  # in its conversation before it is seen ended
            await append_turn(self.store, request.conversation,
                              [*request.items, *builder.items], self.owner)
        self.end(status, events + closing)


class BackgroundResponses:
    """The background responses this process runs, in one nursery; see the module's text."""

    def __init__(self, store: ResponseStore, metrics: Metrics, max_per_owner: int,
                 lease_s: float = 30.0) -> None:
        self.store = store
        self.metrics = metrics
        self.max_per_owner = max_per_owner
        self.lease_s = lease_s  # with a database: how long a running record's lease lasts
        self._runs: dict[str, _Run] = {}
        self._per_owner: dict[str, int] = {}  # an owner's responses queued or running here
        self._nursery: trio.Nursery | None = None
        metrics.watch_background(lambda: len(self._runs))

    def __len__(self) -> int:
        return len(self._runs)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The nursery the responses run in, until this task is cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.store.durable is not None:
                    nursery.start_soon(self.renew_leases, min(self.lease_s / 3, CANCEL_POLL_S))
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def drain(self) -> None:
        """Until no background response runs (the shutdown's grace bounds the wait)."""
        self._nursery = None  # none is taken from now on
        while self._runs:
            await next(iter(self._runs.values())).ended.wait()

    async def start(self, later: Later, prepared: Prepared, request: ResponsesRequest,
                    response_id: str, caller: Caller) -> dict[str, Any]:
        """Start ``caller``'s response in the background (``later``: the rest of its stair,
        ``prepared``: what its model made of it); its ``queued`` Response object.

        A 429 when the owner has its most running already (the stair gave the
        one of a full admission queue, as a foreground request gets); a 503
        when the server is shutting down, or the database did not take its
        ``queued`` record (with a database, that record is committed before
        the id is answered, under a lease this process renews while it runs:
        if the process dies, readers see the response failed).
        """
        nursery = self._nursery
        if nursery is None:
            raise shutting_down()
        owner = caller.owner
        if self._per_owner.get(owner, 0) >= self.max_per_owner:
            raise rate_limited(
                f"At most {self.max_per_owner} background responses may be queued or running "
                "at once per API key ([frontend.responses] max_background_per_owner): wait for "
                "one to end.", retry_after=1)
        # Streamed from the engine whatever the client asked: a poll sees the output so far.
        chat = msgspec.structs.replace(prepared.request, stream=True)
        assert isinstance(chat, ChatRequest)
        builder = ResponseBuilder(dataclasses.replace(request, chat=chat), response_id,
                                  int(time.time()), stored=True, background=True)
        run = _Run(builder, caller, self.store, prepared.token_bytes)
        self._runs[response_id] = run
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        run.add([{"type": "response.created", "response": run.response()},
                 {"type": "response.queued", "response": run.response()}])
        if not await keep(self.store, self._record(run), running=True,
                          lineage=request.lineage()):
            self._forget(run, response_id)
            self.store.charge(owner, -run.logged)
            raise store_unavailable()
        if self._nursery is None:  # shutdown began while the record was written
            self._forget(run, response_id)
            self.store.charge(owner, -run.logged)
            await keep(self.store, self._record(self._cut(run)))
            raise shutting_down()
        self._nursery.start_soon(self._serve, run, later, response_id)
        return run.response()

    def _cut(self, run: _Run) -> _Run:
        run.end("cancelled", run.builder.finish("cancelled"))
        return run

    def _forget(self, run: _Run, response_id: str) -> None:
        del self._runs[response_id]
        left = self._per_owner.pop(run.owner) - 1
        if left:
            self._per_owner[run.owner] = left
        run.ended.set()
        run.wake.set()

    async def renew_leases(self, interval_s: float) -> None:
        """Renew the database leases of the responses running here, every ``interval_s``,
        with the progress of those that moved (another process follows them from the
        database), and cancel those another process was asked to cancel."""
        durable = self.store.durable
        assert durable is not None
        while True:
            await trio.sleep(interval_s)
            moved = {run: len(run.events) for run in self._runs.values()
                     if len(run.events) != run.written}
            try:
                cancelled = await durable.renew(list(self._runs),
                                                [self._record(run) for run in moved])
            except StoreError as exc:
                log.warning("background leases not renewed (next try in %.0f s): %s",
                            interval_s, exc)
                continue
            for moving, written in moved.items():
                moving.written = written
            for response_id in cancelled:
                run = self._runs.get(response_id)
                if run is not None:
                    run.scope.cancel()

    def record(self, response_id: str) -> StoredResponse | None:
        """A running response's record as it is now; None if none of that id runs here."""
        run = self._runs.get(response_id)
        return None if run is None else self._record(run)

    def running(self, response_id: str) -> _Run | None:
        """The response of that id while it runs here (a follower reads its log)."""
        return self._runs.get(response_id)

    async def cancel(self, response_id: str) -> str | None:
        """Cancel a response running here; once it has ended, ``cancelled``.

        None if none of that id runs here.
        """
        run = self._runs.get(response_id)
        if run is None:
            return None
        run.scope.cancel()
        await run.ended.wait()
        return CANCELLED

    @staticmethod
    def _record(run: _Run) -> StoredResponse:
        record = run.builder.record(encode_json(run.response()), run.owner)
        return msgspec.structs.replace(record, status=run.status, background=True,
                                       events=tuple(run.events))

    async def _serve(self, run: _Run, later: Later, response_id: str) -> None:
        """Run the response to its end, whatever that is, and keep its final record."""
        try:
            with run.scope:
                try:
                    await later.run(run)
                except OpenAIHTTPError as err:  # refused: no slot, too long, no engine
                    run.fail(err)
        except Exception:  # a bug: this response fails, the others go on
            log.exception("background response %s failed", response_id)
            if run.status in RUNNING:
                run.fail(internal_error())
        finally:
            if run.status in RUNNING and run.too_large:
                run.fail(response_too_large(self.store.owner_cap))
            elif run.status in RUNNING:  # cancelled: by a cancel (its own scope), or at shutdown
                if run.scope.cancelled_caught:
                    self.metrics.request_cancelled()
                run.end("cancelled", run.builder.finish("cancelled"))
            self.store.charge(run.owner, -run.logged)  # the log is now the record's
            record = self._record(run)
            if run.too_large:  # the log is what did not fit: the response is kept without it
                record = msgspec.structs.replace(record, events=())
            with trio.CancelScope(shield=True):  # at shutdown too: its end is written
                kept = await keep(self.store, record, lineage=run.builder.request.lineage())
            if not kept:
                log.warning("background response %s could not be kept (larger than its owner "
                            "may keep, [frontend.responses] max_bytes %d, or the database "
                            "refused it)", response_id, self.store.owner_cap)
            self._forget(run, response_id)


def _lost(response_id: str, sequence: int) -> bytes:
    event = {"type": "error", "code": "response_lost", "param": None, "sequence_number": sequence,
             "message": f"Response '{response_id}' is no longer held by the process that ran it."}
    return b"event: error\ndata: %b\n\n" % encode_json(event)


# -- following a response's events ----------------------------------------------------

#: how often a follower of a sibling's response asks it for what is new
REMOTE_POLL_S: Final = 0.25
#: the largest ``starting_after`` taken (a log never holds this many events)
MAX_SEQUENCE: Final = 2**31


def follow_cursor(query: bytes) -> int | None:
    """``GET /v1/responses/{id}?stream=true&starting_after=N``: follow the events after N (-1:
    from the first); None without ``stream=true`` (a snapshot)."""
    fields = parse_qs(query.decode("latin-1"))
    if fields.get("stream", ["false"])[-1].lower() != "true":
        return None
    raw = fields.get("starting_after", ["-1"])[-1]
    after = query_int(raw, -1, MAX_SEQUENCE)
    if after is None:
        raise invalid_request(f"Invalid 'starting_after': {raw[:40]!r} (a sequence number).",
                              "starting_after")
    return after


async def follow(service: BackgroundResponses, response_id: str, owner: str, after: int,
                 receive: Receive, send: Send, headers: Headers) -> int:
    """Stream a background response's events after ``after`` until it ends.

    Read from its log while it runs here; from its record (a sibling's asked
    again every :data:`REMOTE_POLL_S` while it runs there) otherwise. A
    follower that leaves stops nothing but its own stream.
    """
    store = service.store
    run = service.running(response_id)
    if run is not None and run.owner != owner:
        run = None  # another owner's: as if it were not here
    record = None if run is not None else await find(store, response_id, owner)
    if run is None and record is None:
        raise response_not_found(response_id)
    if record is not None and not record.background:
        raise invalid_request(f"Response '{response_id}' was not created with "
                              "background=true: only a background response can be streamed "
                              "again.", "stream")
    await send({"type": "http.response.start", "status": 200,
                "headers": [*SSE_HEADERS, *headers]})
    cursor = after + 1
    gone = False
    events: Sequence[bytes]
    client = ClientWatch()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run, receive, nursery.cancel_scope.cancel)
        while True:
            if run is not None:
                wake = run.wake
                events, ended = run.events, run.ended.is_set()
            else:
                assert record is not None
                events, ended = record.events, not record.running
            fresh = b"".join(events[cursor:])
            cursor = max(cursor, len(events))
            if gone:  # its owner went away with it (or it left the owner's store)
                fresh += _lost(response_id, cursor)
            if ended or gone:
                await send({"type": "http.response.body", "body": fresh, "more_body": False})
                break
            if fresh:
                await send({"type": "http.response.body", "body": fresh, "more_body": True})
            if run is not None:
                await wake.wait()
            else:  # the owner has no way to wake us: ask it again
                await trio.sleep(REMOTE_POLL_S)
                latest = await find(store, response_id, owner)
                gone = latest is None
                record = latest or record
        nursery.cancel_scope.cancel()
    return 499 if client.gone else 200
