"""One request's relay decisions, with no I/O: its attempts across engines, its output and its
reasoning budget (:class:`RelayState`), driven by :class:`~direct_frontend.pipeline.relay.Relay`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from direct_frontend.engines.neutral import EngineEvent, TokenDelta
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.pipeline.attempt import Attempt
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.failover import Decision
from direct_frontend.pipeline.output_track import OutputTrack
from direct_frontend.pipeline.preempt import Hold
from direct_frontend.pipeline.relay_events import Batch, Failed
from direct_frontend.pipeline.thinking import ThinkingBudget
from direct_frontend.routing.policies import Placement


class EventQueue(Protocol):
    """The events an engine call has already delivered (an ``EventReceiver``'s sync side)."""

    def receive_nowait(self) -> EngineEvent | None: ...


class RelayState:
    """The decisions of one request's relay (sans-IO): its attempts, output and budget."""

    __slots__ = ("attempt", "budget", "hold", "last_out", "output", "started", "trace")

    def __init__(self, attempt: Attempt, output: OutputTrack,
                 budget: ThinkingBudget | None = None, *, started: float = 0.0,
                 trace: RequestTrace | None = None) -> None:
        self.attempt = attempt
        self.output = output
        self.budget = budget  # None: no reasoning budget to keep
        self.started = started  # perf_counter() at the start, for the time to first token
        self.last_out = 0.0  # perf_counter() at the last output handed on (0: none yet)
        self.trace = trace  # None unless tracing is on
        self.hold: Hold | None = None  # its admission slot, while it may be preempted

    def preemptible(self, hold: Hold) -> None:
        """Let ``hold``'s admission queue take the request off its engine while it runs
        (pipeline/preempt.py), unless its continuation would change or lose something: a
        structured-output constraint's state, a reasoning budget's count, a seed's random
        stream (a continuation starts it again), or penalties an engine applies to output
        tokens only (``frequency_penalty`` and ``presence_penalty``: a continuation has
        them in its prompt)."""
        sampling = self.attempt.call.sampling
        if (self.budget is None and self.attempt.failover.unmigratable is None
                and sampling.seed is None and not sampling.frequency_penalty
                and not sampling.presence_penalty):
            self.hold = hold

    # -- one batch ------------------------------------------------------------------------

    def take(self, event: EngineEvent | None, queue: EventQueue) -> Batch:
        """Take ``event`` (the wait's result) and every event already queued behind it.

        Consecutive token deltas are merged into one call of the output
        processor (the per-call cost dominates at high token rates). Each event
        goes through :meth:`_admit` while a replay, a reasoning budget or the
        output needs it (:meth:`_each`); else the batch's last event alone is
        noted, which is the same (each event's cached tokens replace the last's).
        """
        attempt = self.attempt
        attempt.relaying()
        output = self.output
        before = output.completion_tokens
        budget = self.budget
        each = self._each()
        last: EngineEvent | None = None
        pieces: list[str] = []
        tokens: list[int] = []
        while event is not None:
            if each:
                event = self._admit(event, before, len(tokens))
                if event is None:
                    break
            last = event
            if not isinstance(event, TokenDelta):  # the engine's last event
                if not (tokens and output.feed(tokens, pieces)):
                    output.finish(event, pieces)
                tokens = []
                break
            tokens.extend(event.token_ids)
            if budget is not None and budget.held is not None:
                break  # the budget's end: the rest waits for the verdict
            try:
                event = queue.receive_nowait()
            except EngineError as error:  # surfaces after the tokens before it are taken
                attempt.pending_error = error
                break
        if last is not None and not each:
            output.note(last, attempt.continued)
        if tokens:
            output.feed(tokens, pieces)
        return self._batch("".join(pieces), output.completion_tokens - before)

    def _each(self) -> bool:
        """Whether this batch's events each go through :meth:`_admit`: a replay or a
        reasoning budget is on, or the output notes every event
        (:meth:`~direct_frontend.pipeline.output_track.OutputTrack.notes_each`); none of
        these starts within a batch."""
        attempt, budget = self.attempt, self.budget
        return bool(attempt.replaying) or self.output.notes_each(attempt.continued) or (
            budget is not None and budget.limit is not None)

    def _admit(self, event: EngineEvent, produced: int, merged: int) -> EngineEvent | None:
        """``event`` as the output takes it: less what a replay repeats (None: the replay
        differs), up to the reasoning budget, noted; ``produced``, ``merged``: the output's
        tokens before this batch, and the batch's before ``event``."""
        attempt = self.attempt
        if attempt.replaying:
            replayed = attempt.replayed(event, produced)
            if replayed is None:
                return None
            event = replayed
        budget = self.budget
        if budget is not None and budget.limit is not None:
            event = budget.cut(event, produced, merged)
        self.output.note(event, attempt.continued)
        return event

    def _batch(self, text: str, tokens: int) -> Batch:
        batch = self.output.batch(text, tokens)
        if self.output.final is not None:
            self.attempt.finished()
        return batch

    def failed(self, error: EngineError) -> Failed:
        """The event of a request that gave up after ``error``."""
        return Failed(self.attempt.error_for(error), self.output.usage())

    # -- the reasoning budget -------------------------------------------------------------

    def thinking_due(self) -> str | None:
        """The marker that closes the reasoning block once its budget is spent (every
        batch handed on was parsed); None until then."""
        budget, parser = self.budget, self.output.parser
        if budget is None or parser is None:
            return None
        return budget.due(self.output.completion_tokens, parser)

    def close_thinking(self, ids: Sequence[int]) -> Batch:
        """Put ``ids`` (the closing marker) in the output as if the engine had sent them."""
        assert self.budget is not None
        self.budget.closed()
        output = self.output
        before = output.completion_tokens
        pieces: list[str] = []
        output.unsampled(ids, pieces)
        return self._batch("".join(pieces), output.completion_tokens - before)

    def resume(self, dispatcher: Dispatcher) -> None:
        """Continue the output after its closed block, where the policy places it."""
        processor = self.output.processor
        self.attempt.resume(dispatcher, processor.generated_ids, processor.remaining_tokens)

    def asked_off(self, hold: Hold, error: EngineError) -> EngineError | None:
        """The attempt ended with ``error`` after its admission asked the request off its
        engine (a preemption): None when it left for that (it waits for its slots again),
        else the failure to fail over from, keeping its slots and no longer asked off: the
        engine's own failure when one was kept from before it left, else ``error``."""
        pending = self.attempt.pending_error
        if error.kind is ErrorKind.DRAINING and pending is None:
            return None
        hold.asked = False
        return error if pending is None else pending

    # -- the next attempt -----------------------------------------------------------------

    def next_attempt(self, error: EngineError, dispatcher: Dispatcher, now: float) -> Decision:
        """Decide what follows ``error`` and place it (:meth:`Attempt.next_attempt`)."""
        if self.budget is not None:
            self.budget.drop()
        processor = self.output.processor
        return self.attempt.next_attempt(error, dispatcher, now, processor.generated_ids,
                                         processor.remaining_tokens)

    def place(self, dispatcher: Dispatcher, now: float) -> Placement | None:
        """Place the attempt the last failure asked for (:meth:`Attempt.place`)."""
        processor = self.output.processor
        return self.attempt.place(dispatcher, now, processor.generated_ids,
                                  processor.remaining_tokens)
