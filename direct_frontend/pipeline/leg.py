"""One engine call ("leg"): the engine's load, its faults and an explicit Abort when left early.

Whatever happens, the engine's load is released, an engine that failed at
the transport is reported to the control plane, and a stream left before
its end is aborted explicitly on the engine (never relying on the stream
reset alone: not every contract aborts on cancel). The Abort is bounded and
shielded, so our own cancellation cannot skip it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol

import trio

from direct_frontend.engines.dialects.base import Dialect
from direct_frontend.engines.neutral import GenerateCall
from direct_frontend.engines.transport import EngineChannel, EventReceiver
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.routing.catalog import Catalog, EngineHandle

log = logging.getLogger("direct_frontend.dispatch")

ABORT_TIMEOUT_S = 1.0
UNREACHABLE = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.PROTOCOL})


class FaultSink(Protocol):
    def report_fault(self, engine: EngineHandle, error: EngineError) -> None:
        """A request saw ``engine`` fail at the transport."""


class FleetView(FaultSink, Protocol):
    """What running requests need from the control plane: the catalog, and a fault report."""

    @property
    def catalog(self) -> Catalog: ...


@dataclasses.dataclass(slots=True)
class EngineCall:
    """One running engine call, as the relay sees it."""

    engine: EngineHandle
    call: GenerateCall
    events: EventReceiver
    #: set by the relay when the engine is about to end the call itself (its token
    #: budget is used up, or it produced a stop token): no Abort is needed then
    ends_by_itself: bool = False


def run_leg(
    faults: FaultSink, engine: EngineHandle, call: GenerateCall, blocks: Sequence[int] = ()
) -> Leg:
    """Run ``call`` on ``engine`` alone (one leg, whatever the engine's role), in an
    ``async with`` block that gives the :class:`EngineCall`.

    ``blocks`` are the request's KV block hashes, counted in the engine's
    load while the call runs.
    """
    return Leg(faults, engine, call, blocks)


class Leg:
    """:func:`run_leg`'s block: the call opened on the way in (a value the contract cannot
    carry refused before anything starts); on the way out, whatever ended it, the load
    released, the span ended, an engine failure named and reported, an Abort if needed.

    A class rather than an ``asynccontextmanager``: every engine call opens one, and an
    async generator's block costs about 1 µs more.
    """

    __slots__ = ("_blocks", "_call", "_channel", "_decoder", "_engine", "_engine_call",
                 "_faults", "_span", "_streaming")

    def __init__(self, faults: FaultSink, engine: EngineHandle, call: GenerateCall,
                 blocks: Sequence[int]) -> None:
        self._faults = faults
        self._engine = engine
        self._call = call
        self._blocks = blocks
        self._engine_call: EngineCall | None = None

    async def __aenter__(self) -> EngineCall:
        engine, call = self._engine, self._call
        self._channel = channel = engine.transport
        dialect: Dialect = channel.dialect
        try:
            rpc = dialect.generate(call)  # a value the contract cannot carry is refused here
        except EngineError as refused:
            raise refused.at(engine.name) from None
        self._decoder = decoder = dialect.stream_decoder(call)
        trace = call.trace
        self._span = span = None if trace is None else trace.leg(
            engine.name, engine.kind, engine.role.value, call.request_id, len(call.input_ids),
            call.disaggregation is not None,
        )
        engine.load.begin(len(call.input_ids), self._blocks, call.dp_rank)
        metadata = None if span is None else span.metadata
        self._streaming = channel.stream(rpc, decoder, metadata=metadata)
        try:
            receiver = await self._streaming.__aenter__()
        except BaseException as raised:
            await self._left(raised)
            raise
        self._engine_call = EngineCall(engine, call, receiver)
        return self._engine_call

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self._streaming.__aexit__(exc_type, exc, tb)
        except BaseException as raised:  # in place of what the block raised
            await self._left(raised)
            raise
        await self._left(exc)

    async def _left(self, error: BaseException | None) -> None:
        """The call's end, ``error`` what ended it (None: the block ended normally): an
        engine failure named (raised in its place when it was not) and reported; whatever
        it was, the load released, the span ended and, if the stream was left early, an
        Abort sent."""
        engine, call = self._engine, self._call
        failure: EngineError | None = None
        try:
            if isinstance(error, EngineError):
                named = engine_failure(self._faults, engine, error)
                if named.engine == engine.name:  # not another leg's failure passing through
                    failure = named
                if named is not error:
                    raise named from None
        finally:
            engine.load.end(len(call.input_ids), self._blocks, call.dp_rank)
            if self._span is not None:
                self._span.end(failure)
            # A dead connection cannot take an Abort; a hung or live engine must get one.
            natural_end = self._engine_call is not None and self._engine_call.ends_by_itself
            reachable = failure is None or failure.kind not in UNREACHABLE
            if not self._decoder.finished and not natural_end and reachable:
                await _abort(self._channel, self._channel.dialect, call.request_id)


def engine_failure(faults: FaultSink, engine: EngineHandle, error: EngineError) -> EngineError:
    """``error`` naming ``engine`` if it names no engine yet (:meth:`EngineError.at`);
    when it is ``engine``'s and takes the engine down, reported to ``faults``."""
    named = error.at(engine.name)
    if named.engine == engine.name and named.kind.engine_is_down:
        faults.report_fault(engine, named)
    return named


async def abort_request(engine: EngineHandle, request_id: str) -> None:
    """Send ``engine`` an explicit Abort for ``request_id`` (bounded, shielded).

    For a call that has already ended on the engine but left state behind
    (a prefill leg whose KV no decode leg took).
    """
    channel: EngineChannel = engine.transport
    await _abort(channel, channel.dialect, request_id)


async def _abort(channel: EngineChannel, dialect: Dialect, request_id: str) -> None:
    """Tell the engine to drop ``request_id``; bounded, and immune to our own cancellation."""
    with trio.CancelScope(shield=True), trio.move_on_after(ABORT_TIMEOUT_S):
        try:
            await channel.unary(dialect.abort(request_id), ABORT_TIMEOUT_S)
        except EngineError as exc:
            log.debug("abort of %s failed: %s", request_id, exc)
