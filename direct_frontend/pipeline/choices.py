"""Several choices (``n > 1``): one relay per choice, each its own engine call.

Every choice is a request of its own to the fleet: placed by the routing
policy (the KV-aware one sends them where the prompt is cached, so the
engine computes the prompt once), with its own output state (detokenizer,
stop strings) and its own failover, so an engine failing moves only the
choices it ran. The engines' own ``n`` is not used: its samples share one
call, so one failure would end them all, and a continuation resumes one
sample's tokens, not several (docs/architecture.md, "Several choices").

With a ``seed``, choice ``i`` samples with ``seed + i`` (wrapped to int64):
each choice is reproducible and differs from its siblings. Each choice's
engine call has its own request id (``<request id>-<i>``), so an Abort
reaches exactly the call it means.

A completions batch of prompts is ``n`` choices per prompt, in prompt order
(choice ``j`` of prompt ``p`` is index ``p × n + j``, as OpenAI numbers
them); each prompt's choices sample as that prompt's would alone (``seed +
j``), so a batch answers exactly what its prompts sent one by one would.

:class:`Choices` is the driver: it places every choice before any starts
(a request no engine can take gets its HTTP error before any engine call),
then runs them in one nursery, at most as many at a time as the admission
slots the request holds, handing every choice's events on with its index.
The first choice to give up ends the request, as a lone request's failure
would: the other choices are cancelled (their engine calls aborted) and its
``Failed`` is the last event.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import trio

from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.pipeline.preprocess import PreparedRequest
from direct_frontend.pipeline.relay import Relay
from direct_frontend.pipeline.relay_events import Emit, Failed, RelayEvent, Usage
from direct_frontend.pipeline.relay_state import RelayState
from direct_frontend.pipeline.settings import Settings

#: the writer of several choices' events: the choice's index, then the event
ChoiceEmit = Callable[[int, RelayEvent], Awaitable[None]]

_INT64 = 1 << 64
_INT64_MIN = -(1 << 63)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` samples with: ``seed + index``, wrapped into int64."""
    if seed is None:
        return None
    return (seed + index - _INT64_MIN) % _INT64 + _INT64_MIN


def choice_request(prepared: PreparedRequest, index: int, choice: int | None = None,
                   ) -> PreparedRequest:
    """Choice ``index`` of the response, ``choice`` of its prompt's (default: the same).

    A request of its own: its engine id names its place in the response, its
    seed its place among its prompt's choices.
    """
    request = prepared.request
    seed = choice_seed(request.seed, index if choice is None else choice)
    return dataclasses.replace(
        prepared,
        request_id=f"{prepared.request_id}-{index}",
        request=msgspec.structs.replace(request, seed=seed),
    )


class Choices:
    """The choices of one request, in index order, and the failure that ended them (if any)."""

    __slots__ = ("at_once", "failed", "per_prompt", "prepared", "prompts", "states")

    def __init__(self, prompts: Sequence[PreparedRequest], states: list[RelayState],
                 at_once: int | None = None) -> None:
        self.prompts = prompts  # one, or a completions batch's, in order
        self.prepared = prompts[0]  # the client's request (its id names the response)
        self.per_prompt = len(states) // len(prompts)  # n
        self.states = states
        #: the most choices on the engines at a time: the admission slots the request holds
        self.at_once = min(at_once or len(states), len(states))
        #: the choice that gave up first, and its event
        self.failed: tuple[int, Failed] | None = None

    def __len__(self) -> int:
        return len(self.states)

    @classmethod
    async def begin(
        cls, relay: Relay, settings: Settings, prompts: Sequence[PreparedRequest],
        trace: RequestTrace | None = None,
    ) -> Choices:
        """Place every choice; the first that cannot be placed raises its HTTP error.

        Placing starts nothing on any engine, so a refusal leaves nothing to abort.
        """
        n = prompts[0].request.n
        states = [
            await relay.begin(settings, choice_request(prepared, p * n + j, j), trace)
            for p, prepared in enumerate(prompts)
            for j in range(n)
        ]
        return cls(prompts, states, settings.admission.config.max_in_flight)

    async def run(self, relay: Relay, emit: ChoiceEmit, writing: trio.Lock | None = None) -> None:
        """Run every choice to its end; ``emit`` gets each choice's events with its index.

        The first choice that gives up ends the others (cancelled), and its
        :class:`Failed` is the last event. ``writing`` is the lock ``emit``
        holds while it writes to the client: the failing choice takes it
        before cancelling the others, so no write is cut short.
        """
        turns = trio.Semaphore(self.at_once)
        async with trio.open_nursery() as nursery:
            for index, state in enumerate(self.states):
                nursery.start_soon(self._run_one, relay, index, state,
                                   functools.partial(emit, index), nursery.cancel_scope,
                                   writing, turns)
        if self.failed is not None:
            await emit(*self.failed)

    async def _run_one(
        self, relay: Relay, index: int, state: RelayState, emit: Emit,
        everyone: trio.CancelScope, writing: trio.Lock | None, turns: trio.Semaphore,
    ) -> None:
        async with turns:  # a choice past the slots held starts as an earlier one ends
            failed = await relay.until_end(state, emit)
        if failed is None or self.failed is not None:
            return  # done; or another choice failed first: this one was being cancelled
        self.failed = index, failed
        if writing is not None:
            await writing.acquire()  # no write under way; the others wait for it, then stop
            everyone.cancel()
            writing.release()
        else:
            everyone.cancel()

    @property
    def finished(self) -> bool:
        """Whether every choice's output is complete."""
        return all(state.output.final is not None for state in self.states)

    def usage(self) -> Usage:
        """Each prompt's tokens once, every choice's completion tokens, the prompts' cached.

        A prompt's cached count is its first choice's, as a lone request reports it.
        """
        completion = sum(state.output.completion_tokens for state in self.states)
        firsts = self.states[::self.per_prompt]
        return Usage(sum(len(prepared.input_ids) for prepared in self.prompts), completion,
                     sum(state.output.cached_tokens or 0 for state in firsts))

    def settle(self, relay: Relay, ok: bool) -> None:
        """The response is out: every choice settles, each prompt counted once."""
        for index, state in enumerate(self.states):
            relay.settle(state, ok, count_prompt=index % self.per_prompt == 0)
        trace = self.states[0].trace
        if trace is not None:
            usage = self.usage()
            trace.usage(usage.prompt_tokens, usage.completion_tokens)
