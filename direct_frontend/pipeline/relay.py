"""One request's walk from its placement to its last token, across engines.

The relay owns the request's output state (detokenizer, stop strings,
tokens produced), so when an engine fails it can retry the request on
another engine before the first token, or migrate it after: continue on
another engine from the tokens already produced. The client sees one
unbroken stream.

Two halves:

- :class:`RelayState` decides, and does no I/O: which phase the request is
  in, what a batch of engine events yields, what a failure leads to (the
  next attempt, via :mod:`~direct_frontend.pipeline.failover`, or giving up),
  what an interrupted wait means (a stall, the request's deadline, a planned
  migration off a draining engine) and which error the client gets. When no
  engine the request may use serves (to start, retry or migrate), it waits
  for one, bounded (:class:`EngineWait`), instead of failing at once.
  A reply that has spent its ``thinking_token_budget`` inside its reasoning
  block gets the block's closing marker as if the model had written it, and
  goes on from there as a continuation (the engine the policy picks holds
  its prefix): the same on every engine kind, none of whose contracts
  carries a thinking budget.
- :class:`Relay` is the thin async driver: it runs each attempt's engine
  call (:meth:`Dispatcher.run`) and hands every batch of output to an
  ``emit(text, tokens, finished, logprobs)`` callback of the HTTP side. Per batch it
  adds nothing to what the work needs: no task, channel or allocation. While
  a request waits for an engine it sleeps on the fleet's catalog
  (:meth:`WaitableFleet.wait_for_catalog`), trying again at each change.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Protocol

import trio

from direct_frontend.engines.neutral import (
    EngineEvent,
    Finished,
    GenerateCall,
    PromptLogprobs,
    TokenDelta,
    TokenLogprob,
)
from direct_frontend.errors import EngineError, ErrorKind, NoEngineAvailable
from direct_frontend.observability.metrics import Metrics, ModelSeries
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    engine_timeout,
    from_engine_error,
    invalid_request,
    no_engine_available,
    rate_limited,
)
from direct_frontend.openai.parsers.base import ParsedDelta, finish_reason
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.capable import incapable, none_capable
from direct_frontend.pipeline.dispatch import Dispatcher
from direct_frontend.pipeline.failover import (
    Decision,
    FailoverState,
    continuation,
    deterministic,
    replay,
)
from direct_frontend.pipeline.parsing import (
    NO_PARSERS,
    ChoiceOutputParser,
    ModelParsers,
    choice_parser,
    only_first_call,
    open_reasoning_close,
    parser_names,
)
from direct_frontend.pipeline.postprocess import OutputProcessor, OutputStep
from direct_frontend.pipeline.preprocess import PreparedRequest, build_call, token_budget
from direct_frontend.pipeline.settings import Settings
from direct_frontend.routing.catalog import EngineHandle
from direct_frontend.routing.hitrate import HitRateWatch
from direct_frontend.routing.policies import Placement
from direct_frontend.text.model_dir import TextModel

log = logging.getLogger("direct_frontend.http")  # the request log's name, as it always was

#: the HTTP side's writer: new text, how many tokens it covers, whether the output is
#: complete, and the logprobs of the tokens whose text is now out (empty unless asked for)
Emit = Callable[[str, int, bool, Sequence[TokenLogprob]], Awaitable[None]]


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


class EventQueue(Protocol):
    """The events an engine call has already delivered (an ``EventReceiver``'s sync side)."""

    def receive_nowait(self) -> EngineEvent | None: ...


class EngineWait:
    """Whether a request that finds no engine it may use waits for one, and until when.

    A wait begins when the request finds none (to start, retry or migrate)
    and ends when it is placed; each lasts at most ``faults.wait_for_engine_s``
    of the request's settings (0: it never waits), and never past the
    request's deadline. Sans-IO: the clock is passed in.
    """

    __slots__ = ("deadline", "limit_s", "since", "until", "waits")

    def __init__(self, limit_s: float, deadline: float) -> None:
        self.limit_s = limit_s
        self.deadline = deadline
        self.until: float | None = None  # while a wait is under way: when it ends
        self.since = 0.0  # when it began
        self.waits = 0  # how many began

    def may_wait(self, now: float) -> bool:
        """No engine serves the request at ``now``: whether it waits (on) for one."""
        if self.until is None:
            if self.limit_s <= 0 or now >= self.deadline:
                return False
            self.until = min(now + self.limit_s, self.deadline)
            self.since = now
            self.waits += 1
        return now < self.until

    def placed(self) -> None:
        """The request has an engine: the wait (if any) is over."""
        self.until = None


def timed_out(settings: Settings) -> OpenAIHTTPError:
    """The 504 of a request still unanswered at its ``request_timeout_s``."""
    timeout = settings.frontend.request_timeout_s
    return engine_timeout(f"The request did not finish within {timeout:g} s.")


def all_saturated() -> OpenAIHTTPError:
    """The 429 of a request that every engine it tried refused as overloaded."""
    return rate_limited("Every engine is saturated; retry later.", retry_after=1)


def first_placement(
    dispatcher: Dispatcher, settings: Settings, prepared: PreparedRequest, wait: EngineWait,
    now: float,
) -> Placement | None:
    """Where a new request goes; None: no engine serves, and it waits (``wait.until``).

    A 503 when no engine serves and it may not wait (any more).
    """
    request = prepared.request
    catalog = dispatcher.fleet.catalog
    lacking = incapable(catalog, request)
    try:
        placement = dispatcher.choose(
            settings.policy, prepared.input_ids, request.max_tokens or 0, lacking,
            prepared.routing_key,
        )
    except NoEngineAvailable:
        refusal = none_capable(catalog, lacking)
        if refusal is not None:
            raise refusal from None
        if wait.may_wait(now):
            return None
        raise no_engine_available(request.model) from None
    wait.placed()
    return placement


class RelayState:
    """The decisions of one request's relay (sans-IO; the clock is passed in).

    ``settings`` is the snapshot the request arrived under; it keeps it to its end.
    """

    __slots__ = (
        "cached_tokens",
        "call",
        "deadline",
        "engine_wait",
        "excluded",
        "failed",
        "failover",
        "final",
        "held",
        "legs",
        "logprobs",
        "logprobs_sent",
        "original_call",
        "parser",
        "pending_error",
        "phase",
        "placement",
        "prepared",
        "processor",
        "prompt_logprobs",
        "replaying",
        "request",
        "resumed",
        "settings",
        "stall_timeout_s",
        "started",
        "thinking_budget",
        "trace",
    )

    def __init__(
        self,
        settings: Settings,
        prepared: PreparedRequest,
        placement: Placement,
        call: GenerateCall,
        processor: OutputProcessor,
        *,
        now: float,
        started: float = 0.0,
        engine_wait: EngineWait | None = None,
        trace: RequestTrace | None = None,
        parser: ChoiceOutputParser | None = None,
    ) -> None:
        self.settings = settings
        self.prepared = prepared
        self.request: ChatRequest | CompletionRequest = prepared.request
        self.placement = placement  # this attempt's; the first one's predictions are checked
        self.call = call
        self.original_call = call  # every continuation starts from the client's own prompt
        self.processor = processor
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
        self.cached_tokens: int | None = None
        self.final: OutputStep | None = None
        #: an error met after tokens of the same batch: raised at the next wait
        self.pending_error: EngineError | None = None
        self.started = started  # perf_counter() at the start, for the time to first token
        self.trace = trace  # None unless tracing is on
        #: with logprobs asked for: one per token the processor consumed (None: not asked)
        self.logprobs: list[TokenLogprob] | None = (
            None if call.sampling.logprobs is None else []
        )
        self.logprobs_sent = 0  # how many of them went out
        self.prompt_logprobs: PromptLogprobs | None = None
        #: the choice's output parser (tool calls, reasoning); None: the text is all content.
        #: It lives here, not with an engine call, so a migrated stream keeps its state.
        self.parser = parser
        #: the reasoning tokens the reply may spend, until its block is closed for it (None:
        #: no limit, or none it can keep: no parser, or a constraint a continuation would lose)
        self.thinking_budget = (
            self.request.thinking_limit if parser is not None and not constrained else None
        )
        #: the rest of a batch past the budget, taken next unless the block is closed there
        self.held: EngineEvent | None = None
        self.legs = 0  # engine calls after the first: each continuation's id is its own
        self.resumed = False  # continued past a closed reasoning block

    # -- parsed output -------------------------------------------------------------------

    def parse(self, text: str, finished: bool) -> ParsedDelta:
        """The parsed delta of a batch's text (after stop strings); flushed once finished."""
        parser = self.parser
        if parser is None:
            return ParsedDelta(content=text)
        delta = parser.feed(text) if text else ParsedDelta()
        if finished:
            delta.extend(parser.finish())
        request = self.request
        if isinstance(request, ChatRequest):
            if not request.parallel_tool_calls:
                delta = only_first_call(delta)
            if not request.include_reasoning:
                delta.reasoning = ""
        return delta

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason: ``"tool_calls"`` after a natural stop that made calls."""
        final = self.final
        assert final is not None
        reason = final.finish_reason or "stop"
        parser = self.parser
        return reason if parser is None else finish_reason(reason, parser.tool_calls_made > 0)

    # -- one batch -----------------------------------------------------------------------

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

    def take(self, event: EngineEvent | None, queue: EventQueue) -> tuple[str, int, bool]:
        """Take ``event`` (the wait's result) and every event already queued behind it.

        Consecutive token deltas are merged into one call of the output
        processor (the per-call cost dominates at high token rates). Returns the
        new text, how many tokens it covers, and whether the output is finished.
        """
        if self.phase is _WAITING:
            self.phase = _RELAYING
        before = self.processor.completion_tokens
        pieces: list[str] = []
        tokens: list[int] = []
        logprobs = self.logprobs
        while event is not None:
            if self.replaying:
                replayed = self._replayed(event)
                if replayed is None:
                    break
                event = replayed
            if self.thinking_budget is not None:
                event = self._up_to_budget(event, len(tokens))
            self._note_cached(event)
            if logprobs is not None:
                self._note_logprobs(event)
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
                if self.held is not None:  # the budget's end: the rest waits for the verdict
                    break
            else:
                if tokens and self._take(tokens, pieces):
                    tokens = []
                    break
                tokens = []
                self._finish(event, pieces)
                break
            try:
                event = queue.receive_nowait()
            except EngineError as error:  # surfaces after the tokens before it are taken
                self.pending_error = error
                break
        if tokens:
            self._take(tokens, pieces)
        finished = self.final is not None
        if finished:
            self.phase = Phase.FINISHED
        return "".join(pieces), self.processor.completion_tokens - before, finished

    def _up_to_budget(self, event: TokenDelta | Finished, merged: int) -> TokenDelta | Finished:
        """``event`` up to the reasoning budget (``merged``: tokens of this batch before it);
        the rest of it is :attr:`held`, so the block can be closed exactly there."""
        assert self.thinking_budget is not None
        room = self.thinking_budget - self.processor.completion_tokens - merged
        ids = event.token_ids
        if room >= len(ids) or room < 0 or (room == 0 and not merged):
            return event  # within it; or a batch that starts at it (a budget of 0) is taken
        self.held = dataclasses.replace(event, token_ids=ids[room:],
                                        logprobs=event.logprobs[room:])
        return TokenDelta(ids[:room], event.prompt_tokens, event.completion_tokens,
                          event.cached_tokens, event.logprobs[:room], event.prompt_logprobs)

    def _replayed(self, event: TokenDelta | Finished) -> TokenDelta | Finished | None:
        """``event`` less the tokens a replay repeats; None once it differs (the error is kept).

        Every token the replay repeats must be the one already streamed, and
        the replay may not end before it has repeated them all.
        """
        expected = self.replaying
        ids = event.token_ids
        n = min(len(ids), len(expected))
        if ids[:n] != expected[:n] or (isinstance(event, Finished) and n < len(expected)):
            self.replaying = ()
            self.failover.unmigratable = UNMIGRATABLE_REPLAY
            self.failover.refused_migration = True
            already = len(self.processor.generated_ids)
            same = already - len(expected) + next(
                (i for i in range(n) if ids[i] != expected[i]), n)
            self.pending_error = EngineError(
                ErrorKind.INTERNAL,
                f"the stream cannot continue on another engine: replaying its "
                f"structured-output constraint there gave other tokens after {same} of the "
                f"{already} already streamed",
                engine=self.placement.engine.name,
            )
            return None
        self.replaying = expected[n:]
        if not n:
            return event
        return dataclasses.replace(event, token_ids=ids[n:], logprobs=event.logprobs[n:])

    def _note_logprobs(self, event: TokenDelta | Finished) -> None:
        """Queue an event's logprobs behind those of the tokens before it.

        Kept in step with the tokens fed to the processor (which stop
        consuming once the output is finished): entries past what it consumed
        are dropped in :meth:`logprobs_out`.
        """
        assert self.logprobs is not None
        self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs

    def logprobs_out(self) -> Sequence[TokenLogprob]:
        """The logprobs of the tokens whose text went out since the last call."""
        logprobs = self.logprobs
        if logprobs is None:
            return ()
        consumed = self.processor.completion_tokens
        if len(logprobs) > consumed:  # tokens past the output's end (a stop, max_tokens)
            del logprobs[consumed:]
        ready = min(self.processor.tokens_out(), len(logprobs))
        out = logprobs[self.logprobs_sent:ready]
        self.logprobs_sent = max(ready, self.logprobs_sent)
        return out

    def _note_cached(self, event: TokenDelta | Finished) -> None:
        if self.cached_tokens is None or not (self.failover.migrations or self.resumed):
            # The original prompt's cache hits; a continuation's prompt is not the client's.
            self.cached_tokens = event.cached_tokens

    def _take(self, token_ids: list[int], pieces: list[str]) -> bool:
        """Feed merged token ids to the output processor; True once the output is finished."""
        step = self.processor.on_tokens(token_ids)
        if step.text:
            pieces.append(step.text)
        if step.finished:
            self.final = step
        return step.finished

    def _finish(self, event: Finished, pieces: list[str]) -> None:
        if event.token_ids and self._take(list(event.token_ids), pieces):
            return
        step = self.processor.on_finish(
            event.reason, event.matched_token_id, event.matched_stop_str
        )
        if step.text:
            pieces.append(step.text)
        self.final = step

    def ends_by_itself(self, engine: EngineHandle) -> bool:
        """Whether the engine stops on its own where the output stopped (no Abort needed)."""
        final = self.final
        if final is None:
            return False
        if final.finish_reason == "length":
            return True  # the engine's budget ends at the same token
        stop = final.stop_reason
        return isinstance(stop, int) and (
            stop in engine.info.eos_token_ids or stop in self.request.stop_token_ids
        )

    # -- the reasoning budget --------------------------------------------------------------

    def thinking_due(self) -> str | None:
        """The marker that closes the reasoning block, once the reply has spent its budget
        inside it (the parser has read every batch handed on); None until then.

        At the budget with no block open (it closed already, or never opened)
        the budget is done with, and the output held past it goes on.
        """
        budget = self.thinking_budget
        if budget is None or self.processor.completion_tokens < budget:
            return None
        assert self.parser is not None
        marker = open_reasoning_close(self.parser)
        if marker is None:
            self.thinking_budget = None
        else:
            self.held = None  # past the budget: not the reply's
        return marker

    def close_thinking(self, ids: Sequence[int]) -> tuple[str, int, bool]:
        """Put ``ids`` (the closing marker) in the output as if the engine had sent them.

        Returns what :meth:`take` does. Their logprobs are 0: they were not sampled.
        """
        self.thinking_budget = None  # once
        before = self.processor.completion_tokens
        if self.logprobs is not None:
            self.logprobs.extend(TokenLogprob(token_id, 0.0) for token_id in ids)
        pieces: list[str] = []
        self._take(list(ids), pieces)
        finished = self.final is not None
        if finished:
            self.phase = Phase.FINISHED
        return "".join(pieces), self.processor.completion_tokens - before, finished

    def resume(self, dispatcher: Dispatcher) -> None:
        """Continue the output after the closed block, where the policy places it.

        Raises :class:`EngineError` when no engine can take it now (the usual
        failover then decides).
        """
        catalog = dispatcher.fleet.catalog
        excluded = self.failover.excluded(catalog) | incapable(catalog, self.request).keys()
        engine = self.placement.engine.name
        try:
            placement = dispatcher.choose(
                self.settings.policy, self.prepared.input_ids, self.processor.remaining_tokens,
                excluded, self.prepared.routing_key,
            )
        except NoEngineAvailable:
            raise EngineError(ErrorKind.UNAVAILABLE, "no engine to continue on after the "
                              "reasoning budget", engine=engine) from None
        self.legs += 1
        call = continuation(self.original_call, self.processor.generated_ids, self.legs)
        limit = placement.engine.context_length
        if limit is not None and len(call.input_ids) + call.sampling.max_tokens > limit:
            raise EngineError(ErrorKind.BAD_REQUEST, "the reply cannot continue after its "
                              "reasoning budget: the context is too short", engine=engine)
        self.excluded = excluded
        self.placement = placement
        self.call = call
        self.resumed = True
        self.phase = Phase.RELAYING

    # -- leaving an engine ---------------------------------------------------------------

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

    def interrupted(self, now: float) -> EngineError:
        """What ended this attempt before its output did: a move, the deadline or a stall."""
        engine = self.placement.engine.name
        if self.phase is Phase.MOVING:
            return EngineError(ErrorKind.DRAINING, "the engine is draining", engine=engine)
        if now >= self.deadline:
            self.phase = Phase.TIMED_OUT  # the whole request's time is up: no retry
            return EngineError(ErrorKind.CANCELLED, "request_timeout_s passed", engine=engine)
        return EngineError(ErrorKind.TIMEOUT, "the stream stalled", engine=engine)

    def next_attempt(self, error: EngineError, dispatcher: Dispatcher, now: float) -> Decision:
        """Decide what follows ``error`` (retry or migrate) and :meth:`place` it.

        Re-raises ``error`` when the request gives up.
        """
        name = error.engine = error.engine or self.placement.engine.name
        engine = self.placement.engine
        # the stint it failed in; another leg's (a prefill engine) as the catalog has it
        stint = engine if name == engine.name else next(
            (e for e in dispatcher.fleet.catalog.engines if e.name == name), None
        )
        decision = self.failover.decide(error, len(self.processor.generated_ids), stint)
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
        self.place(dispatcher, now)
        return decision

    def place(self, dispatcher: Dispatcher, now: float) -> Placement | None:
        """Place the attempt the last failure asked for, on an engine it may use.

        None: no such engine serves and the request waits for the catalog to
        change (phase ``NO_ENGINE``, until ``engine_wait.until``). Raises the
        last failure when it may not wait, or no longer: every engine it tried
        was saturated (a 429 at once, as ever), or ``wait_for_engine_s`` or the
        request's own time is up.
        """
        error = self.failed
        assert error is not None, "place() before a failure"
        catalog = dispatcher.fleet.catalog
        self.excluded = self.failover.excluded(catalog) | incapable(catalog, self.request).keys()
        try:
            placement = dispatcher.choose(
                self.settings.policy, self.prepared.input_ids, self.processor.remaining_tokens,
                self.excluded, self.prepared.routing_key,
            )
        except NoEngineAvailable:
            if not self.failover.all_overloaded and self.engine_wait.may_wait(now):
                self.phase = Phase.NO_ENGINE
                return None
            if now >= self.deadline:
                self.phase = Phase.TIMED_OUT
            self._give_up()
            raise error from None
        self.engine_wait.placed()
        self.held = None  # the failed engine's tokens: the next one generates them again
        self.legs += 1
        attempt = self.legs
        generated = self.processor.generated_ids
        if generated and self.failover.replayable:
            call = replay(self.original_call, attempt)
            self.replaying = generated
        else:
            call = continuation(self.original_call, generated, attempt)
            self.replaying = ()
        engine = placement.engine
        limit = engine.context_length
        if limit is not None and len(call.input_ids) + call.sampling.max_tokens > limit:
            self._give_up()
            raise EngineError(
                error.kind, f"{error.message}; cannot resume on {engine.name}: context too short",
                engine=error.engine,
            ) from None
        self.placement = placement
        self.call = call
        self.phase = Phase.RELAYING
        return placement

    def _give_up(self) -> None:
        if self.phase is not Phase.TIMED_OUT:
            self.phase = Phase.FAILED

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


class Relay:
    """Runs requests on the fleet and hands their output on in batches (the async driver)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        text_model: TextModel,
        metrics: Metrics,
        hit_rate: HitRateWatch,
        series: ModelSeries | None = None,
        parsers: ModelParsers = NO_PARSERS,
    ) -> None:
        self.dispatcher = dispatcher
        self.text_model = text_model
        self.metrics = metrics
        self.hit_rate = hit_rate
        self.series = series  # the model's own series, when the relay serves one model
        self.parsers = parsers  # the model's output parsers, for its chat replies

    async def begin(
        self, settings: Settings, prepared: PreparedRequest, trace: RequestTrace | None = None
    ) -> RelayState:
        """Place an admitted request; a 400 when it cannot fit.

        While no engine serves it waits for one (:class:`EngineWait`), then a 503.
        """
        request = prepared.request
        if trace is not None:
            trace.enter("route")
        now = trio.current_time()
        wait = EngineWait(
            settings.frontend.faults.wait_for_engine_s, now + settings.frontend.request_timeout_s
        )
        place = functools.partial(first_placement, self.dispatcher, settings, prepared, wait)
        placement = place(now)
        if placement is None:
            placement = await self.wait_for_engine(wait, place)
        if placement.spilled:
            self.metrics.kv_load_guard_spills_total.inc()
        if trace is not None:
            trace.routed(settings.policy.name, placement.engine.name,
                         placement.predicted_cached_tokens, placement.spilled)
        max_tokens = token_budget(
            prepared, placement.engine, settings.frontend.max_tokens_default
        )
        # Engine-side stop strings are not used: we stop all engine kinds the same way.
        # A non-streaming request without stop strings lets the engine send one message.
        # max_tokens 0 (an echo of the prompt alone): an engine generates at least one token,
        # which the processor drops
        parser = (choice_parser(self.parsers, request, prepared.prompt_text)
                  if isinstance(request, ChatRequest) else None)
        # A reasoning budget is kept by watching the output as it comes: streamed too.
        budgeted = parser is not None and request.thinking_limit is not None
        call = build_call(
            prepared, max(max_tokens, 1),
            stream=request.stream or bool(request.stop) or budgeted, trace=trace,
        )
        eos = () if request.ignore_eos else self.text_model.eos_token_ids
        # a parser reading special-token markers needs them in the text
        skip_special = request.skip_special_tokens and not (
            parser is not None and self.parsers.keeps_special_tokens
        )
        processor = OutputProcessor(
            self.text_model.new_detokenizer(skip_special_tokens=skip_special),
            request.stop,
            max_tokens,
            stop_token_ids=(*eos, *request.stop_token_ids),
            track_tokens=request.logprobs is not None,
        )
        if prepared.charge is not None:  # its tenant's tokens limit takes what it generates
            prepared.charge.watch(processor)
        return RelayState(
            settings, prepared, placement, call, processor,
            now=now, started=time.perf_counter(), engine_wait=wait, trace=trace, parser=parser,
        )

    async def run(self, state: RelayState, emit: Emit) -> None:
        """Drive the request to its end across engines; ``emit`` gets each batch of output.

        Raises the last :class:`EngineError` when the request gave up
        (:meth:`RelayState.error_for` says what the client is told).
        """
        metrics = self.metrics
        last_emit = 0.0
        while True:
            placement = state.placement
            engine = placement.engine
            closing: str | None = None  # the reasoning block's marker, when its budget is spent
            try:
                async with self.dispatcher.run(
                    placement, state.call, exclude=state.excluded,
                    stall_timeout_s=state.stall_timeout_s,
                ) as engine_call:  # on a decode engine: its prefill leg first (P/D)
                    receiver = engine_call.events
                    movers = engine.load.movers
                    prefilled = placement.prefilled
                    with trio.CancelScope() as stall:
                        move = functools.partial(_move_off, state, stall)
                        movers.add(move)
                        try:
                            while state.phase is not _MOVING:
                                stall.deadline = state.wait(trio.current_time())
                                event = state.held
                                if event is None:
                                    event = await receiver.receive()
                                else:
                                    state.held = None
                                stall.deadline = math.inf
                                text, tokens, finished = state.take(event, receiver)
                                now = time.perf_counter()
                                if prefilled is not None:  # this attempt's first output
                                    prefilled()  # its prefill is off the engine's queue
                                    prefilled = None
                                if last_emit == 0.0:
                                    metrics.observe_ttft(now - state.started)
                                    if self.series is not None:
                                        self.series.first_token(now - state.started)
                                    if state.trace is not None:
                                        state.trace.first_token()
                                elif tokens:
                                    metrics.observe_inter_token(now - last_emit, tokens)
                                last_emit = now
                                if finished:
                                    engine_call.ends_by_itself = state.ends_by_itself(engine)
                                    metrics.engine_request(engine.name, "ok")
                                # the final bytes go out before any Abort of the engine call
                                await emit(text, tokens, finished, state.logprobs_out())
                                if finished:
                                    return
                                if state.thinking_budget is not None:
                                    closing = state.thinking_due()
                                    if closing is not None:
                                        break
                        finally:
                            movers.discard(move)
                            if prefilled is not None:  # it ended with no output: not queued
                                prefilled()
                    if closing is None:
                        raise state.interrupted(trio.current_time())
                # the engine call is aborted: the rest of the reply follows the closed block
                text, tokens, finished = state.close_thinking(
                    self.text_model.encode(f"\n{closing}\n\n"))
                metrics.reasoning_budget_closed_total.inc()
                await emit(text, tokens, finished, state.logprobs_out())
                if finished:
                    return
                state.resume(self.dispatcher)
            except EngineError as error:
                state.pending_error = None
                metrics.engine_error(engine.name, error.kind)
                decision = state.next_attempt(error, self.dispatcher, trio.current_time())
                if state.phase is Phase.NO_ENGINE:
                    place = functools.partial(state.place, self.dispatcher)
                    await self.wait_for_engine(state.engine_wait, place)
                outcome = "retried" if decision is Decision.RETRY else "migrated"
                metrics.engine_request(engine.name, outcome)
                _log_attempt(error, outcome, state)
                if state.trace is not None:
                    state.trace.moved(outcome, error, engine.name, state.placement.engine.name,
                                      state.processor.completion_tokens)
                await trio.sleep(state.failover.backoff())

    async def wait_for_engine(
        self, wait: EngineWait, place: Callable[[float], Placement | None]
    ) -> Placement:
        """No engine the request may use serves: wait until ``place`` finds one.

        Each change of the catalog is a new try; ``place`` raises when the
        wait is over. A cancellation (the client left) ends it at once, and
        nothing has been sent to any engine for it.
        """
        fleet = self.dispatcher.fleet
        outcome = "cancelled"
        try:
            while True:
                assert wait.until is not None
                with trio.move_on_at(wait.until):
                    # the catalog ``place`` found wanting: no checkpoint since
                    await fleet.wait_for_catalog(fleet.catalog.version)
                outcome = "expired"
                placement = place(trio.current_time())
                if placement is not None:
                    outcome = "served"
                    return placement
                outcome = "cancelled"
        finally:
            self.metrics.engine_wait(outcome)
            if wait.waits == 1:  # once per request: later waits are only counted
                log.info(
                    "no engine could take the request: waited %.2f s (%s)",
                    trio.current_time() - wait.since, outcome, extra={"outcome": outcome},
                )

    def settle(self, state: RelayState, ok: bool, *, count_prompt: bool = True) -> None:
        """The response is out (``ok``: in full): usage, and what the policy learns from it.

        ``count_prompt``: False for a request's further choices (its prompt counts once).
        """
        prepared = state.prepared
        if state.parser is not None:
            self._count_malformed(state.parser)
        prompt = len(prepared.input_ids) if count_prompt else 0
        self.metrics.add_tokens(prompt, state.processor.completion_tokens)
        if self.series is not None:  # a choice's cached prompt counts once, like its prompt
            cached = (state.cached_tokens or 0) if count_prompt else 0
            self.series.usage(prompt, state.processor.completion_tokens, cached)
        if state.failover.refused_migration:
            self.metrics.migrations_refused_total.labels(state.failover.unmigratable).inc()
        if state.trace is not None:
            state.trace.usage(len(prepared.input_ids), state.processor.completion_tokens)
        if not ok:
            return
        placement = state.placement
        self.dispatcher.complete(
            state.settings.policy, placement, prepared.input_ids + state.processor.generated_ids
        )
        predicted = placement.predicted_cached_tokens
        if predicted is not None and not state.failover.tried:
            self.hit_rate.record(predicted, state.cached_tokens or 0, placement.engine)


    def _count_malformed(self, parser: ChoiceOutputParser) -> None:
        """Malformed model output, per parser; logged once per choice that had some."""
        bad = [(name, count) for name, count in parser_names(parser) if count]
        for name, count in bad:
            self.metrics.parser_malformed_total.labels(name).inc(count)
        if bad:
            log.warning(
                "model output the %s parser could not read came back as content",
                ", ".join(name for name, _ in bad), extra={"parser": bad[0][0]},
            )


def _move_off(state: RelayState, stall: trio.CancelScope) -> None:
    """A planned migration: leave this engine at the next safe point."""
    if state.move():
        stall.cancel()


def _log_attempt(error: EngineError, outcome: str, state: RelayState) -> None:
    to = state.placement.engine.name
    produced = state.processor.completion_tokens
    if error.kind is ErrorKind.DRAINING:
        log.info(
            "moved a stream off draining engine %s to %s after %d tokens",
            error.engine, to, produced, extra={"engine": error.engine, "to_engine": to},
        )
    else:
        log.warning(
            "engine %s failed (%s); %s on %s after %d tokens",
            error.engine, error, outcome, to, produced,
            extra={"engine": error.engine, "to_engine": to},
        )
