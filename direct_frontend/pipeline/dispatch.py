"""Dispatch: pick an engine from the catalog, run one engine call on it, clean up.

This is the seam where retries and migration (fault tolerance) wrap one
engine call. Whatever happens, the engine's load is released, an engine that
failed at the transport is reported to the supervisor, and a stream left
before its end is aborted explicitly on the engine (never relying on the
stream reset alone: not every contract aborts on cancel).

A decode engine heads a prefill/decode pair: choosing it means the request
goes disaggregated (:mod:`direct_frontend.pipeline.disagg`), and running a
call on it runs the prefill leg too (:mod:`~direct_frontend.pipeline.disagg_driver`),
so the relay above sees one engine call either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio

from direct_frontend.engines.dialects.base import Dialect
from direct_frontend.engines.neutral import EngineRole, GenerateCall
from direct_frontend.engines.transport import EngineChannel, EventReceiver
from direct_frontend.errors import EngineError, ErrorKind, NoEngineAvailable
from direct_frontend.pipeline.disagg import DisaggPlanner
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import Policy, RequestView

log = logging.getLogger("direct_frontend.dispatch")

ABORT_TIMEOUT_S = 1.0
UNREACHABLE = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.PROTOCOL})


class FleetView(Protocol):
    """What dispatch needs from the control plane."""

    @property
    def catalog(self) -> Catalog: ...

    def report_fault(self, engine: EngineHandle, error: EngineError) -> None: ...


@dataclasses.dataclass(slots=True)
class EngineCall:
    """One running engine call, as the relay sees it."""

    engine: EngineHandle
    call: GenerateCall
    events: EventReceiver
    #: set by the relay when the engine is about to end the call itself (its token
    #: budget is used up, or it produced a stop token): no Abort is needed then
    ends_by_itself: bool = False


class Dispatcher:
    def __init__(
        self, fleet: FleetView, policy: Policy, disagg: DisaggPlanner | None = None
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.disagg = disagg if disagg is not None else DisaggPlanner()
        self._paired = False  # the last choice was the decode engine of a P/D pair

    def choose(
        self, input_ids: tuple[int, ...], max_tokens: int, exclude: Collection[str] = ()
    ) -> EngineHandle:
        """The engine for a request: a pair's decode engine when P/D serves, else aggregated."""
        catalog = self.fleet.catalog
        request = RequestView(input_ids, max_tokens)
        engine = self.disagg.choose_decode(catalog, request, exclude, self.policy)
        self._paired = engine is not None
        if engine is None:
            engine = self.policy.choose(catalog, request, exclude)
        if engine is None:
            raise NoEngineAvailable("no engine is serving")
        return engine

    def request_blocks(self) -> list[int]:
        """The KV block hashes the policy computed for the request it just placed."""
        if not self._paired and isinstance(self.policy, KvAware) and self.policy.last is not None:
            return self.policy.last.hashes
        return []

    def spilled(self) -> bool:
        """Whether the last choice was the load guard overriding the cache."""
        last = self.policy.last if isinstance(self.policy, KvAware) else None
        return not self._paired and last is not None and last.spilled

    def remember_output(self, engine: EngineHandle, token_ids: Sequence[int]) -> None:
        """Approximate mode: the engine now also holds the answer's blocks.

        Not for a pair's decode engine: the fleet policy never routes to it.
        """
        if (
            isinstance(self.policy, KvAware)
            and engine.role is EngineRole.BOTH
            and engine.incarnation not in self.policy.uses_events
        ):
            self.policy.remember(engine.name, token_ids)

    def predicted_cached_tokens(self, engine: EngineHandle, prompt_tokens: int) -> int | None:
        """What the KV-aware policy expects ``engine`` to have cached of the prompt just chosen.

        Engines always recompute at least the last prompt token, so the
        prediction is capped at the last full block before it. ``None`` when
        the policy makes no prediction.
        """
        if self._paired or not isinstance(self.policy, KvAware):
            return None  # a decode engine's cached tokens are the transferred KV
        last = self.policy.last
        if last is None or last.engine is not engine:
            return None
        block = self.policy.knobs.block_size
        return min(last.predicted_blocks * block, (prompt_tokens - 1) // block * block)

    def run(
        self,
        engine: EngineHandle,
        call: GenerateCall,
        blocks: Sequence[int] = (),
        *,
        exclude: Collection[str] = (),
    ) -> AbstractAsyncContextManager[EngineCall]:
        """Run ``call`` on ``engine``; leaving early aborts it on the engine.

        On a decode engine this is a disaggregated call: a prefill engine
        (not in ``exclude``) runs the prefill leg and the engine call is the
        decode leg's. ``blocks`` are the request's KV block hashes, counted in
        the engine's load while the call runs.
        """
        if engine.role is EngineRole.DECODE:
            from direct_frontend.pipeline.disagg_driver import run_pair  # it imports us

            return run_pair(self, engine, call, blocks, exclude)
        return self.run_leg(engine, call, blocks)

    @contextlib.asynccontextmanager
    async def run_leg(
        self, engine: EngineHandle, call: GenerateCall, blocks: Sequence[int] = ()
    ) -> AsyncIterator[EngineCall]:
        """Run ``call`` on ``engine`` alone (one leg, whatever the engine's role)."""
        channel: EngineChannel = engine.transport
        dialect: Dialect = channel.dialect
        decoder = dialect.stream_decoder(call)
        prompt = len(call.input_ids)
        engine.load.begin(prompt, blocks)
        failure: EngineError | None = None
        engine_call: EngineCall | None = None
        try:
            async with channel.stream(dialect.generate(call), decoder) as receiver:
                engine_call = EngineCall(engine, call, receiver)
                yield engine_call
        except EngineError as error:
            error.engine = error.engine or engine.name
            if error.engine == engine.name:  # not another leg's failure passing through
                failure = error
                if error.kind.engine_is_down:
                    self.fleet.report_fault(engine, error)
            raise
        finally:
            engine.load.end(prompt, blocks)
            # A dead connection cannot take an Abort; a hung or live engine must get one.
            natural_end = engine_call is not None and engine_call.ends_by_itself
            reachable = failure is None or failure.kind not in UNREACHABLE
            if not decoder.finished and not natural_end and reachable:
                await _abort(channel, dialect, call.request_id)


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
