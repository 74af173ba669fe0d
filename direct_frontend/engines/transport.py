"""The one place Trio meets asyncio: grpclib calls to one engine.

grpclib is asyncio-native, so every call runs on the trio-asyncio loop. A
streaming call is pumped by one asyncio task that decodes each reply with the
stream's dialect decoder and pushes neutral events (or a classified
:class:`EngineError`) into an unbounded Trio channel; errors travel in-band so
no nursery ever sees them. Leaving the context early cancels the asyncio task,
which resets the HTTP/2 stream (the engine sees a cancel). See stack.md §3.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_asyncio
from grpclib.client import Channel, UnaryStreamMethod, UnaryUnaryMethod
from grpclib.config import Configuration

from direct_frontend.engines.dialects.base import Dialect, Rpc, StreamDecoder
from direct_frontend.engines.neutral import EngineEvent
from direct_frontend.errors import EngineError

# Stock servers accept client pings no more often than every 10 s (engine-contracts §12.2).
KEEPALIVE = Configuration(_keepalive_time=20.0, _keepalive_timeout=10.0)
YIELD_EVERY = 16  # a tight asyncio loop must give Trio a turn (stack.md §3.1 rule 3)

StreamItem = EngineEvent | EngineError


class EventReceiver:
    """The Trio side of one engine stream: neutral events, errors re-raised.

    ``receive_nowait`` lets the HTTP relay drain everything already queued
    and write it in one send.
    """

    __slots__ = ("_rx", "error")

    def __init__(self, rx: trio.MemoryReceiveChannel[StreamItem]) -> None:
        self._rx = rx
        self.error: EngineError | None = None

    async def receive(self) -> EngineEvent | None:
        """Next event, or ``None`` once the stream is over."""
        try:
            item = await self._rx.receive()
        except trio.EndOfChannel:
            return None
        if isinstance(item, EngineError):
            self.error = item
            raise item
        return item

    def receive_nowait(self) -> EngineEvent | None:
        """Next queued event; ``None`` when nothing is queued right now or the stream is over."""
        try:
            item = self._rx.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None
        if isinstance(item, EngineError):
            self.error = item
            raise item
        return item


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
                try:
                    async with method.open(timeout=deadline_s) as call:
                        await call.send_message(rpc.request, end=True)
                        self._note_connection()
                        count = 0
                        async for reply in call:
                            event = decoder.feed(reply)
                            if event is not None:
                                tx.send_nowait(event)
                            count += 1
                            if count % YIELD_EVERY == 0:
                                await asyncio.sleep(0)
                        decoder.end()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    tx.send_nowait(dialect.classify(exc))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio_asyncio.aio_as_trio(pump))
                try:
                    yield EventReceiver(rx)
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            inner = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
            if len(inner) == 1:
                raise inner[0] from None
            raise
