"""The ``logprobs`` of a choice, in OpenAI's two shapes, from the relay's per-token logprobs.

Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}``, the alternatives highest first; a token holding part of a
UTF-8 character shows those bytes as ``\\xHH`` in ``token`` and exactly in
``bytes``, as OpenAI does. Completions: ``{tokens, token_logprobs,
top_logprobs, text_offset}`` with tokens as vLLM writes them (each token's
own text, a partial character as U+FFFD), ``top_logprobs`` a dict per
position of the alternatives and the sampled token (OpenAI's "up to
logprobs+1"), and ``text_offset`` each token's start in the choice's text.
A streamed choice gets one such object per chunk, holding the tokens whose
text that chunk carries; offsets run on across chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from direct_frontend.engines.neutral import PromptLogprobs, TokenLogprob
from direct_frontend.text.token_bytes import TokenBytes


def chat_logprobs(tokens: TokenBytes, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": tokens.chat_token(token_id),
            "logprob": logprob,
            "bytes": list(tokens.of(token_id)),
        }

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ],
        "refusal": None,
    }


class CompletionLogprobs:
    """One completions choice's ``logprobs``, built batch by batch.

    Each batch's tokens come with where their text starts in the generated
    text; ``base`` is what leads it in the choice (the echoed prompt's length).
    """

    def __init__(self, tokens: TokenBytes, base: int = 0) -> None:
        self._tokens = tokens
        self._base = base

    def prompt(
        self, prompt_ids: Sequence[int], logprobs: PromptLogprobs | None, offsets: Sequence[int]
    ) -> dict[str, Any]:
        """The echoed prompt's part: a position without a logprob (the first) is null."""
        out = self._empty()
        for i, token_id in enumerate(prompt_ids):
            lp = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            self._add(out, token_id, lp, offsets[i])
        return out

    def output(self, logprobs: Sequence[TokenLogprob], starts: Sequence[int]) -> dict[str, Any]:
        """The part for the next output tokens (in order, each once), whose text starts at
        ``starts`` in the output."""
        out = self._empty()
        base = self._base
        for lp, start in zip(logprobs, starts, strict=True):
            self._add(out, lp.token_id, lp, base + start)
        return out

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _add(self, out: dict[str, Any], token_id: int, lp: TokenLogprob | None, at: int) -> None:
        name = self._tokens.completion_token
        out["tokens"].append(name(token_id))
        out["text_offset"].append(at)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            return
        out["token_logprobs"].append(lp.logprob)
        top = {name(t): v for t, v in lp.top}
        top.setdefault(name(token_id), lp.logprob)
        out["top_logprobs"].append(top)


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The parts of a completions ``logprobs`` as one object (a non-streamed choice)."""
    out = CompletionLogprobs._empty()
    for part in parts:
        for key, values in out.items():
            values.extend(part[key])
    return out


class ChoiceLogprobs:
    """What one choice's chunks (or body) carry as ``logprobs``, in its endpoint's shape.

    ``echo_len`` is the length of the echoed prompt that leads a completions
    choice's text (0 without ``echo``).
    """

    def __init__(self, chat: bool, tokens: TokenBytes, echo_len: int = 0) -> None:
        self._chat = chat
        self._tokens = tokens
        self._completion = CompletionLogprobs(tokens, echo_len)
        self._parts: list[dict[str, Any]] = []

    def prompt(
        self, prompt_ids: Sequence[int], logprobs: PromptLogprobs | None, offsets: Sequence[int]
    ) -> dict[str, Any]:
        """The echoed prompt's logprobs (completions only), leading :meth:`whole`."""
        part = self._completion.prompt(prompt_ids, logprobs, offsets)
        self._parts.insert(0, part)
        return part

    def batch(self, logprobs: Sequence[TokenLogprob], starts: Sequence[int]) -> dict[str, Any]:
        """The logprobs of a batch of output tokens (their text starting at ``starts`` in the
        output), also kept for :meth:`whole`."""
        part = (
            chat_logprobs(self._tokens, logprobs) if self._chat
            else self._completion.output(logprobs, starts)
        )
        self._parts.append(part)
        return part

    def whole(self) -> dict[str, Any]:
        """Every batch so far as one object: a non-streamed choice's ``logprobs``."""
        if self._chat:
            content = [e for part in self._parts for e in part["content"]]
            return {"content": content, "refusal": None}
        return merge(self._parts)
