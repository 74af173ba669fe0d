"""One request's walk from its placement to its last token, across engines.

The relay owns the request's output (detokenizer, stop strings, parser,
tokens produced), so when an engine fails it can retry the request on
another engine before the first token, or migrate it after: continue on
another engine from the tokens already produced. The client sees one
unbroken stream.

:class:`~direct_frontend.pipeline.relay_state.RelayState` is the request's
decisions, with no I/O, in three
objects with one job each: its attempts across engines
(:mod:`~direct_frontend.pipeline.attempt`), its output
(:mod:`~direct_frontend.pipeline.output_track`) and its reasoning budget
(:mod:`~direct_frontend.pipeline.thinking`). :class:`Relay` is the thin
async driver: it runs each attempt's engine call (:meth:`Dispatcher.run`)
and hands the output to its writer as typed events
(:mod:`~direct_frontend.pipeline.relay_events`), never its state. Per
batch it adds one small event to what the work needs: no task or channel.
While a request waits for an engine it sleeps on the fleet's catalog
(:meth:`WaitableFleet.wait_for_catalog`), trying again at each change.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable

import trio

from direct_frontend.errors import EngineError
from direct_frontend.observability.metrics import Metrics, ModelSeries
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.attempt import Attempt, Phase
from direct_frontend.pipeline.dispatch import Dispatcher, EngineCall
from direct_frontend.pipeline.engine_wait import EngineWait, first_placement
from direct_frontend.pipeline.failover import Decision
from direct_frontend.pipeline.output_track import OutputTrack
from direct_frontend.pipeline.parsing import (
    NO_PARSERS,
    ChoiceOutputParser,
    ModelParsers,
    choice_parser,
    parser_names,
)
from direct_frontend.pipeline.postprocess import OutputProcessor
from direct_frontend.pipeline.preempt import Hold
from direct_frontend.pipeline.preprocess import PreparedRequest, build_call, token_budget
from direct_frontend.pipeline.relay_events import Batch, Emit, Failed, Finished, Opened
from direct_frontend.pipeline.relay_state import RelayState
from direct_frontend.pipeline.settings import Settings
from direct_frontend.pipeline.thinking import ThinkingBudget
from direct_frontend.routing.hitrate import HitRateWatch
from direct_frontend.routing.policies import Placement
from direct_frontend.text.model_dir import TextModel

log = logging.getLogger("direct_frontend.http")  # the request log's name, as it always was

_MOVING = Phase.MOVING  # the per-batch check's: an enum attribute lookup costs ~100 ns


class Relay:
    """Runs requests on the fleet and hands their output on as events (the async driver)."""

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
        max_tokens = token_budget(prepared, placement.engine, settings.frontend.max_tokens_default)
        parser = (choice_parser(self.parsers, request, prepared.prompt_text)
                  if isinstance(request, ChatRequest) else None)
        # Engine-side stop strings are not used: we stop all engine kinds the same way.
        # A non-streaming request without stop strings lets the engine send one message;
        # a reasoning budget is kept by watching the output as it comes: streamed too.
        # max_tokens 0 (an echo of the prompt alone): an engine generates at least one token,
        # which the processor drops
        limit = request.thinking_limit if parser is not None else None
        call = build_call(
            prepared, max(max_tokens, 1),
            stream=request.stream or bool(request.stop) or limit is not None, trace=trace,
        )
        # none kept under a constraint, which the continuation past the block would lose
        budget = (None if limit is None or call.sampling.constraint is not None
                  else ThinkingBudget(limit))
        processor = self._processor(request, parser, max_tokens)
        if prepared.charge is not None:  # its tenant's tokens limit takes what it generates
            prepared.charge.watch(processor)
        output = OutputTrack(request, prepared.input_ids, processor, parser,
                             logprobs=call.sampling.logprobs is not None)
        attempt = Attempt(settings, prepared, placement, call, now=now, engine_wait=wait)
        return RelayState(attempt, output, budget, started=time.perf_counter(), trace=trace)

    def _processor(self, request: ChatRequest | CompletionRequest,
                   parser: ChoiceOutputParser | None, max_tokens: int) -> OutputProcessor:
        eos = () if request.ignore_eos else self.text_model.eos_token_ids
        # a parser reading special-token markers needs them in the text
        skip_special = request.skip_special_tokens and not (
            parser is not None and self.parsers.keeps_special_tokens
        )
        return OutputProcessor(
            self.text_model.new_detokenizer(skip_special_tokens=skip_special), request.stop,
            max_tokens, stop_token_ids=(*eos, *request.stop_token_ids),
            track_tokens=request.logprobs is not None,
        )

    async def until_end(self, state: RelayState, emit: Emit) -> Failed | None:
        """Drive the request to its end; ``emit`` gets every event but a :class:`Failed`,
        which is returned (None: the output is complete).

        Each turn is one engine call, relayed here (no frame of its own between the
        request and its output's writer); it raises :class:`EngineError` when the call
        failed or was cut short (a stall, the request's deadline, a move off a draining
        engine), and what follows is :meth:`_recover`'s.
        """
        while True:
            try:
                attempt = state.attempt
                placement = attempt.placement
                closing: str | None = None  # the reasoning block's marker, once spent
                async with self.dispatcher.run(
                    placement, attempt.call, exclude=attempt.excluded,
                    stall_timeout_s=attempt.stall_timeout_s,
                ) as engine_call:  # on a decode engine: its prefill leg first (P/D)
                    movers = placement.engine.load.movers
                    hold = state.hold
                    with trio.CancelScope() as stall:
                        move = functools.partial(attempt.leave, stall.cancel)
                        movers.add(move)
                        if hold is not None:  # its admission may ask it off too (preemption)
                            hold.running(functools.partial(attempt.give_way, stall.cancel),
                                         lambda: state.output.completion_tokens)
                        try:
                            closing = await self._relay(state, engine_call, stall, emit)
                        finally:
                            movers.discard(move)
                            if hold is not None:
                                hold.running(None)
                    if stall.cancelled_caught:  # the stall watch fired, or a move cut a wait
                        raise attempt.interrupted(trio.current_time())
                if closing is None or await self._close_thinking(state, closing, emit):
                    return None
            except EngineError as error:
                failed = await self._recover(state, error)
                if failed is not None:
                    return failed

    async def _close_thinking(self, state: RelayState, closing: str, emit: Emit) -> bool:
        """The reply spent its reasoning budget inside its block, and its engine call is
        aborted: ``closing`` (the block's marker) handed on, then the rest of the reply
        placed to follow it; True when the output is complete with it."""
        batch = state.close_thinking(self.text_model.encode(f"\n{closing}\n\n"))
        self.metrics.reasoning_budget_closed_total.inc()
        if state.output.final is not None:
            await emit(state.output.finished(batch))
            return True
        await emit(batch)
        state.resume(self.dispatcher)
        return False

    async def _recover(self, state: RelayState, error: EngineError) -> Failed | None:
        """What follows an engine call that ended in ``error``: the next attempt, placed
        (None), or the request's :class:`Failed` once it gives up."""
        try:
            hold = state.hold
            if hold is not None and hold.asked:
                await self._asked_off(state, hold, error)
            else:
                await self._after(state, error)
        except EngineError as last:
            log.warning("request failed on engine %s: %s", last.engine, last)
            return state.failed(last)
        return None

    async def _relay(self, state: RelayState, engine_call: EngineCall, stall: trio.CancelScope,
                     emit: Emit) -> str | None:
        """Hand on the engine call's output until it is complete (None), or until the reply
        has spent its reasoning budget inside its block (the marker that closes it).

        A move off the engine leaves at the next safe point: its error is raised.
        """
        attempt = state.attempt
        budget = state.budget
        receiver = engine_call.events
        prefilled = attempt.placement.prefilled
        try:
            while attempt.phase is not _MOVING:
                stall.deadline = attempt.wait(trio.current_time())
                event = None if budget is None else budget.release()
                if event is None:
                    event = await receiver.receive()
                    if stall.cancel_called:
                        # cut short (a move, or the stall watch) after the event was handed
                        # to this task but before it ran: the event is not taken, or the
                        # next checkpoint, the write, would drop what the output counted
                        break
                stall.deadline = math.inf
                batch = state.take(event, receiver)
                if prefilled is not None:  # this attempt's first output
                    prefilled()  # its prefill is off the engine's queue
                    prefilled = None
                opened = self._timed(state, batch)
                if opened is not None:  # the request's first output: its Opened before it
                    await emit(opened)
                if state.output.final is not None:  # it completes the output
                    await emit(self._finished(state, batch, engine_call))
                    return None
                await emit(batch)
                if budget is not None and budget.limit is not None:
                    closing = state.thinking_due()
                    if closing is not None:
                        return closing
        finally:
            if prefilled is not None:  # it ended with no output: not queued
                prefilled()
        raise attempt.interrupted(trio.current_time())

    def _timed(self, state: RelayState, batch: Batch) -> Opened | None:
        """Time ``batch``'s output: the request's first (its :class:`Opened`, handed on
        before it), or the next tokens (None). Plain calls, no coroutine per batch."""
        now = time.perf_counter()
        last_out = state.last_out
        state.last_out = now
        if last_out != 0.0:
            if batch.tokens:
                self.metrics.observe_inter_token(now - last_out, batch.tokens)
            return None
        ttft = now - state.started
        self.metrics.observe_ttft(ttft)
        if self.series is not None:
            self.series.first_token(ttft)
        if state.trace is not None:
            state.trace.first_token()
        return state.output.opened(state.attempt.placement.engine.name, self.text_model)

    def _finished(self, state: RelayState, batch: Batch, engine_call: EngineCall) -> Finished:
        """The last batch, which completes the output: the engine call needs no Abort when
        the engine ends it by itself."""
        engine = state.attempt.placement.engine
        engine_call.ends_by_itself = state.output.ends_by_itself(engine)
        self.metrics.engine_request(engine.name, "ok")
        return state.output.finished(batch)  # its bytes go out before any Abort

    async def _asked_off(self, state: RelayState, hold: Hold, error: EngineError) -> None:
        """The attempt ended after its admission asked the request off its engine: requeued,
        or a failover that keeps its slots (:meth:`RelayState.asked_off`)."""
        failure = state.asked_off(hold, error)
        if failure is None:
            await self._requeue(state, hold, error)
        else:
            await self._after(state, failure)

    async def _requeue(self, state: RelayState, hold: Hold, error: EngineError) -> None:
        """Preempted and off its engine: wait for a slot again, then go on from its tokens
        where the policy places it (pipeline/preempt.py); failover if no engine takes it."""
        attempt = state.attempt
        self.metrics.engine_request(attempt.placement.engine.name, "preempted")
        if trio.current_time() >= attempt.deadline:  # no time left to continue it in
            raise attempt.expired()
        if not await attempt.settings.admission.requeue(hold, attempt.deadline):
            raise attempt.expired()
        try:
            state.resume(self.dispatcher)
        except EngineError:
            await self._after(state, error)

    async def _after(self, state: RelayState, error: EngineError) -> None:
        """What follows a failure: the next attempt (placed once an engine serves, after a
        backoff). Raises the last :class:`EngineError` when the request gives up."""
        attempt = state.attempt
        attempt.pending_error = None
        engine = attempt.placement.engine
        metrics = self.metrics
        metrics.engine_error(engine.name, error.kind)
        decision = state.next_attempt(error, self.dispatcher, trio.current_time())
        if attempt.phase is Phase.NO_ENGINE:
            place = functools.partial(state.place, self.dispatcher)
            await self.wait_for_engine(attempt.engine_wait, place)
        outcome = "retried" if decision is Decision.RETRY else "migrated"
        metrics.engine_request(engine.name, outcome)
        attempt.log(error, outcome, state.output.completion_tokens)
        if state.trace is not None:
            state.trace.moved(outcome, error, engine.name, attempt.placement.engine.name,
                              state.output.completion_tokens)
        await trio.sleep(attempt.failover.backoff())

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
        attempt, output = state.attempt, state.output
        prepared = attempt.prepared
        if output.parser is not None:
            self._count_malformed(output.parser)
        prompt = len(prepared.input_ids) if count_prompt else 0
        completion = output.completion_tokens
        self.metrics.add_tokens(prompt, completion)
        if self.series is not None:  # a choice's cached prompt counts once, like its prompt
            cached = (output.cached_tokens or 0) if count_prompt else 0
            self.series.usage(prompt, completion, cached)
        failover = attempt.failover
        if failover.refused_migration:
            self.metrics.migrations_refused_total.labels(failover.unmigratable).inc()
        if state.trace is not None:
            state.trace.usage(len(prepared.input_ids), completion)
        if not ok:
            return
        placement = attempt.placement
        self.dispatcher.complete(attempt.settings.policy, placement, prepared.input_ids,
                                 output.processor.generated_ids)
        predicted = placement.predicted_cached_tokens
        if predicted is not None and not failover.tried:
            self.hit_rate.record(predicted, output.cached_tokens or 0, placement.engine)

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
