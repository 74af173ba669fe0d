"""The one place Trio meets asyncio: grpclib calls to one engine.

grpclib is asyncio-native, so every call runs on the trio-asyncio loop. A
streaming call is pumped by one asyncio task that decodes each reply with the
stream's dialect decoder and pushes neutral events (or a classified
:class:`EngineError`) into an unbounded Trio channel; errors travel in-band so
no nursery ever sees them. Leaving the context early cancels the asyncio task,
which resets the HTTP/2 stream (the engine sees a cancel). See docs/stack.md §3.

The per-token hot path is kept short: the pump takes every whole message
grpclib has already received in one go (:class:`_MessageReader`) and pushes
their events as one channel item, and the asyncio task is owned by the
context manager itself (created on entry, cancelled and awaited on exit), so
a stream costs no Trio task or nursery of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio
import trio_asyncio
from grpclib.client import Channel, UnaryStreamMethod, UnaryUnaryMethod
from grpclib.config import Configuration
from grpclib.encoding.proto import ProtoCodec

from direct_frontend.engines.dialects.base import Dialect, Rpc, StreamDecoder
from direct_frontend.engines.neutral import EngineEvent
from direct_frontend.errors import EngineError

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
#: a gRPC message prefix: compressed flag, length
_PREFIX = struct.Struct(">BI").unpack_from


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


class _MessageReader:
    """Whole gRPC messages taken straight from grpclib's receive buffer of one stream.

    grpclib reads a stream one message at a time: two buffer reads, its
    deadline/termination wrapper, an event dispatch and a flow-control ack
    per DATA frame, about 10 µs per message on our cores. Engines send one
    message per token and several have usually arrived by the time the pump
    runs, so this reader takes *everything* already received in one go (one
    ack for all of it), then cuts it at the 5-byte gRPC message prefixes. It
    awaits only when no whole message is buffered, and then inside grpclib's
    wrapper, so a lost connection, a stream reset or a deadline interrupts
    the wait exactly as in grpclib's own ``recv_message``.

    A shim over grpclib 0.4 internals (``Stream._stream.buffer``: an
    ``asyncio.Queue`` of ``(data, data_size, ack_size)`` chunks, an empty one
    at the end of the stream): :meth:`attach` returns ``None`` when they are
    not there, and the pump then uses grpclib's public iteration. Event
    listeners on the channel (``grpclib.events.RecvMessage``) are not called
    for messages read this way; ours registers none.
    """

    __slots__ = ("_ack", "_buffer", "_chunks", "_decode", "_ended", "_need", "_queue",
                 "_size", "_wrapper")

    def __init__(self, call: Any) -> None:
        buffer = call._stream.buffer
        self._buffer = buffer
        self._queue: asyncio.Queue[Any] = buffer._unacked
        self._ack: Callable[[int], None] = buffer._ack_callback
        self._wrapper: contextlib.AbstractContextManager[None] = call._wrapper
        codec, message_type = call._codec, call._recv_type
        self._decode: Callable[[bytes], Any] = (
            message_type.FromString  # what ProtoCodec.decode calls, one call less per message
            if type(codec) is ProtoCodec
            else functools.partial(codec.decode, message_type=message_type)
        )
        self._chunks: list[bytes] = []  # received bytes not yet cut into messages
        self._size = 0
        self._need = 5  # bytes the next message needs, as far as known
        self._ended = False
        for chunk in buffer._acked:  # grpclib's own reads moved these already (none do)
            self._append(bytes(chunk.data))
        buffer._acked.clear()
        buffer._acked_size = 0

    @classmethod
    def attach(cls, call: Any) -> _MessageReader | None:
        """A reader for ``call`` (initial metadata received), or ``None`` if grpclib differs."""
        try:
            buffer = call._stream.buffer
            ok = (
                isinstance(buffer._unacked, asyncio.Queue)
                and isinstance(buffer._acked, collections.deque)
                and callable(buffer._ack_callback)
                and isinstance(buffer._eof, bool)
                and call._wrapper is not None
                and callable(call._codec.decode)
                and call._recv_type is not None
                and (type(call._codec) is not ProtoCodec or callable(call._recv_type.FromString))
            )
        except AttributeError:
            return None
        return cls(call) if ok else None

    def _append(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._size += len(data)

    def _take_queued(self) -> None:
        """Move every chunk grpclib has queued into our buffer, acking them all at once."""
        queue = self._queue
        ack = 0
        while not queue.empty():
            data, size, ack_size = queue.get_nowait()
            ack += ack_size
            if size:
                self._chunks.append(data)
                self._size += size
            elif not ack_size and self._buffer._eof and queue.empty():
                self._ended = True  # grpclib's end-of-stream marker (always last)
        if ack:
            self._ack(ack)

    def _cut(self, limit: int) -> list[Any]:
        """Decode up to ``limit`` whole messages from the buffered bytes."""
        if self._size < self._need:
            return []
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        end_of_data = len(data)
        decode = self._decode
        messages: list[Any] = []
        pos = 0
        need = 5
        while end_of_data - pos >= 5:
            compressed, length = _PREFIX(data, pos)
            if compressed:
                raise NotImplementedError("Compression not implemented")  # as grpclib
            end = pos + 5 + length
            if end > end_of_data:
                need = end - pos
                break
            messages.append(decode(data[pos + 5 : end]))
            pos = end
            if len(messages) >= limit:
                break
        rest = data[pos:] if pos else data
        self._chunks = [rest] if rest else []
        self._size = len(rest)
        self._need = need
        return messages

    async def batch(self, limit: int) -> list[Any] | None:
        """The next 1..``limit`` messages, waiting for one if none is buffered; ``None`` at
        the end of the stream."""
        while True:
            self._take_queued()
            messages = self._cut(limit)
            if messages:
                return messages
            if self._ended:
                if self._size:
                    raise AssertionError("Received less data than expected")  # as grpclib
                return None
            with self._wrapper:
                data, size, ack_size = await self._queue.get()
            if ack_size:
                self._ack(ack_size)
            if size:
                self._chunks.append(data)
                self._size += size
            elif not ack_size and self._buffer._eof and self._queue.empty():
                self._ended = True


class EngineChannel:
    """A grpclib channel to one engine, used from Trio.

    Create and close it inside ``trio_asyncio.open_loop()``; the HTTP/2
    connection is opened lazily and re-opened by grpclib after a fault.
    """

    def __init__(self, host: str, port: int, dialect: Dialect) -> None:
        self.host = host
        self.port = port
        self.dialect = dialect
        self._channel = Channel(host, port, config=KEEPALIVE)
        self.connections_opened = 0  # proves reloads keep untouched connections
        self._last_protocol: object = None

    def close(self) -> None:
        self._channel.close()

    def _note_connection(self) -> None:
        protocol = getattr(self._channel, "_protocol", None)
        if protocol is not None and protocol is not self._last_protocol:
            self._last_protocol = protocol
            self.connections_opened += 1

    async def unary(self, rpc: Rpc, deadline_s: float) -> Any:
        """One unary call with a gRPC deadline (the engine sees it); errors are classified."""
        method: UnaryUnaryMethod[Any, Any] = UnaryUnaryMethod(
            self._channel, rpc.path, type(rpc.request), rpc.response_type
        )

        async def call() -> Any:
            return await method(rpc.request, timeout=deadline_s)

        try:
            reply = await trio_asyncio.aio_as_trio(call)()
        except Exception as exc:
            raise self.dialect.classify(exc) from exc
        finally:
            self._note_connection()
        return reply

    @contextlib.asynccontextmanager
    async def stream(
        self, rpc: Rpc, decoder: StreamDecoder, deadline_s: float | None = None
    ) -> AsyncIterator[EventReceiver]:
        """Open a server-streaming call and yield the receiver of its neutral events."""
        tx, rx = trio.open_memory_channel[StreamItem](math.inf)
        method: UnaryStreamMethod[Any, Any] = UnaryStreamMethod(
            self._channel, rpc.path, type(rpc.request), rpc.response_type
        )
        dialect = self.dialect

        async def pump() -> None:
            with tx:
                events: list[EngineEvent] = []
                try:
                    async with method.open(timeout=deadline_s) as call:
                        await call.send_message(rpc.request, end=True)
                        self._note_connection()
                        await call.recv_initial_metadata()
                        reader = _MessageReader.attach(call)
                        if reader is None:
                            await _pump_public(call, decoder, tx)
                        else:
                            feed = decoder.feed
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
                        decoder.end()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if events:  # the events before the failure go first
                        tx.send_nowait(events)
                    tx.send_nowait(dialect.classify(exc))

        # The pump task lives exactly as long as this block: created here, and on the way
        # out cancelled (if still running: grpclib then resets the stream) and waited for.
        task = trio_asyncio.current_loop.get().create_task(pump())
        try:
            yield EventReceiver(rx)
        finally:
            try:
                await _join(task)
            finally:
                tx.close()  # the pump closes it, unless it was cancelled before it ever ran


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
