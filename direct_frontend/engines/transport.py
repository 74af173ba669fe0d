"""The one place Trio meets asyncio: grpclib calls to one engine.

grpclib is asyncio-native, so every call runs on the trio-asyncio loop. A
streaming call is pumped by one asyncio task that decodes each reply with the
stream's dialect decoder and pushes neutral events (or a classified
:class:`EngineError`) into an unbounded Trio channel; errors travel in-band so
no nursery ever sees them. Leaving the context early cancels the asyncio task,
which resets the HTTP/2 stream (the engine sees a cancel). See docs/stack.md §3.

The per-token hot path is kept short: the pump takes every whole message
grpclib has already received in one go (:mod:`~direct_frontend.engines.grpclib_reader`,
a shim over grpclib's internals, the public iteration when it is off) and pushes
their events as one channel item, and the asyncio task is owned by the
context manager itself (created on entry, cancelled and awaited on exit), so
a stream costs no Trio task or nursery of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from typing import Any

import trio
import trio_asyncio
from grpclib.client import Channel, UnaryStreamMethod, UnaryUnaryMethod
from grpclib.config import Configuration
from grpclib.encoding.proto import ProtoStatusDetailsCodec, _googleapis_available
from h2.connection import H2Connection

from direct_frontend.engines.dialects.base import Dialect, Rpc, StreamDecoder
from direct_frontend.engines.dialects.ids import encode_request
from direct_frontend.engines.grpclib_reader import (
    EncodedCodec,
    MessageReader,
    one_write,
    send_request,
)
from direct_frontend.engines.neutral import EngineEvent
from direct_frontend.errors import EngineError

#: closed streams an HTTP/2 connection remembers (h2's default is 65,536: ≈ 9 MiB per engine
#: connection once that many requests have run, so a daemon's memory grew for its first 65k
#: requests per engine). It only has to cover frames still in flight on a stream we just
#: closed or reset, a round trip's worth; 4,096 is seconds of it at thousands of requests/s.
H2_CLOSED_STREAMS_KEPT = 4096
H2Connection.MAX_CLOSED_STREAMS = H2_CLOSED_STREAMS_KEPT

# Stock servers accept client pings no more often than every 10 s (docs/engine-contracts.md §12.2).
KEEPALIVE = Configuration(_keepalive_time=20.0, _keepalive_timeout=10.0)
YIELD_EVERY = 16  # a tight asyncio loop must give Trio a turn (docs/stack.md §3.1 rule 3)
#: most messages decoded per channel item. The batched pump waits for data after every
#: batch (it takes all that was buffered), except after a full one, where it yields
#: instead: Trio gets a turn at least every BATCH_MAX messages. 16 cost ≈ 10 % more CPU
#: per request (more, smaller SSE writes) with no better heartbeat under a flood
#: (tests/test_transport.py::test_a_flooding_engine_does_not_starve_trio).
BATCH_MAX = 64

#: one channel item: the events of the messages taken together, or the stream's error
StreamItem = list[EngineEvent] | EngineError


class EventReceiver:
    """The Trio side of one engine stream: neutral events, errors re-raised.

    ``receive_nowait`` lets the HTTP relay drain everything already queued
    and write it in one send. The pump sends events in batches; they come out
    one by one here, in order, with an error only after the events before it.
    """

    __slots__ = ("_batch", "_rx", "error")

    def __init__(self, rx: trio.MemoryReceiveChannel[StreamItem]) -> None:
        self._rx = rx
        self._batch: list[EngineEvent] = []  # the rest of the current item, reversed
        self.error: EngineError | None = None

    async def receive(self) -> EngineEvent | None:
        """Next event, or ``None`` once the stream is over."""
        if self._batch:
            await trio.lowlevel.checkpoint()
            return self._batch.pop()
        try:
            item = await self._rx.receive()
        except trio.EndOfChannel:
            return None
        return self._unpack(item)

    def receive_nowait(self) -> EngineEvent | None:
        """Next queued event; ``None`` when nothing is queued right now or the stream is over."""
        if self._batch:
            return self._batch.pop()
        try:
            item = self._rx.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None
        return self._unpack(item)

    def _unpack(self, item: StreamItem) -> EngineEvent:
        if isinstance(item, EngineError):
            self.error = item
            raise item
        item.reverse()  # the pump never touches a list once sent
        event = item.pop()
        self._batch = item
        return event


class EngineChannel:
    """A grpclib channel to one engine, used from Trio.

    Create and close it inside ``trio_asyncio.open_loop()``; the HTTP/2
    connection is opened lazily and re-opened by grpclib after a fault.
    """

    def __init__(self, host: str, port: int, dialect: Dialect) -> None:
        self.host = host
        self.port = port
        self.dialect = dialect
        # (a codec given, grpclib no longer adds its status details codec where googleapis'
        # protos are installed: added here as it would)
        details = ProtoStatusDetailsCodec() if _googleapis_available() else None
        self._channel = Channel(host, port, config=KEEPALIVE, codec=EncodedCodec(),
                                status_details_codec=details)
        self.connections_opened = 0  # proves reloads keep untouched connections
        self._last_protocol: object = None

    def close(self) -> None:
        self._channel.close()

    def _note_connection(self) -> None:
        protocol = getattr(self._channel, "_protocol", None)
        if protocol is not None and protocol is not self._last_protocol:
            self._last_protocol = protocol
            self.connections_opened += 1

    async def unary(
        self, rpc: Rpc, deadline_s: float, metadata: Mapping[str, str] | None = None
    ) -> Any:
        """One unary call with a gRPC deadline (the engine sees it); errors are classified.

        ``metadata`` goes out with the call (a trace's ``traceparent``).
        """
        method: UnaryUnaryMethod[Any, Any] = UnaryUnaryMethod(
            self._channel, rpc.path, type(rpc.request), rpc.response_type
        )

        async def call() -> Any:
            return await method(rpc.request, timeout=deadline_s, metadata=metadata)

        try:
            reply = await trio_asyncio.aio_as_trio(call)()
        except Exception as exc:
            raise self.dialect.classify(exc) from exc
        finally:
            self._note_connection()
        return reply

    def stream(
        self,
        rpc: Rpc,
        decoder: StreamDecoder,
        deadline_s: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Streaming:
        """A server-streaming call, opened by ``async with``, which gives the receiver of
        its neutral events.

        ``metadata`` goes out with the call (a trace's ``traceparent``).
        """
        return Streaming(self, rpc, decoder, deadline_s, metadata)

    def _start(
        self, rpc: Rpc, decoder: StreamDecoder, deadline_s: float | None,
        metadata: Mapping[str, str] | None, tx: trio.MemorySendChannel[StreamItem],
    ) -> asyncio.Task[None]:
        """The task that makes a :class:`Streaming` call and pumps its events into ``tx``."""
        method: UnaryStreamMethod[Any, Any] = UnaryStreamMethod(
            self._channel, rpc.path, type(rpc.request), rpc.response_type
        )
        dialect = self.dialect

        async def pump() -> None:
            with tx:
                try:
                    async with method.open(timeout=deadline_s, metadata=metadata) as call:
                        # HEADERS and DATA: one socket write
                        message = encode_request(rpc.request, rpc.runs)
                        await one_write(self._channel, send_request(call, message))
                        self._note_connection()
                        await call.recv_initial_metadata()
                        reader = MessageReader.attach(call)
                        if reader is None:
                            await _pump_public(call, decoder, tx)
                        else:
                            await _pump_batched(reader, decoder, tx)
                        decoder.end()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    tx.send_nowait(dialect.classify(exc))

        loop: asyncio.AbstractEventLoop = trio_asyncio.current_loop.get()
        return loop.create_task(pump())


class Streaming:
    """One server-streaming call's ``async with`` block (:meth:`EngineChannel.stream`).

    Its pump task lives exactly as long as the block: created on the way in,
    and on the way out cancelled (if still running: grpclib then resets the
    stream) and waited for. A class rather than an ``asynccontextmanager``:
    every engine call opens one, and an async generator's block costs about
    1 µs more.
    """

    __slots__ = ("_call", "_channel", "_task", "_tx")

    def __init__(self, channel: EngineChannel, rpc: Rpc, decoder: StreamDecoder,
                 deadline_s: float | None, metadata: Mapping[str, str] | None) -> None:
        self._channel = channel
        self._call = (rpc, decoder, deadline_s, metadata)

    async def __aenter__(self) -> EventReceiver:
        tx, rx = trio.open_memory_channel[StreamItem](math.inf)
        self._tx = tx
        self._task = self._channel._start(*self._call, tx)
        return EventReceiver(rx)

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await _join(self._task)
        finally:
            self._tx.close()  # the pump closes it, unless it was cancelled before it ever ran


async def _join(task: asyncio.Task[None]) -> None:
    """Cancel the pump task if it still runs and wait until it has finished.

    A Trio cancellation of the caller does not cut the wait short (the task
    is cancelled and awaited all the same, then ``trio.Cancelled`` is raised).
    The pump sends its errors in-band, so only a bug ends it with an exception;
    that one is raised here.
    """
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # the cancellation requested above
            await trio_asyncio.run_aio_future(task)
    elif not task.cancelled():
        task.result()


async def _pump_batched(
    reader: MessageReader, decoder: StreamDecoder, tx: trio.MemorySendChannel[StreamItem]
) -> None:
    """The pump's loop: every message already received, decoded and sent as one item.

    A failure sends the events decoded before it first, then propagates.
    """
    feed = decoder.feed
    events: list[EngineEvent] = []
    try:
        while (replies := await reader.batch(BATCH_MAX)) is not None:
            for reply in replies:
                event = feed(reply)
                if event is not None:
                    events.append(event)
            if events:
                tx.send_nowait(events)
                events = []
            if len(replies) >= BATCH_MAX:
                await asyncio.sleep(0)  # more buffered: give Trio a turn
    except Exception:
        if events:  # the events before the failure go first
            tx.send_nowait(events)
        raise


async def _pump_public(
    call: Any, decoder: StreamDecoder, tx: trio.MemorySendChannel[StreamItem]
) -> None:
    """The pump's loop on grpclib's public API: one message at a time (fallback)."""
    count = 0
    async for reply in call:
        event = decoder.feed(reply)
        if event is not None:
            tx.send_nowait([event])
        count += 1
        if count % YIELD_EVERY == 0:
            await asyncio.sleep(0)
