"""A request's attempts across engines: the phase each is in, and what follows a failure.

Sans-IO; the clock is passed in. :class:`Attempt` is the state machine of
one request's engine calls::

    relaying ◄──► waiting              a batch handed on; the next one awaited
       │   ╲        │
       │    ▼       ▼
       │     moving                    asked off a draining engine: leaves at a safe point
       ▼       │
    finished ◄─┘

    relaying, waiting, moving ──(failure)──► relaying | no_engine | failed | timed_out
    no_engine ──(the catalog changed)──────► relaying | no_engine | failed | timed_out

A failure (an engine's error, a stall, the move off a draining engine)
leads to the next attempt, decided by :mod:`~direct_frontend.pipeline.failover`:
a retry before the first token, a continuation from the tokens produced
after it (a replay of the client's own call for a deterministic constrained
stream, whose repeat is checked here and dropped), or giving up. When no
engine the request may use serves, it waits for one, bounded
(:class:`~direct_frontend.pipeline.engine_wait.EngineWait`), instead of
failing at once. :data:`TRANSITIONS` is every legal move; the ones off the
per-batch path are checked as they happen.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable, Collection

import msgspec

from direct_frontend.engines.neutral import EngineEvent, Finished, GenerateCall
from direct_frontend.errors import EngineError, ErrorKind, NoEngineAvailable
from direct_frontend.openai.errors import OpenAIHTTPError, from_engine_error, invalid_request
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.capable import incapable
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.engine_wait import EngineWait, all_saturated, timed_out
from direct_frontend.pipeline.failover import (
    Decision,
    FailoverState,
    continuation,
    deterministic,
    replay,
)
from direct_frontend.pipeline.preprocess import PreparedRequest
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.policies import Placement

log = logging.getLogger("direct_frontend.http")  # the request log's name, as it always was

#: why a constrained stream is not migrated (failover.py), as the metric's reason
UNMIGRATABLE_CONSTRAINT = "constraint"
#: why a replayed one is not: its replay differed from what was streamed
UNMIGRATABLE_REPLAY = "replay_diverged"
#: an engine's refusal of a constrained request that names the constraint: the client's 400
#: then names the field it sent the constraint in
CONSTRAINT_WORDS = re.compile(
    r"regex|grammar|schema|json|choice|structural|guided|constraint|xgrammar", re.IGNORECASE
)


class Phase(enum.Enum):
    """Where a request is; a planned migration may only cut a wait on the engine short."""

    RELAYING = "relaying"  # taking the engine's output and handing it on
    WAITING = "waiting"  # for the engine's next event (the stall watch is armed)
    MOVING = "moving"  # asked off a draining engine: leaves at the next safe point
    FINISHED = "finished"  # the output is complete
    NO_ENGINE = "no_engine"  # none it may use serves: waits for the catalog to change
    TIMED_OUT = "timed_out"  # request_timeout_s passed: no further attempt
    FAILED = "failed"  # gave up: no engine left that could serve the rest


# The per-batch checks use these: an enum attribute lookup costs ~100 ns in Python 3.11.
_RELAYING, _WAITING, _MOVING = Phase.RELAYING, Phase.WAITING, Phase.MOVING
_FINISHED = Phase.FINISHED

_PLACED = frozenset({Phase.RELAYING, Phase.NO_ENGINE, Phase.FAILED, Phase.TIMED_OUT})

#: Every legal move. A failure while relaying, waiting or moving leads to the next
#: attempt (relaying), a wait for an engine (no_engine), or the end (failed, timed_out);
#: a move that raced a finished output finishes. Finished, failed and timed_out are final.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.RELAYING: _PLACED | {Phase.WAITING, Phase.MOVING, Phase.FINISHED},
    Phase.WAITING: _PLACED | {Phase.MOVING},
    Phase.MOVING: _PLACED | {Phase.FINISHED},
    Phase.NO_ENGINE: _PLACED,
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.TIMED_OUT: frozenset(),
}


class IllegalTransition(Exception):
    """A bug: the relay tried a move its state machine does not have."""


def check_transition(old: Phase, new: Phase) -> None:
    """Raise :class:`IllegalTransition` unless ``old → new`` is an edge (or a no-op)."""
    if new is not old and new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old.value} → {new.value}")


class Attempt:
    """The attempts of one request: the current one's placement and call, and the phase.

    ``settings`` is the snapshot the request arrived under; it keeps it to
    its end. What the output holds so far (the tokens produced, the budget
    left) is passed in where a decision needs it.
    """

    __slots__ = (
        "call",
        "continued",
        "deadline",
        "engine_wait",
        "excluded",
        "failed",
        "failover",
        "legs",
        "original_call",
        "pending_error",
        "phase",
        "placement",
        "prepared",
        "replaying",
        "request",
        "settings",
        "stall_timeout_s",
    )

    def __init__(
        self, settings: Settings, prepared: PreparedRequest, placement: Placement,
        call: GenerateCall, *, now: float, engine_wait: EngineWait | None = None,
    ) -> None:
        self.settings = settings
        self.prepared = prepared
        self.request: ChatRequest | CompletionRequest = prepared.request
        self.placement = placement  # this attempt's; the first one's predictions are checked
        self.call = call
        self.original_call = call  # every continuation starts from the client's own prompt
        constrained = call.sampling.constraint is not None
        self.failover = FailoverState(
            settings.failover,
            unmigratable=UNMIGRATABLE_CONSTRAINT if constrained else None,
            replayable=constrained and deterministic(call.sampling),
        )
        #: on a replay (failover.replay): the tokens already streamed that its engine must
        #: produce first, not yet seen; they are checked and dropped, not streamed again
        self.replaying: tuple[int, ...] = ()
        self.stall_timeout_s = settings.failover.stall_timeout_s
        # the engine-side time for the whole request
        self.deadline = now + settings.frontend.request_timeout_s
        self.engine_wait = engine_wait or EngineWait(
            settings.frontend.faults.wait_for_engine_s, self.deadline
        )
        #: the engines this attempt may not use (and a P/D pair's prefill engine neither)
        self.excluded: Collection[str] = ()
        self.failed: EngineError | None = None  # the last failure, told if no engine takes over
        self.phase = Phase.RELAYING
        #: an error met after tokens of the same batch: raised at the next wait
        self.pending_error: EngineError | None = None
        self.legs = 0  # engine calls after the first: each continuation's id is its own
        #: the engine's prompt is a continuation's (after a migration, or past a closed
        #: reasoning block), no longer the client's own
        self.continued = False

    def _to(self, phase: Phase) -> None:
        check_transition(self.phase, phase)
        self.phase = phase

    # -- one engine call ------------------------------------------------------------------

    def wait(self, now: float) -> float:
        """A wait on the engine begins; returns when the stall watch fires.

        An error kept from the last batch is raised here instead.
        """
        error = self.pending_error
        if error is not None:
            self.pending_error = None
            raise error
        self.phase = _WAITING
        return min(now + self.stall_timeout_s, self.deadline)

    def relaying(self) -> None:
        """The wait is over: the engine's output is being handed on."""
        if self.phase is _WAITING:
            self.phase = _RELAYING

    def finished(self) -> None:
        """The output is complete (from relaying, a legal move: no table looked up)."""
        if self.phase is not _RELAYING:
            check_transition(self.phase, _FINISHED)
        self.phase = _FINISHED

    def replayed(self, event: EngineEvent, produced: int) -> EngineEvent | None:
        """``event`` less the tokens a replay repeats; None once it differs (the error is kept).

        Every token the replay repeats must be the one already streamed, and
        the replay may not end before it has repeated them all. ``produced``:
        the output's tokens so far.
        """
        expected = self.replaying
        ids = event.token_ids
        n = min(len(ids), len(expected))
        if ids[:n] != expected[:n] or (isinstance(event, Finished) and n < len(expected)):
            self.replaying = ()
            self.failover.unmigratable = UNMIGRATABLE_REPLAY
            self.failover.refused_migration = True
            same = produced - len(expected) + next(
                (i for i in range(n) if ids[i] != expected[i]), n)
            self.pending_error = EngineError(
                ErrorKind.INTERNAL,
                f"the stream cannot continue on another engine: replaying its "
                f"structured-output constraint there gave other tokens after {same} of the "
                f"{produced} already streamed",
                engine=self.placement.engine.name,
            )
            return None
        self.replaying = expected[n:]
        if not n:
            return event
        return msgspec.structs.replace(event, token_ids=ids[n:], logprobs=event.logprobs[n:])

    # -- leaving an engine ----------------------------------------------------------------

    def move(self) -> bool:
        """Asked to move off a draining engine; True if a wait on it must be cut short now.

        Only a wait on the engine is interrupted, never a write to the client
        (a write cut short would corrupt the response): while relaying, the
        move waits for the next safe point.
        """
        phase = self.phase
        if phase is _WAITING or phase is _RELAYING:
            self.phase = _MOVING
        return phase is _WAITING

    def leave(self, cut_short: Callable[[], object]) -> None:
        """A planned migration: leave the engine at the next safe point (``cut_short``
        interrupts a wait on it now)."""
        if self.move():
            cut_short()

    def give_way(self, cut_short: Callable[[], object]) -> bool:
        """Its admission preempts it for another tenant: it leaves the engine as a planned
        migration does (True), unless it is past relaying or moving already (False)."""
        phase = self.phase
        if phase is not _WAITING and phase is not _RELAYING:
            return False
        self.leave(cut_short)
        return True

    def interrupted(self, now: float) -> EngineError:
        """What ended this attempt before its output did: a move, the deadline or a stall."""
        engine = self.placement.engine.name
        if self.phase is Phase.MOVING:
            return EngineError(ErrorKind.DRAINING, "the engine is draining", engine=engine)
        if now >= self.deadline:
            return self.expired()
        return EngineError(ErrorKind.TIMEOUT, "the stream stalled", engine=engine)

    def expired(self) -> EngineError:
        """The whole request's time is up (on an engine, or waiting for a slot again after
        a preemption): no further attempt."""
        self._to(Phase.TIMED_OUT)
        return EngineError(ErrorKind.CANCELLED, "request_timeout_s passed",
                           engine=self.placement.engine.name)

    # -- the next attempt -----------------------------------------------------------------

    def next_attempt(self, error: EngineError, dispatcher: Dispatcher, now: float,
                     generated: tuple[int, ...], remaining: int) -> Decision:
        """Decide what follows ``error`` (retry or migrate) and :meth:`place` it.

        ``generated``: the output's tokens so far; ``remaining``: its token
        budget left. Re-raises ``error`` when the request gives up.
        """
        error = error.at(self.placement.engine.name)
        name = error.engine
        engine = self.placement.engine
        # the stint it failed in; another leg's (a prefill engine) as the catalog has it
        stint = engine if name == engine.name else next(
            (e for e in dispatcher.fleet.catalog.engines if e.name == name), None
        )
        decision = self.failover.decide(error, len(generated), stint)
        if decision is Decision.GIVE_UP:
            self._give_up()
            if self.failover.unmigratable == UNMIGRATABLE_CONSTRAINT and \
                    self.failover.refused_migration:
                raise EngineError(
                    error.kind,
                    f"{error.message}; the stream cannot continue on another engine, which "
                    "could not enforce its structured-output constraint on the rest",
                    engine=error.engine,
                ) from error
            raise error
        self.failed = error
        self.continued = self.continued or decision is Decision.MIGRATE
        self.place(dispatcher, now, generated, remaining)
        return decision

    def place(self, dispatcher: Dispatcher, now: float, generated: tuple[int, ...],
              remaining: int) -> Placement | None:
        """Place the attempt the last failure asked for, on an engine it may use.

        None: no such engine serves and the request waits for the catalog to
        change (phase ``NO_ENGINE``, until ``engine_wait.until``). Raises the
        last failure when it may not wait, or no longer: every engine it tried
        was saturated (a 429 at once, as ever), or ``wait_for_engine_s`` or the
        request's own time is up.
        """
        error = self.failed
        assert error is not None, "place() before a failure"
        excluded = self._excluded(dispatcher)
        try:
            placement = self._choose(dispatcher, excluded, remaining)
        except NoEngineAvailable:
            if not self.failover.all_overloaded and self.engine_wait.may_wait(now):
                self._to(Phase.NO_ENGINE)
                return None
            if now >= self.deadline:
                self._to(Phase.TIMED_OUT)
            self._give_up()
            raise error from None
        self.engine_wait.placed()
        self.legs += 1
        if generated and self.failover.replayable:
            call = replay(self.original_call, self.legs)
            self.replaying = generated
        else:
            call = continuation(self.original_call, generated, self.legs)
            self.replaying = ()
        engine = placement.engine
        if _too_long(call, placement):
            self._give_up()
            raise EngineError(
                error.kind, f"{error.message}; cannot resume on {engine.name}: context too short",
                engine=error.engine,
            ) from None
        self._on(placement, call)
        return placement

    def resume(self, dispatcher: Dispatcher, generated: tuple[int, ...], remaining: int) -> None:
        """Continue the output after its closed reasoning block, where the policy places it.

        Raises :class:`EngineError` when no engine can take it now (the usual
        failover then decides).
        """
        excluded = self._excluded(dispatcher)
        engine = self.placement.engine.name
        try:
            placement = self._choose(dispatcher, excluded, remaining)
        except NoEngineAvailable:
            raise EngineError(ErrorKind.UNAVAILABLE, "no engine to continue on after the "
                              "reasoning budget", engine=engine) from None
        self.legs += 1
        call = continuation(self.original_call, generated, self.legs)
        if _too_long(call, placement):
            raise EngineError(ErrorKind.BAD_REQUEST, "the reply cannot continue after its "
                              "reasoning budget: the context is too short", engine=engine)
        self.continued = True
        self._on(placement, call)

    def _excluded(self, dispatcher: Dispatcher) -> set[str]:
        catalog = dispatcher.fleet.catalog
        return self.failover.excluded(catalog) | incapable(catalog, self.request).keys()

    def _choose(self, dispatcher: Dispatcher, excluded: set[str], remaining: int) -> Placement:
        self.excluded = excluded  # the engines this attempt may not use, placed or not
        prepared = self.prepared
        return dispatcher.choose(self.settings.policy, prepared.input_ids, remaining, excluded,
                                 prepared.routing_key, prepared.media_keys)

    def _on(self, placement: Placement, call: GenerateCall) -> None:
        self.placement = placement
        self.call = call
        self._to(Phase.RELAYING)

    def _give_up(self) -> None:
        if self.phase is not Phase.TIMED_OUT:
            self._to(Phase.FAILED)

    def log(self, error: EngineError, outcome: str, produced: int) -> None:
        """Log the move after ``error`` (``outcome``: retried or migrated) to this attempt's
        engine, ``produced`` tokens into the output."""
        to = self.placement.engine.name
        extra = {"engine": error.engine, "to_engine": to}
        if error.kind is ErrorKind.DRAINING:
            log.info("moved a stream off draining engine %s to %s after %d tokens",
                     error.engine, to, produced, extra=extra)
        else:
            log.warning("engine %s failed (%s); %s on %s after %d tokens",
                        error.engine, error, outcome, to, produced, extra=extra)

    def error_for(self, error: EngineError) -> OpenAIHTTPError:
        """What the client is told when the request gave up after ``error``."""
        if self.phase is Phase.TIMED_OUT:
            return timed_out(self.settings)
        if self.failover.all_overloaded:
            return all_saturated()
        constraint = self.call.sampling.constraint
        if (
            error.kind is ErrorKind.BAD_REQUEST and error.param is None and constraint is not None
            and CONSTRAINT_WORDS.search(error.message)  # the engine could not compile it
        ):
            return invalid_request(
                f"The engine could not take '{constraint.param}': {error.message}",
                constraint.param,
            )
        return from_engine_error(error)


def _too_long(call: GenerateCall, placement: Placement) -> bool:
    """Whether ``call`` (its prompt and token budget) exceeds the engine's context."""
    limit = placement.engine.context_length
    return limit is not None and len(call.input_ids) + call.sampling.max_tokens > limit
