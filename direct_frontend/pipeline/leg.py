"""One engine call ("leg"): the engine's load, its faults and an explicit Abort when left early.

Whatever happens, the engine's load is released, an engine that failed at
the transport is reported to the control plane, and a stream left before
its end is aborted explicitly on the engine (never relying on the stream
reset alone: not every contract aborts on cancel). The Abort is bounded and
shielded, so our own cancellation cannot skip it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
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


@contextlib.asynccontextmanager
async def run_leg(
    faults: FaultSink, engine: EngineHandle, call: GenerateCall, blocks: Sequence[int] = ()
) -> AsyncIterator[EngineCall]:
    """Run ``call`` on ``engine`` alone (one leg, whatever the engine's role).

    ``blocks`` are the request's KV block hashes, counted in the engine's
    load while the call runs.
    """
    channel: EngineChannel = engine.transport
    dialect: Dialect = channel.dialect
    try:
        rpc = dialect.generate(call)  # a value the contract cannot carry is refused here
    except EngineError as refused:
        raise refused.at(engine.name) from None
    decoder = dialect.stream_decoder(call)
    prompt = len(call.input_ids)
    trace = call.trace
    span = None if trace is None else trace.leg(
        engine.name, engine.kind, engine.role.value, call.request_id, prompt,
        call.disaggregation is not None,
    )
    engine.load.begin(prompt, blocks, call.dp_rank)
    failure: EngineError | None = None
    engine_call: EngineCall | None = None
    try:
        metadata = None if span is None else span.metadata
        async with channel.stream(rpc, decoder, metadata=metadata) as receiver:
            engine_call = EngineCall(engine, call, receiver)
            yield engine_call
    except EngineError as error:
        named = engine_failure(faults, engine, error)
        if named.engine == engine.name:  # not another leg's failure passing through
            failure = named
        if named is error:
            raise
        raise named from None
    finally:
        engine.load.end(prompt, blocks, call.dp_rank)
        if span is not None:
            span.end(failure)
        # A dead connection cannot take an Abort; a hung or live engine must get one.
        natural_end = engine_call is not None and engine_call.ends_by_itself
        reachable = failure is None or failure.kind not in UNREACHABLE
        if not decoder.finished and not natural_end and reachable:
            await _abort(channel, dialect, call.request_id)


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
