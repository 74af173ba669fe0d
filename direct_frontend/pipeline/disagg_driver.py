"""Disaggregated serving, the I/O: run a prefill leg and a decode leg as one engine call.

The relay gets one :class:`~direct_frontend.pipeline.leg.EngineCall`,
the decode leg's, so retries, migration, stop handling and the client's
stream work as for any engine. What the pairing adds (docs/engine-contracts.md §9.4):

- SGLang runs both legs at once. The prefill leg's result is drained beside
  the decode stream; if it fails before the decode leg has produced
  anything, the decode stream fails with its error (the relay then leaves,
  which aborts the decode leg, and retries the pair). Once the decode leg has
  output, the KV was handed over and a late prefill failure is only logged.
- vLLM runs the prefill leg to its end (bounded by the stall timeout, which
  no client-side watch covers here), then the decode leg with the handoff.
- Leaving a pair early aborts whichever leg still runs (each leg does that
  itself, :mod:`~direct_frontend.pipeline.leg`); a prefill leg that finished
  but whose KV no decode leg took (the client left between the phases, or
  the decode leg failed before its first token) is aborted explicitly too,
  so its KV is not stranded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Collection, Sequence

import trio

from direct_frontend.engines.neutral import EngineEvent, Finished, GenerateCall
from direct_frontend.engines.transport import EventReceiver
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.pipeline.disagg import DisaggPlanner, PairPlan
from direct_frontend.pipeline.leg import EngineCall, FaultSink, FleetView, abort_request, run_leg
from direct_frontend.routing.policies import Placement

log = logging.getLogger("direct_frontend.disagg")

PREFILL_GRACE_S = 1.0


class PairedEvents(EventReceiver):
    """The decode leg's events, failed early by its prefill leg's failure.

    It delegates to the decode leg's receiver (it has no channel of its own).
    Only a wait on the engine is interrupted, never the relay's own work.
    """

    __slots__ = ("_decode", "_failure", "_waiting", "started")

    def __init__(self, decode: EventReceiver) -> None:
        self._decode = decode
        self._failure: EngineError | None = None
        self._waiting: trio.CancelScope | None = None
        self.started = False  # the decode leg has produced output: it holds the KV
        self.error = None

    def _check(self) -> None:
        if self._failure is not None:
            self.error = self._failure
            raise self._failure

    async def receive(self) -> EngineEvent | None:
        self._check()
        with trio.CancelScope() as scope:
            self._waiting = scope
            try:
                event = await self._decode.receive()
            finally:
                self._waiting = None
            self.started = self.started or event is not None
            return event
        assert self._failure is not None  # only fail() cancels this scope
        self.error = self._failure
        raise self._failure

    def receive_nowait(self) -> EngineEvent | None:
        self._check()
        event = self._decode.receive_nowait()
        self.started = self.started or event is not None
        return event

    def fail(self, error: EngineError) -> bool:
        """Fail the decode stream with the prefill leg's ``error``, unless it has output."""
        if self.started:
            return False
        self._failure = error
        if self._waiting is not None:
            self._waiting.cancel()
        return True


@dataclasses.dataclass(slots=True)
class _PrefillState:
    #: the prefill leg's terminal event: it ended on its engine, which may still hold the KV
    finished: Finished | None = None


async def _drain(leg: EngineCall, state: _PrefillState) -> None:
    """Read a prefill leg to its end, noting its terminal event in ``state``.

    Cancelled after the engine's terminal message was decoded (so the
    leg sends no Abort) but before it was read here, the events
    already queued still tell that the leg ended.
    """
    try:
        while (event := await leg.events.receive()) is not None:
            if isinstance(event, Finished):
                state.finished = event
    finally:
        if state.finished is None:
            with contextlib.suppress(EngineError):
                while (event := leg.events.receive_nowait()) is not None:
                    if isinstance(event, Finished):
                        state.finished = event


@contextlib.asynccontextmanager
async def run_pair(
    fleet: FleetView,
    planner: DisaggPlanner,
    placement: Placement,
    call: GenerateCall,
    exclude: Collection[str],
    stall_timeout_s: float,
) -> AsyncIterator[EngineCall]:
    """One disaggregated attempt of ``call``, its decode leg at ``placement`` serving the client.

    ``stall_timeout_s`` bounds a sequential prefill leg, which no client-side
    stall watch covers.
    """
    decode, blocks = placement.engine, placement.blocks
    plan = planner.plan(fleet.catalog, decode, call, exclude)
    if plan is None:
        raise EngineError(
            ErrorKind.UNAVAILABLE, "no prefill engine serves to pair with it", engine=decode.name
        )
    state = _PrefillState()
    events: PairedEvents | None = None
    try:
        if plan.parallel:
            async with _parallel(fleet, plan, blocks, state) as engine_call:
                events = _paired(engine_call)
                yield engine_call
        else:
            finished = await _prefill(fleet, plan, state, stall_timeout_s)
            async with _decode(fleet, plan, plan.decode_after(finished), blocks) as engine_call:
                events = _paired(engine_call)
                yield engine_call
    finally:
        if state.finished is not None and (events is None or not events.started):
            await abort_request(plan.prefill, plan.prefill_call.request_id)


def _paired(engine_call: EngineCall) -> PairedEvents:
    assert isinstance(engine_call.events, PairedEvents)
    return engine_call.events


async def _prefill(
    faults: FaultSink, plan: PairPlan, state: _PrefillState, stall_timeout_s: float
) -> Finished:
    """Run the prefill leg to its end; its terminal event carries the handoff (vLLM)."""
    async with run_leg(faults, plan.prefill, plan.prefill_call, plan.prefill_blocks) as leg:
        with trio.move_on_after(stall_timeout_s) as stall:
            await _drain(leg, state)
        if state.finished is not None:
            return state.finished
        if stall.cancelled_caught:
            raise EngineError(
                ErrorKind.TIMEOUT, "the prefill leg stalled", engine=plan.prefill.name
            )
        # the decoder reports a stream without its end itself; defensive
        raise EngineError(ErrorKind.PROTOCOL, "the prefill leg ended without a result",
                          engine=plan.prefill.name)


@contextlib.asynccontextmanager
async def _decode(
    faults: FaultSink, plan: PairPlan, call: GenerateCall, blocks: Sequence[int]
) -> AsyncIterator[EngineCall]:
    """The decode leg, as the relay's engine call (``ends_by_itself`` passed back to the leg)."""
    async with run_leg(faults, plan.decode, call, blocks) as leg:
        outer = EngineCall(plan.decode, call, PairedEvents(leg.events))
        try:
            yield outer
        finally:
            leg.ends_by_itself = outer.ends_by_itself


@contextlib.asynccontextmanager
async def _parallel(
    faults: FaultSink, plan: PairPlan, blocks: Sequence[int], state: _PrefillState
) -> AsyncIterator[EngineCall]:
    """SGLang: the decode leg as the engine call, the prefill leg drained beside it."""
    prefill_scope = trio.CancelScope()
    try:
        async with trio.open_nursery() as nursery, \
                _decode(faults, plan, plan.decode_call, blocks) as engine_call:
            events = _paired(engine_call)
            nursery.start_soon(_prefill_beside, faults, plan, events, state, prefill_scope)
            try:
                yield engine_call
            except BaseException:
                prefill_scope.cancel()  # still running: its leg aborts it
                raise
            # The decode leg ended well, so the KV was handed over long ago: a prefill
            # leg still running gets a moment to end by itself before it is aborted.
            prefill_scope.deadline = trio.current_time() + PREFILL_GRACE_S
    except BaseExceptionGroup as group:
        inner = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(inner) == 1:
            raise inner[0] from None
        raise


async def _prefill_beside(
    faults: FaultSink,
    plan: PairPlan,
    events: PairedEvents,
    state: _PrefillState,
    scope: trio.CancelScope,
) -> None:
    with scope:
        try:
            async with run_leg(faults, plan.prefill, plan.prefill_call, plan.prefill_blocks) as leg:
                await _drain(leg, state)
        except EngineError as error:
            if not events.fail(error):
                log.warning(
                    "prefill leg on %s failed after its decode leg on %s had output "
                    "(ignored: the KV was handed over): %s",
                    plan.prefill.name, plan.decode.name, error,
                    extra={"engine": plan.prefill.name, "to_engine": plan.decode.name},
                )
