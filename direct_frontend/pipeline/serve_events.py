"""What the request stair tells its writer before and beside the relay's output: typed values.

A generation request's writer gets, in this order, each at most once:
:class:`Resolved` (its model is known), :class:`Prepared` (its prompts are
tokenized: the request as its model serves it), :class:`Charged` (it is
counted against its tenant's rate limits), :class:`Admitted` (it holds its
admission slots; nothing has reached an engine yet) and :class:`Placed`
(its engines are chosen), followed by the relay's events
(:mod:`~direct_frontend.pipeline.relay_events`). A background request's
stair stops after :class:`Charged` and hands back the rest of it, which
later runs into another writer from :class:`Admitted` on. An
embeddings request gets :class:`Resolved`, :class:`Charged`,
:class:`Admitted` and then :class:`Embedded`. A refusal on the way is raised
to the stair's caller (an ``OpenAIHTTPError``, or a
:class:`~direct_frontend.pipeline.ratelimit.RateLimited`), never sent as an
event.

Several choices' events come with the choice's index (the writer's second
argument); a lone choice's index is 0.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

import msgspec

from direct_frontend.observability.metrics import ModelSeries
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.ratelimit import Standing
from direct_frontend.pipeline.relay_events import Batch, Failed, Finished, Opened
from direct_frontend.text.token_bytes import TokenBytes


class Resolved(msgspec.Struct, frozen=True):
    """The request's model: its name (as the fleet file names it) and its metric series."""

    model: str
    series: ModelSeries


class Prepared(msgspec.Struct, frozen=True):
    """The request's prompts are tokenized: the request as its model serves it (its sampling
    defaults filled in; a Responses chat truncated to fit), and what its output's writer
    needs to know."""

    request: ChatRequest | CompletionRequest
    request_id: str
    prompt_tokens: tuple[int, ...]  # each prompt's (a completions batch has several)
    token_bytes: TokenBytes  # the model's tokens as bytes (logprobs are written with them)


class Charged(msgspec.Struct, frozen=True):
    """The request is counted against its tenant's rate limits: the limits just after it was
    taken (None: its tenant has none). Every answer from here on says them."""

    standing: Standing | None


class Admitted(msgspec.Struct, frozen=True):
    """The request holds its admission slots; nothing has reached an engine yet."""


class Placed(msgspec.Struct, frozen=True):
    """The request's engines are chosen; its output comes next."""

    prompt_tokens: int  # all its prompts'


class Embedded(msgspec.Struct, frozen=True):
    """An embeddings request's vectors, in input order, and the prompt tokens they took."""

    vectors: list[Sequence[float]]
    prompt_tokens: int


#: the instance every admitted request's writer gets (it carries nothing)
ADMITTED = Admitted()

StairEvent = (Resolved | Prepared | Charged | Admitted | Placed | Embedded
              | Opened | Batch | Finished | Failed)


class Sink(Protocol):
    """The writer of one request's events (``index``: the choice's, among several)."""

    def __call__(self, event: StairEvent, index: int = 0) -> Awaitable[None]: ...
