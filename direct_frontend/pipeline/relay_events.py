"""What a relay tells its writer: typed values, never its own state.

A request's writer (an HTTP response, a background response's log) gets,
in this order: :class:`Opened` once, with the request's first output; a
:class:`Batch` for each batch of output after it; then either
:class:`Finished` (which carries the output's last batch) or
:class:`Failed`. A request that fails before any output gets
:class:`Failed` alone. The output parser has already read every batch's
text (:attr:`Batch.parsed`), once, in the pipeline.

The values are frozen and slotted (msgspec structs: one costs about as much
to make as a tuple), so a batch adds one small object to what the work
needs. They are data only, with no methods: a writer reads them, and never
calls back into the pipeline through them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import msgspec

from direct_frontend.engines.neutral import PromptLogprobs, TokenLogprob
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.parsers.base import ParsedDelta


class Usage(msgspec.Struct, frozen=True):
    """Token counts of one request; ``cached_tokens`` are prompt tokens served from cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Echo(msgspec.Struct, frozen=True):
    """The prompt a completions ``echo`` leads its choice with.

    ``logprobs`` and ``offsets`` (where each prompt token's text starts) are
    there when the request asked for logprobs: the engine sends the prompt's
    with its first output.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: PromptLogprobs | None = None
    offsets: Sequence[int] = ()


class Opened(msgspec.Struct, frozen=True):
    """The request's first output is here: what leads it (a writer's head goes out now)."""

    usage: Usage  # the prompt's tokens and how many of them the engine had cached
    engine: str  # the engine that produced it
    echo: Echo | None = None  # the prompt, when a completions request echoes it


class Batch(msgspec.Struct, frozen=True, gc=False):
    """A batch of output: new text, already parsed, with the logprobs of what is now out."""

    text: str  # after stop strings
    tokens: int  # how many output tokens it covers
    #: what the choice's output parser read in ``text`` (None: the request has no parser,
    #: the text is all content)
    parsed: ParsedDelta | None
    #: one per token whose text is now out (empty unless logprobs were asked for) …
    logprobs: Sequence[TokenLogprob]
    #: … and where that token's text starts in the output
    offsets: Sequence[int]
    prompt_tokens: int
    completion_tokens: int  # the output's tokens so far
    cached_tokens: int  # the prompt's tokens the engine had cached


class Finished(msgspec.Struct, frozen=True):
    """The output is complete: its last batch, why it ended, the request's usage."""

    last: Batch
    #: OpenAI's finish reason: ``"tool_calls"`` after a natural stop that made calls
    finish_reason: str
    #: the stop string or stop token id behind a ``"stop"`` (None: the engine's EOS)
    stop_reason: str | int | None
    matched_stop: str | None  # the stop string that ended it, if one did
    usage: Usage


class Failed(msgspec.Struct, frozen=True):
    """The request gave up: what the client is told, and the usage up to there."""

    error: OpenAIHTTPError
    usage: Usage


RelayEvent = Opened | Batch | Finished | Failed

#: the writer of one request's events
Emit = Callable[[RelayEvent], Awaitable[None]]
