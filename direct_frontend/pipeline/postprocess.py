"""Output postprocessing: engine token ids in, client text and finish reason out.

Sans-IO and per request. The engine only knows max_tokens and stop token
ids; stop strings, token accounting and the OpenAI finish reason are decided
here, so the answer is the same whichever engine kind produced the tokens,
and a stream migrated to another engine continues from :attr:`generated_ids`.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
from typing import Literal, Protocol

import msgspec

from direct_frontend.engines.neutral import FinishReason
from direct_frontend.text.stops import StopStringMatcher

OpenAIFinishReason = Literal["stop", "length", "abort", "error"]

_FINISH_REASONS: dict[FinishReason, OpenAIFinishReason] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class Detokenizer(Protocol):
    """What the processor needs from a detokenizer (see ``IncrementalDetokenizer``)."""

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class OutputStep(msgspec.Struct, frozen=True):
    """The result of feeding the processor: text to send and whether output is complete
    (a struct: one is made per batch of tokens).

    ``finish_reason`` and ``stop_reason`` are set once ``finished``;
    ``stop_reason`` is the stop string or stop token id behind a "stop", or
    None when the engine stopped on EOS without saying which token.
    """

    text: str
    finished: bool
    completion_tokens: int
    matched_stop: str | None = None
    finish_reason: OpenAIFinishReason | None = None
    stop_reason: str | int | None = None


class OutputProcessor:
    """Detokenizes, applies stop strings and max_tokens, and counts usage for one request.

    When :meth:`on_tokens` returns ``finished=True`` the output is complete:
    after a stop string the caller must abort the engine (it does not know
    stop strings); after max_tokens the engine is stopping anyway. Tokens fed
    after that are ignored.

    ``stop_token_ids`` (EOS ids unless ``ignore_eos``, plus the request's
    stop_token_ids) are tokens whose text is never shown and that end the
    output with "stop", even when they are also the max_tokens-th token.

    ``max_tokens`` 0 (a completions ``echo`` of the prompt alone) keeps no
    output token: the engine, which must generate one, ends it with "length".

    With ``track_tokens`` (a request with logprobs) it also keeps where each
    token's text ends in the output, so :meth:`tokens_out` can say which
    tokens' text is out: their logprobs go with it, and those of tokens whose
    text a stop string cut are never sent.
    """

    __slots__ = (
        "_detokenizer",
        "_ends",
        "_finish_reason",
        "_finished",
        "_ids",
        "_matched_stop",
        "_matcher",
        "_max_tokens",
        "_raw",
        "_sent",
        "_stop_reason",
        "_stop_token_ids",
        "_track",
    )

    def __init__(
        self,
        detokenizer: Detokenizer,
        stop: Sequence[str],
        max_tokens: int,
        *,
        stop_token_ids: Collection[int] = (),
        track_tokens: bool = False,
    ) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must not be negative, got {max_tokens}")
        self._detokenizer = detokenizer
        matcher = StopStringMatcher(stop)
        self._matcher: StopStringMatcher | None = matcher if matcher.stops else None
        self._max_tokens = max_tokens
        self._stop_token_ids = frozenset(stop_token_ids)
        self._ids: list[int] = []
        self._finished = False
        self._finish_reason: OpenAIFinishReason | None = None
        self._stop_reason: str | int | None = None
        self._matched_stop: str | None = None
        self._track = track_tokens
        #: per token whose text the detokenizer released: the output length after it
        self._ends: list[int] = []
        self._raw = 0  # characters the detokenizer released
        self._sent = 0  # characters handed out in steps

    @property
    def generated_ids(self) -> tuple[int, ...]:
        """Every output token consumed so far: what a resumed request continues after."""
        return tuple(self._ids)

    @property
    def completion_tokens(self) -> int:
        """Output tokens counted for usage."""
        return len(self._ids)

    @property
    def remaining_tokens(self) -> int:
        """The max_tokens to give an engine that resumes this request."""
        return self._max_tokens - len(self._ids)

    @property
    def finished(self) -> bool:
        """Whether the output is complete."""
        return self._finished

    def token_start(self, index: int) -> int:
        """Where output token ``index``'s text starts in the output (with ``track_tokens``)."""
        return self._ends[index - 1] if index > 0 else 0

    def tokens_out(self) -> int:
        """How many leading tokens have their text out (with ``track_tokens``).

        A token counts once all its text is out; when the output is finished,
        also one whose text a stop string cut midway (its start is out).
        Tokens that only begin a character count once the character is out.
        """
        ends, sent = self._ends, self._sent
        count = bisect.bisect_right(ends, sent)
        if self._finished and count < len(ends) and self.token_start(count) < sent:
            count += 1  # the token straddling the cut: its text starts before it
        return count

    def on_tokens(self, token_ids: Sequence[int]) -> OutputStep:
        """Consume new output ids from the engine; return the text they release."""
        if self._finished or not token_ids:
            return self._step("")
        room = self._max_tokens - len(self._ids)
        if len(token_ids) > room:
            token_ids = token_ids[:room]

        if (
            self._matcher is None and not self._track
            and self._stop_token_ids.isdisjoint(token_ids)
        ):
            self._ids.extend(token_ids)
            text = self._detokenizer.push(token_ids)
        else:
            text = self._consume_one_by_one(token_ids)
        if not self._finished and len(self._ids) >= self._max_tokens:
            text += self._drain()
            if not self._finished:
                self._finish("length", None)
        return self._step(text)

    def on_finish(
        self,
        reason: FinishReason,
        matched_token_id: int | None = None,
        matched_stop_str: str | None = None,
    ) -> OutputStep:
        """The engine ended the stream: release held text and settle the finish reason.

        A finish already decided here (a stop string, max_tokens) stands; the
        engine's reason only applies to a stream it ended first.
        """
        if self._finished:
            return self._step("")
        text = self._drain()
        if not self._finished:
            finish_reason = _FINISH_REASONS[reason]
            if finish_reason == "stop":
                self._matched_stop = matched_stop_str
                stop_reason: str | int | None = (
                    matched_stop_str if matched_stop_str is not None else matched_token_id
                )
            else:
                stop_reason = None
            self._finish(finish_reason, stop_reason)
        return self._step(text)

    def _consume_one_by_one(self, token_ids: Sequence[int]) -> str:
        """Token by token, so usage stops at exactly the token that completed a stop."""
        ids = self._ids
        push = self._push if self._track else self._detokenizer.push
        matcher = self._matcher
        stop_token_ids = self._stop_token_ids
        pieces: list[str] = []
        for token_id in token_ids:
            ids.append(token_id)
            if token_id in stop_token_ids:
                pieces.append(self._drain())
                if not self._finished:
                    self._finish("stop", token_id)
                break
            piece = push((token_id,))
            if matcher is not None:
                result = matcher.push(piece)
                pieces.append(result.text)
                if result.matched is not None:
                    self._matched_stop = result.matched
                    self._finish("stop", result.matched)
                    break
            else:
                pieces.append(piece)
        return "".join(pieces)

    def _push(self, token_ids: Sequence[int]) -> str:
        """The detokenizer's push, noting where the text of each token ends."""
        piece = self._detokenizer.push(token_ids)
        if piece:
            self._settle(len(piece))
        return piece

    def _settle(self, released: int) -> None:
        """Text was released: every token pushed so far ends at the new output length."""
        self._raw += released
        self._ends.extend([self._raw] * (len(self._ids) - len(self._ends)))

    def _drain(self) -> str:
        """Flush the detokenizer through the stop matcher, then the matcher itself.

        The flushed tail can still complete a stop string, which then finishes
        the output with "stop".
        """
        text = self._detokenizer.flush()
        if self._track:
            self._settle(len(text))
        if self._matcher is None:
            return text
        result = self._matcher.push(text)
        if result.matched is not None:
            self._matched_stop = result.matched
            self._finish("stop", result.matched)
            return result.text
        return result.text + self._matcher.flush()

    def _finish(self, reason: OpenAIFinishReason, stop_reason: str | int | None) -> None:
        self._finished = True
        self._finish_reason = reason
        self._stop_reason = stop_reason

    def _step(self, text: str) -> OutputStep:
        self._sent += len(text)
        if not self._finished:
            return OutputStep(text, False, len(self._ids))
        return OutputStep(
            text,
            True,
            len(self._ids),
            self._matched_stop,
            self._finish_reason,
            self._stop_reason,
        )
