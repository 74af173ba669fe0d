"""A conversation's next turn renders its new messages only: the earlier ones' part of the
prompt is taken from the last turn's render.

Where the chat template's per-message pieces depend on their message, position
and the messages they read alone (text/template_split.py proves it from the
template's syntax), the prompt of ``messages`` is ``head + loop(0, n) +
tail``, and ``loop(0, n)`` is ``loop(0, k) + loop(k, n)`` for any ``k`` (with
the last piece rendered as the last). :class:`TurnCache` keeps, per
conversation, the loop's output over its messages but the last (each rendered
as not last) and the messages it was made from: those, and the next ones its
pieces read (a tool result's piece reading the message after it, say). A
request that begins with a kept entry's messages (and whose tools, template
variables and generation-prompt flag are the same) renders ``head``, the
messages after the kept pieces and ``tail`` only; pieces that read the
messages otherwise (their number, from their end) are not kept. The messages
are compared by value (each a frozen struct, compared in C), so the text is
exactly the whole render's; a failure renders the whole, which says what fails.

Sans-IO; one cache per served model, read and written on the event loop only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Final

import msgspec

from direct_frontend.openai.types import ChatMessage
from direct_frontend.pipeline.grouped_lru import GroupedLru
from direct_frontend.text.model_dir import TextModel
from direct_frontend.text.template_split import SplitTemplate

#: the cache's budget (each entry counted as twice its text: the text, and its messages)
MAX_BYTES = 32 << 20
#: entries kept per first two messages
PER_KEY = 8
#: the characters of each of the first two messages' text that entries are found by
KEY_CHARS = 1024

View = dict[str, object]
#: what decides a render besides the messages: the split template, the tools' declarations and
#: the template variables (as JSON: ``1 == 1.0 == True`` in Python, not in a template's
#: output), the generation-prompt flag
Setting = tuple[SplitTemplate, bytes, bool]
#: what entries are found by (:func:`_key`)
Key = tuple[tuple[str, str], ...]


@dataclasses.dataclass(eq=False, slots=True)
class Turns:
    """The loop's output over a conversation's first ``count`` messages (none of them its
    last), their template views, and the first messages it was read from (those and
    the next ones its iterations read)."""

    setting: Setting
    messages: tuple[ChatMessage, ...]
    count: int
    views: list[View]
    #: the loop's output, in the pieces successive turns rendered (joined once, in the prompt)
    pieces: tuple[str, ...]
    #: their length in all
    chars: int
    #: the template's output before and after its loop, for this conversation's variables
    head: str
    tail: str

    @property
    def cost(self) -> int:
        return 2 * self.chars + 64 * len(self.messages)


class TurnCache(GroupedLru[Key, Turns]):
    """The loop's output over conversations' earlier messages, found by their first two
    messages' starts (:data:`KEY_CHARS` of each: many conversations share a system prompt,
    few their first request too); at most :data:`MAX_BYTES`, the least recently used
    leaving first."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        super().__init__(max_bytes, PER_KEY)

    def find(self, setting: Setting, messages: Sequence[ChatMessage]) -> Turns | None:
        """The kept entry of ``setting`` with the most of ``messages``' first messages (not
        all: the last is rendered as the last), or None."""
        best: Turns | None = None
        for entry in (*self.group(_key(messages[:2])),
                      *self.group(_key(messages[:1]))):
            read = len(entry.messages)
            if (entry.count < len(messages) and read <= len(messages)
                    and (best is None or entry.count > best.count)
                    and entry.setting == setting and entry.messages == messages[:read]):
                best = entry
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.touch(best)
        return best

    def put(self, entry: Turns, replaces: Turns | None = None) -> None:
        """Keep ``entry``; ``replaces`` (an entry it goes on from) leaves."""
        if replaces is not None:
            self.drop(replaces)
        if entry.messages and entry.cost <= self.max_bytes:
            self.keep(_key(entry.messages[:2]), entry)


def _key(first: Sequence[ChatMessage]) -> Key:
    """What entries are found by: the role and the start of the text of their first
    messages (hashing more costs, finds no more; :meth:`TurnCache.find` compares all)."""
    return tuple((m.role, (m.content or "")[:KEY_CHARS]) for m in first)


_ENCODE: Final = msgspec.json.Encoder().encode


def render_turns(cache: TurnCache, model: TextModel, split: SplitTemplate,
                 messages: Sequence[ChatMessage], view: Callable[[ChatMessage], View],
                 tools: list[View] | None, tools_key: object, extra: dict[str, object] | None,
                 add_generation_prompt: bool) -> str:
    """The prompt ``model.render_chat`` gives ``messages`` (``view`` makes a message's template
    view), rendering only the messages after the longest run of first ones kept in
    ``cache``, which keeps this conversation's for its next turn; a template's failure is
    a ``ChatTemplateError``. ``tools_key``: what decides ``tools`` (compared as JSON)."""
    try:
        exact = _ENCODE((tools_key, extra))
    except (TypeError, ValueError):  # (not JSON: no reuse)
        return model.render_chat([view(m) for m in messages],
                                 add_generation_prompt=add_generation_prompt, tools=tools,
                                 extra=extra)
    setting: Setting = (split, exact, add_generation_prompt)
    earlier = cache.find(setting, messages)
    k = 0 if earlier is None else earlier.count
    n = len(messages)
    fresh = [view(m) for m in messages[k:]]
    views = fresh if earlier is None else earlier.views + fresh
    variables = model.template_variables(views, add_generation_prompt, tools, extra)
    try:
        if earlier is None or not split.edges_by_first:
            head, tail = split.head.render(variables), split.tail.render(variables)
        else:  # (the same first message and variables)
            head, tail = earlier.head, earlier.tail
        middle, reach = (split.render_loop(variables, views, k, n - 1, False) if n - 1 > k
                         else ("", -1))
        end, _ = split.render_loop(variables, views, n - 1, n, True)
    except Exception:  # (the whole render says what fails, and how)
        return model.render_chat(views, add_generation_prompt=add_generation_prompt,
                                 tools=tools, extra=extra)
    done = ((middle,) if earlier is None else (*earlier.pieces, middle) if middle
            else earlier.pieces)  # (the same conversation again adds no piece)
    if reach is not None:  # (else what it rendered read more than the messages before)
        read = max(n - 1, reach + 1, 0 if earlier is None else len(earlier.messages))
        chars = len(middle) + (0 if earlier is None else earlier.chars)
        cache.put(Turns(setting, tuple(messages[:read]), n - 1, views[:n - 1], done, chars,
                        head, tail), earlier)
    return "".join((head, *done, end, tail))
