"""A request's output as it goes out: text, its parse, its logprobs, its usage (sans-IO).

The output is the request's, not an engine call's: it lives across every
attempt, so a stream migrated to another engine goes on from the same
detokenizer, stop strings, parser and counts. Each batch of engine tokens
becomes one :class:`~direct_frontend.pipeline.relay_events.Batch`: its
text after stop strings, what the choice's output parser read in it (the
parser runs here, once), the logprobs of the tokens whose text is now out,
and the usage so far. The last one goes out in a
:class:`~direct_frontend.pipeline.relay_events.Finished`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from direct_frontend.engines.neutral import (
    EngineEvent,
    Finished,
    PromptLogprobs,
    TokenLogprob,
)
from direct_frontend.openai.parsers.base import ParsedDelta, finish_reason
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline import relay_events
from direct_frontend.pipeline.parsing import ChoiceOutputParser, only_first_call
from direct_frontend.pipeline.postprocess import OutputProcessor, OutputStep
from direct_frontend.pipeline.relay_events import Batch, Echo, Opened, Usage
from direct_frontend.routing.catalog import EngineHandle
from direct_frontend.text.model_dir import TextModel


class OutputTrack:
    """One request's output: what was handed on, and what is owed with it."""

    __slots__ = (
        "cached_tokens",
        "final",
        "logprobs",
        "logprobs_sent",
        "parser",
        "processor",
        "prompt_ids",
        "prompt_logprobs",
        "request",
    )

    def __init__(
        self, request: ChatRequest | CompletionRequest, prompt_ids: Sequence[int],
        processor: OutputProcessor, parser: ChoiceOutputParser | None = None, *,
        logprobs: bool = False,
    ) -> None:
        self.request = request
        self.prompt_ids = prompt_ids  # the client's prompt, as the engine read it first
        self.processor = processor
        #: the choice's output parser (tool calls, reasoning); None: the text is all content
        self.parser = parser
        self.final: OutputStep | None = None  # once the output is complete: how it ended
        self.cached_tokens: int | None = None
        #: with logprobs asked for: one per token the processor consumed (None: not asked)
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.logprobs_sent = 0  # how many of them went out
        self.prompt_logprobs: PromptLogprobs | None = None

    @property
    def completion_tokens(self) -> int:
        return self.processor.completion_tokens

    # -- engine output in -----------------------------------------------------------------

    def note(self, event: EngineEvent, continued: bool) -> None:
        """What an event says besides its tokens: cached tokens, logprobs.

        ``continued``: the engine's prompt is a continuation's, whose cache
        hits are not the client's prompt's.
        """
        if self.cached_tokens is None or not continued:
            self.cached_tokens = event.cached_tokens
        logprobs = self.logprobs
        if logprobs is not None:
            # in step with the tokens fed to the processor (which stops consuming once the
            # output is finished): entries past what it consumed are dropped when sent
            logprobs.extend(event.logprobs)
            if event.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = event.prompt_logprobs

    def notes_each(self, continued: bool) -> bool:
        """Whether :meth:`note` must hear every event of a batch (in order): with logprobs
        kept, or for a continuation (whose cache hits are not the client's prompt's: the count
        noted first stays). Else each event's cached tokens replace the last's, so the batch's
        last event is enough."""
        return self.logprobs is not None or continued

    def feed(self, token_ids: list[int], pieces: list[str]) -> bool:
        """Feed merged token ids to the processor, their text to ``pieces``; True once the
        output is finished."""
        step = self.processor.on_tokens(token_ids)
        if step.text:
            pieces.append(step.text)
        if step.finished:
            self.final = step
        return step.finished

    def finish(self, event: Finished, pieces: list[str]) -> None:
        """The engine ended the stream (its last tokens first)."""
        if event.token_ids and self.feed(list(event.token_ids), pieces):
            return
        step = self.processor.on_finish(
            event.reason, event.matched_token_id, event.matched_stop_str
        )
        if step.text:
            pieces.append(step.text)
        self.final = step

    def unsampled(self, ids: Sequence[int], pieces: list[str]) -> None:
        """Put ``ids`` in the output as if the engine had sent them; their logprobs are 0."""
        if self.logprobs is not None:
            self.logprobs.extend(TokenLogprob(token_id, 0.0) for token_id in ids)
        self.feed(list(ids), pieces)

    # -- events out -----------------------------------------------------------------------

    def batch(self, text: str, tokens: int) -> Batch:
        """The batch of ``text`` (``tokens`` of output), parsed, with its logprobs."""
        parsed = None if self.parser is None else self.parse(text, self.final is not None)
        if self.logprobs is None:
            return Batch(text, tokens, parsed, (), (), len(self.prompt_ids),
                         self.processor.completion_tokens, self.cached_tokens or 0)
        logprobs, offsets = self._logprobs_out()
        return Batch(text, tokens, parsed, logprobs, offsets, len(self.prompt_ids),
                     self.processor.completion_tokens, self.cached_tokens or 0)

    def finished(self, last: Batch) -> relay_events.Finished:
        """The complete output's end, after ``last``."""
        final = self.final
        assert final is not None
        reason: str = final.finish_reason or "stop"
        parser = self.parser
        if parser is not None:
            reason = finish_reason(reason, parser.tool_calls_made > 0)
        return relay_events.Finished(last, reason, final.stop_reason, final.matched_stop,
                                     self.usage())

    def usage(self) -> Usage:
        """The request's tokens so far."""
        return Usage(len(self.prompt_ids), self.processor.completion_tokens,
                     self.cached_tokens or 0)

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

    def _logprobs_out(self) -> tuple[list[TokenLogprob], list[int]]:
        """The logprobs of the tokens whose text went out since the last call, and where
        each of those tokens' text starts in the output."""
        logprobs = self.logprobs
        assert logprobs is not None
        processor = self.processor
        consumed = processor.completion_tokens
        if len(logprobs) > consumed:  # tokens past the output's end (a stop, max_tokens)
            del logprobs[consumed:]
        sent = self.logprobs_sent
        ready = min(processor.tokens_out(), len(logprobs))
        self.logprobs_sent = max(ready, sent)
        return logprobs[sent:ready], [processor.token_start(i) for i in range(sent, ready)]

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

    def opened(self, engine: str, text_model: TextModel) -> Opened:
        """The head of the output, as its first batch is here (``engine`` produced it)."""
        return Opened(Usage(len(self.prompt_ids), 0, self.cached_tokens or 0), engine,
                      self._echo(text_model))

    def _echo(self, text_model: TextModel) -> Echo | None:
        """The prompt a completions ``echo`` leads the choice with (None: no echo)."""
        request = self.request
        if not isinstance(request, CompletionRequest) or not request.echo:
            return None
        prompt = request.prompt
        skip = request.skip_special_tokens
        text = prompt if isinstance(prompt, str) else text_model.decode(prompt, skip)
        if self.logprobs is None:
            return Echo(text, tuple(self.prompt_ids))
        push = text_model.new_detokenizer(skip_special_tokens=skip).push
        ids = tuple(self.prompt_ids)
        return Echo(text, ids, self.prompt_logprobs, prompt_offsets(push, ids))


def prompt_offsets(push: Callable[[Sequence[int]], str], prompt_ids: Sequence[int]) -> list[int]:
    """Where each prompt token's text starts in the prompt's text, by incremental decoding."""
    offsets, length = [], 0
    for token_id in prompt_ids:
        offsets.append(length)
        length += len(push((token_id,)))
    return offsets
