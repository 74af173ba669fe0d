"""Chat completions and completions output (sans-IO): SSE chunks, or one JSON body.

A request of several choices (``n > 1``, or a completions batch of
prompts) runs them side by side (pipeline/choices.py): its stream
interleaves the choices' chunks as they come, each carrying its index, and
ends once, with one usage chunk and ``[DONE]``; its full body holds every
choice. A choice that gives up after the stream started ends the whole
stream with an error event (the others are cancelled), as OpenAI-compatible
servers do and as the ``openai`` client expects: it raises at the first
error event. Usage counts each prompt once, every choice's output, and each
prompt's cached tokens as its first choice saw them.
"""

from __future__ import annotations

import time
from typing import Any

from direct_frontend.http.logprobs import ChoiceLogprobs
from direct_frontend.http.render import ChoiceOutput, ChunkRenderer, Kind, render_choices
from direct_frontend.http.stream import Renderer
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.parsers.base import ParsedDelta, collect
from direct_frontend.openai.types import served_tier
from direct_frontend.pipeline.relay_events import Batch, Echo, Finished, Opened, Usage
from direct_frontend.pipeline.serve_events import Prepared
from direct_frontend.text.token_bytes import TokenBytes


class CompletionsRenderer(Renderer):
    """One chat completions or completions response, every choice of it."""

    __slots__ = ("_cached", "_choices", "_chunks", "_completion", "_continuous", "_ends",
                 "_kind", "_prepared", "_roles", "streamed")

    def __init__(self, kind: Kind, prepared: Prepared) -> None:
        request = prepared.request
        prompts = len(prepared.prompt_tokens)
        count = request.n * prompts
        self._kind: Kind = kind
        self._prepared = prepared
        self.streamed = streamed = request.stream
        chat = kind == "chat"
        asked = request.logprobs is not None
        token_bytes = prepared.token_bytes
        self._chunks: list[ChunkRenderer] = []
        if count == 1:  # no comprehension's frame for the common request of one choice
            self._choices = [_Choice(asked, chat, token_bytes)]
            if streamed:
                self._chunks = [ChunkRenderer(kind, prepared.request_id, request.model,
                                              int(time.time()), request.include_usage, 0,
                                              served_tier(request))]
        else:
            self._choices = [_Choice(asked, chat, token_bytes) for _ in range(count)]
            if streamed:
                created = int(time.time())
                tier = served_tier(request)
                self._chunks = [ChunkRenderer(kind, prepared.request_id, request.model,
                                              created, request.include_usage, index, tier)
                                for index in range(count)]
            #: each choice's output tokens so far, and each prompt's cached tokens
            self._completion = [0] * count
            self._cached = [0] * prompts
        self._roles = True  # every choice announces its role first (chat), before any output
        self._continuous = request.include_usage and request.continuous_usage_stats
        self._ends: list[Finished | None] = [None] * count

    def opened(self, event: Opened, index: int) -> bytes:
        choice = self._choices[index]
        if not self.streamed:
            choice.opened(event)
            return b""
        head = b""
        if self._roles:
            chunks = self._chunks
            head = (chunks[0].role_chunk() if len(chunks) == 1
                    else b"".join([renderer.role_chunk() for renderer in chunks]))
            self._roles = False
        return head + choice.opened(event, self._chunks[index])

    def batch(self, event: Batch, index: int) -> bytes:
        choice = self._choices[index]
        if not self.streamed:
            choice.collect(event)
            return b""
        if len(self._choices) == 1:
            return choice.chunk(self._chunks[0], self._continuous, event)
        return choice.chunk(self._chunks[index], False, event, self._so_far(index, event))

    async def finished(self, event: Finished, index: int) -> tuple[bytes, bool]:
        choice = self._choices[index]
        if self.streamed and len(self._choices) == 1:  # a stream of one choice: it ends
            chunks = self._chunks[0]
            usage = event.usage
            return (choice.chunk(chunks, self._continuous, event.last)
                    + chunks.finish(event.finish_reason, event.stop_reason)
                    + chunks.usage(usage.prompt_tokens, usage.completion_tokens,
                                   usage.cached_tokens)
                    + chunks.done()), True
        self._ends[index] = event
        done = None not in self._ends
        if not self.streamed:
            choice.collect(event.last)
            if not done:
                return b"", False
            prepared = self._prepared
            outputs = [c.output(end) for c, end in zip(self._choices, self._ends, strict=True)]
            request = prepared.request
            return render_choices(self._kind, prepared.request_id, request.model,
                                  int(time.time()), outputs, self._usage(event),
                                  served_tier(request)), True
        chunks = self._chunks[index]
        out = (choice.chunk(chunks, False, event.last, self._so_far(index, event.last))
               + chunks.finish(event.finish_reason, event.stop_reason))
        if done:  # the last choice: usage and [DONE] go with it
            usage = self._usage(event)
            out += chunks.usage(usage.prompt_tokens, usage.completion_tokens,
                                usage.cached_tokens) + chunks.done()
        return out, done

    def failed(self, error: OpenAIHTTPError) -> bytes:
        """A started stream ends on a failure with an error event and ``[DONE]``."""
        return ChunkRenderer.error(error) + ChunkRenderer.done()

    def _so_far(self, index: int, batch: Batch) -> tuple[int, int, int] | None:
        """The response's usage so far, with ``batch`` of choice ``index`` counted
        (``continuous_usage_stats``; None without it)."""
        per_prompt = self._prepared.request.n
        self._completion[index] = batch.completion_tokens
        if index % per_prompt == 0:
            self._cached[index // per_prompt] = batch.cached_tokens
        if not self._continuous:
            return None
        return (sum(self._prepared.prompt_tokens), sum(self._completion), sum(self._cached))

    def _usage(self, last: Finished) -> Usage:
        """The whole response's usage, once every choice is finished (``last`` the last)."""
        if len(self._choices) == 1:
            return last.usage
        per_prompt = self._prepared.request.n
        ends = [end for end in self._ends if end is not None]
        return Usage(sum(self._prepared.prompt_tokens),
                     sum(end.usage.completion_tokens for end in ends),
                     sum(end.usage.cached_tokens for end in ends[::per_prompt]))


class _Choice:
    """One choice's output as its events bring it: its echo, its logprobs, and (a full
    response) its text or parsed deltas."""

    __slots__ = ("_asked", "_chat", "_tokens", "deltas", "echo", "logprobs", "pieces")

    def __init__(self, asked: bool, chat: bool, tokens: TokenBytes) -> None:
        self._asked = asked  # logprobs were asked for
        self._chat = chat
        self._tokens = tokens
        self.echo: Echo | None = None  # the prompt that leads it (completions ``echo``)
        self.logprobs: ChoiceLogprobs | None = None  # its logprobs, when asked for
        self.pieces: list[str] = []
        self.deltas: list[ParsedDelta] = []

    def opened(self, event: Opened, renderer: ChunkRenderer | None = None) -> bytes:
        """The choice's first output is here; a stream's first chunk: the echoed prompt
        (with its logprobs if asked for), ``b""`` without echo or ``renderer``."""
        echo = self.echo = event.echo
        if self._asked:
            self.logprobs = ChoiceLogprobs(self._chat, self._tokens,
                                           0 if echo is None else len(echo.text))
        if echo is None or renderer is None:
            return b""
        if self.logprobs is None:
            return renderer.text(echo.text)
        return renderer.text_with_logprobs(echo.text, self._prompt_logprobs(echo, self.logprobs))

    def chunk(self, renderer: ChunkRenderer, continuous_usage: bool, batch: Batch,
              usage: tuple[int, int, int] | None = None) -> bytes:
        """The choice's chunk for a batch of output (``b""``: nothing to send).

        Parsed when the choice has a parser; with the batch's logprobs and the
        usage so far (``continuous_usage``, or the given one) when asked for.
        """
        if continuous_usage:
            usage = (batch.prompt_tokens, batch.completion_tokens, batch.cached_tokens)
        logprobs = self.logprobs
        part = (logprobs.batch(batch.logprobs, batch.offsets)
                if logprobs is not None and batch.logprobs else None)
        if batch.parsed is not None:
            return renderer.parsed(batch.parsed, part, usage)
        if part is not None:
            return renderer.text_with_logprobs(batch.text, part, usage)
        if not batch.text:
            return b""
        if usage is not None:
            return renderer.text_with_usage(batch.text, *usage)
        return renderer.text(batch.text)

    def collect(self, batch: Batch) -> None:
        """Keep a batch of a full response: parsed when the choice has a parser, else its
        text; and its logprobs."""
        if batch.parsed is not None:
            self.deltas.append(batch.parsed)
        else:
            self.pieces.append(batch.text)
        logprobs = self.logprobs
        if logprobs is not None and batch.logprobs:
            logprobs.batch(batch.logprobs, batch.offsets)

    def output(self, end: Finished | None) -> ChoiceOutput:
        """The choice in a full response (led by the prompt, and its logprobs, when echoed)."""
        assert end is not None
        pieces, logprobs, echo = self.pieces, self.logprobs, self.echo
        if echo is not None:
            pieces.insert(0, echo.text)
            if logprobs is not None:
                self._prompt_logprobs(echo, logprobs)
        return ChoiceOutput(
            "".join(pieces), end.finish_reason, end.stop_reason,
            None if logprobs is None else logprobs.whole(),
            collect(self.deltas) if end.last.parsed is not None else None,
        )

    @staticmethod
    def _prompt_logprobs(echo: Echo, logprobs: ChoiceLogprobs) -> dict[str, Any]:
        """The echoed prompt's logprobs, from what the engine sent with its first output."""
        return logprobs.prompt(echo.token_ids, echo.logprobs, echo.offsets)
