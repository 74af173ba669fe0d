"""A reply's reasoning budget: where its reasoning block is closed for it (sans-IO).

A chat reply that has spent its ``thinking_token_budget`` inside its
reasoning block gets the block's closing marker as if the model had written
it, and goes on from there as a continuation (the engine the policy picks
holds its prefix): the same on every engine kind, none of whose contracts
carries a thinking budget. The budget is kept by watching the output as it
comes: a batch that crosses it is cut exactly there, and the rest of it is
held until the parser has read everything before (:meth:`ThinkingBudget.due`):
dropped when the block is closed there, taken next when no block is open.
"""

from __future__ import annotations

import msgspec

from direct_frontend.engines.neutral import EngineEvent, TokenDelta
from direct_frontend.pipeline.parsing import ChoiceOutputParser, open_reasoning_close


class ThinkingBudget:
    """The reasoning tokens a reply may spend, and the output held past them."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        #: the output tokens the reply may reach inside its reasoning block (None: done with)
        self.limit: int | None = limit
        #: the rest of a batch past the budget, taken next unless the block is closed there
        self.held: EngineEvent | None = None

    def cut(self, event: EngineEvent, produced: int, merged: int) -> EngineEvent:
        """``event`` up to the budget; the rest of it is :attr:`held`.

        ``produced``: the output's tokens before this batch; ``merged``: the
        batch's tokens before ``event``.
        """
        assert self.limit is not None
        room = self.limit - produced - merged
        ids = event.token_ids
        if room >= len(ids) or room < 0 or (room == 0 and not merged):
            return event  # within it; or a batch that starts at it (a budget of 0) is taken
        self.held = msgspec.structs.replace(event, token_ids=ids[room:],
                                        logprobs=event.logprobs[room:])
        return TokenDelta(ids[:room], event.prompt_tokens, event.completion_tokens,
                          event.cached_tokens, event.logprobs[:room], event.prompt_logprobs)

    def release(self) -> EngineEvent | None:
        """The output held past the budget, to be taken now (None: none)."""
        held, self.held = self.held, None
        return held

    def due(self, produced: int, parser: ChoiceOutputParser) -> str | None:
        """The marker that closes the reasoning block, once the reply (``produced`` tokens,
        every one read by ``parser``) has spent the budget inside it; None until then.

        At the budget with no block open (it closed already, or never opened)
        the budget is done with, and the output held past it goes on.
        """
        limit = self.limit
        if limit is None or produced < limit:
            return None
        marker = open_reasoning_close(parser)
        if marker is None:
            self.limit = None
        else:
            self.held = None  # past the budget: not the reply's
        return marker

    def closed(self) -> None:
        """The block is closed: the budget is spent, once."""
        self.limit = None

    def drop(self) -> None:
        """The engine failed: the one that takes over generates the held output again."""
        self.held = None
