"""The batched gRPC message reader: a shim over grpclib's receive buffer (ADR 0002).

grpclib reads a stream one message at a time; the pump in
:mod:`direct_frontend.engines.transport` reads through :class:`MessageReader`
instead, which takes every whole message already received in one go. It is
the one module that reads grpclib's internals on the hot path: gated on a
checked grpclib release *and* on the internals' shape (:data:`STATUS`, in the
report of :mod:`direct_frontend.observability.shims`), and when either does
not hold, the pump uses grpclib's public iteration.

The internals read (grpclib 0.4): ``Stream._stream.buffer``, an
``asyncio.Queue`` (``_unacked``) of ``(data, data_size, ack_size)`` chunks with
an empty one at the end of the stream (``_eof`` set), its ``_ack_callback``
and ``_acked`` deque; the call's ``_wrapper``, ``_codec`` and ``_recv_type``.

The same gate covers :func:`one_write`, which writes a call's HEADERS and
request DATA in one socket write (one syscall per request, not two): it
reads ``Channel._protocol``, ``H2Protocol.connection`` and
``Connection._transport`` (each with a default: missing, nothing is held);
and :func:`send_framed`, which frames a large request's DATA itself (h2 4.x:
``H2Connection.streams`` and the two ``outbound_flow_control_window``
counters, checked by :data:`STATUS` too).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import struct
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Final, Generic, TypeVar, cast

import grpclib.client
import grpclib.protocol
from grpclib.encoding.proto import ProtoCodec
from h2.config import H2Configuration
from h2.connection import H2Connection

from direct_frontend.observability.shims import ShimStatus, gate, register

log = logging.getLogger("direct_frontend.shims")

SHIM = "grpclib_reader"
#: grpclib releases whose internals above the reader was checked against: 0.4.9 by the
#: tests, 0.4.8 by reading its source (the same ``Buffer`` and client ``Stream``)
CHECKED = ("0.4.8", "0.4.9")
#: a gRPC message prefix: compressed flag, length
_PREFIX = struct.Struct(">BI").unpack_from
T = TypeVar("T")

#: a DATA frame's header: its length (24 bits) and type (0), its flags (none), its stream
_DATA_HEADER: Final = struct.Struct(">IBI").pack


def _frame_header(length: int, stream_id: int) -> bytes:
    return _DATA_HEADER(length << 8, 0, stream_id)


def _buffer_ok(buffer: Any) -> bool:
    return (
        isinstance(buffer._unacked, asyncio.Queue)
        and isinstance(buffer._acked, collections.deque)
        and callable(buffer._ack_callback)
        and isinstance(buffer._eof, bool)
    )


def _names_used(cls: type) -> set[str]:
    """Every attribute name the methods of ``cls`` use (what its code reads and sets)."""
    return {
        name
        for member in vars(cls).values()
        if inspect.isfunction(member)
        for name in member.__code__.co_names
    }


def _shape_problem() -> str | None:
    """What differs from the internals the reader reads (``None``: nothing), read at import."""
    try:
        buffer = grpclib.protocol.Buffer(lambda size: None)
        fresh = _buffer_ok(buffer) and buffer._eof is False
        buffer.add(b"x", 3)
        buffer.eof()
        queue = buffer._unacked
        queued = [tuple(queue.get_nowait()) for _ in range(queue.qsize())]
    except Exception as exc:  # any failure here means another shape
        return f"grpclib.protocol.Buffer differs ({exc!r})"
    if not fresh or queued != [(b"x", 1, 3), (b"", 0, 0)] or buffer._eof is not True:
        return "grpclib.protocol.Buffer queues received data differently"
    missing = {"_stream", "_wrapper", "_codec", "_recv_type"} - _names_used(grpclib.client.Stream)
    if "buffer" not in _names_used(grpclib.protocol.Stream):
        missing.add("buffer")
    if missing:
        return f"grpclib's streams no longer use {', '.join(sorted(missing))}"
    return _h2_problem()


def _h2_problem() -> str | None:
    """What differs in h2 from what :func:`send_framed` reads (``None``: nothing)."""
    try:
        conn = H2Connection(H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":path", "/"), (":scheme", "http"),
                              (":authority", "a")])
        before = conn.outbound_flow_control_window, conn.streams[1].outbound_flow_control_window
        conn.send_data(1, b"x")
        after = conn.outbound_flow_control_window, conn.streams[1].outbound_flow_control_window
        frame = conn.data_to_send()[-10:]
    except Exception as exc:  # any failure here means another shape
        return f"h2 differs ({exc!r})"
    if after != (before[0] - 1, before[1] - 1) or frame != _frame_header(1, 1) + b"x":
        return "h2 counts or frames sent data differently"
    return None


def check() -> ShimStatus:
    """The gate, judged on the grpclib installed now."""
    return gate(SHIM, "grpclib", CHECKED, _shape_problem)


#: whether the pump reads through :class:`MessageReader` (judged once, at import)
STATUS = check()
register(SHIM, lambda: STATUS)


def _fall_back(why: str) -> None:
    """Switch the shim off for good (said once): a stream did not look as the gate promised."""
    global STATUS
    if STATUS.active:
        STATUS = ShimStatus(SHIM, False, f"{STATUS.reason}: {why}")
        log.warning("the batched gRPC reader is off, grpclib reads every stream: %s",
                    STATUS.reason)


class MessageReader:
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

    :meth:`attach` returns ``None`` when the shim is off (:data:`STATUS`) or
    this call's internals differ, and the pump then uses grpclib's public
    iteration. Event listeners on the channel (``grpclib.events.RecvMessage``)
    are not called for messages read this way; ours registers none.
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
            if type(codec) in PROTO_CODECS
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
    def attach(cls, call: Any) -> MessageReader | None:
        """A reader for ``call`` (initial metadata received), or ``None``: grpclib reads it."""
        if not STATUS.active:
            return None
        try:
            ok = (
                _buffer_ok(call._stream.buffer)
                and call._wrapper is not None
                and callable(call._codec.decode)
                and call._recv_type is not None
                and (type(call._codec) not in PROTO_CODECS
                     or callable(call._recv_type.FromString))
            )
        except AttributeError:
            ok = False
        if not ok:
            _fall_back("a stream's call differs from what it reads")
            return None
        return cls(call)

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


#: grpclib's own ``Stream.send_data`` (what :func:`send_framed` leaves a small send to)
_grpclib_send_data = grpclib.protocol.Stream.send_data


async def send_framed(stream: Any, data: bytes, end_stream: bool = False) -> None:
    """grpclib's ``Stream.send_data`` (``stream``'s), with the frames between the first and
    the last framed here: for a message of many frames (a long prompt), one bytes join
    instead of h2 building, checking and queueing each (≈ 10 µs a frame).

    h2 sends the first frame and the last (the states, the windows checked, the end of
    the stream), and the window counters are lowered by the frames between, as h2's
    own would be. A message that fits in two frames, or more than the flow-control
    window allows now, goes through grpclib's own loop (which waits for the window).
    """
    conn = stream._h2_connection
    size = conn.max_outbound_frame_size
    if len(data) <= 2 * size:
        await _grpclib_send_data(stream, data, end_stream)
        return
    await stream.connection.write_ready.wait()
    if conn.local_flow_control_window(stream.id) < len(data):
        await _grpclib_send_data(stream, data, end_stream)
        return
    last = (len(data) - 1) // size * size  # where the last frame starts
    view = memoryview(data)
    transport = stream._transport
    conn.send_data(stream.id, data[:size])
    transport.write(conn.data_to_send())
    stream_id = stream.id
    parts: list[bytes | memoryview] = []
    for start in range(size, last, size):
        parts.append(_frame_header(size, stream_id))
        parts.append(view[start:start + size])
    transport.write(b"".join(parts))
    conn.outbound_flow_control_window -= last - size
    conn.streams[stream_id].outbound_flow_control_window -= last - size
    conn.send_data(stream_id, data[last:], end_stream=end_stream)
    transport.write(conn.data_to_send())
    stream.data_sent += len(data)
    stream.connection.data_sent += len(data)
    stream.connection.data_send_process()


async def send_request(call: Any, message: Any) -> None:
    """``call.send_message(message, end=True)``, its DATA frames sent by :func:`send_framed`
    where the shim is on."""
    await call.send_request()
    stream = call._stream if STATUS.active else None
    if stream is None:
        await call.send_message(message, end=True)
        return
    stream.send_data = functools.partial(send_framed, stream)
    try:
        await call.send_message(message, end=True)
    finally:
        del stream.send_data  # (no cycle left for the collector)


class EncodedCodec(ProtoCodec):
    """grpclib's protobuf codec that also sends a request encoded already (``bytes``: the
    transport encodes each streaming request itself, dialects/ids.py ``encode_request``, a
    long prompt's ids put in from their ready encoding); it decodes as ProtoCodec does."""

    def encode(self, message: Any, message_type: Any) -> bytes:
        if type(message) is bytes:
            return message
        return super().encode(message, message_type)


#: codecs that decode exactly as grpclib's ProtoCodec (``message_type.FromString``)
PROTO_CODECS: frozenset[type[Any]] = frozenset((ProtoCodec, EncodedCodec))


def _connection_transport(channel: Any) -> Any:
    """The asyncio transport under ``channel``'s live connection, or None (not connected)."""
    protocol = getattr(channel, "_protocol", None)
    connection = getattr(protocol, "connection", None)
    transport = getattr(connection, "_transport", None)
    if transport is None or transport.is_closing() or "write" in vars(transport):
        return None  # not connected, closing, or its writes are held already
    return transport


async def one_write(channel: Any, send: Awaitable[T]) -> T:
    """Await ``send``; what grpclib writes to ``channel``'s connection meanwhile goes out once.

    grpclib writes a call's HEADERS and its request's DATA frame in two socket
    writes; awaited through this, they go out in one. Writes are held only
    while ``send`` runs without suspending: at its first suspension (the
    connection's write buffer or flow-control window is full) what is held
    goes out, in order, and the rest runs as grpclib wrote it, so nothing it
    waits for can be stuck behind a held write. Nothing is held where the shim
    is off, the channel has not connected yet, or another send holds its
    writes already.
    """
    transport = _connection_transport(channel) if STATUS.active else None
    if transport is None:
        return await send
    return await _HeldWrites(transport, send)


class _HeldWrites(Generic[T]):
    """Runs an awaitable's synchronous first step with the transport's writes held."""

    __slots__ = ("_pending", "_send", "_transport")

    def __init__(self, transport: Any, send: Awaitable[T]) -> None:
        self._transport = transport
        self._send = send
        self._pending: list[bytes] = []

    def _hold(self, data: bytes) -> None:
        self._pending.append(bytes(data))

    def _release(self) -> None:
        transport = self._transport
        if vars(transport).get("write") == self._hold:
            del transport.write
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            transport.write(data)

    def __await__(self) -> Generator[Any, Any, T]:
        steps = self._send.__await__()
        self._transport.write = self._hold
        try:
            signal = steps.send(None)  # up to its end, or its first suspension
        except StopIteration as done:
            return cast(T, done.value)
        finally:
            self._release()
        return (yield from _delegate(steps, signal))


def _delegate(steps: Generator[Any, Any, T], signal: Any) -> Generator[Any, Any, T]:
    """``yield from steps`` for an iterator already started (its first yield: ``signal``)."""
    while True:
        try:
            value = yield signal
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:  # a cancellation: into the awaitable, as yield from does
            try:
                signal = steps.throw(exc)
            except StopIteration as done:
                return cast(T, done.value)
        else:
            try:
                signal = steps.send(value)
            except StopIteration as done:
                return cast(T, done.value)
