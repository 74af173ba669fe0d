"""Prompt caches: an exact one (a request's prompt → its rendered text and token ids), and
one of rendered chats by their prefix (:class:`PrefixCache`: a conversation's next turn
tokenizes only what is new).

Rendering a chat template and tokenizing its text cost a few hundred µs for
a short chat (the demo model: ≈ 0.1 ms to render, ≈ 0.25 ms to tokenize 200
characters), paid again for every identical request: benchmarks, retries,
agents resending one conversation, the prompts of ``n`` choices. The cache
keys on what decides the prompt (the messages, tools and template variables,
or the completion's prompt text) and holds at most :data:`MAX_BYTES` of
entries, the least recently used leaving first; a prompt longer than
:data:`MAX_ENTRY_CHARS` is not kept. Templates that read the clock are never
cached (their render changes by itself).

Sans-IO: plain data in and out, one cache per served model.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from direct_frontend.pipeline.grouped_lru import GroupedLru
from direct_frontend.text.prompt_ids import PromptIds

#: the cache's budget: key, text and ids counted (PromptIds at ~10 bytes an id: 4 as u32 and a
#: share of their hash chains; other ids at ~36: a tuple slot and an int)
MAX_BYTES = 16 << 20
#: longer prompts are not kept (they are rarely repeated exactly, and would crowd out the rest)
MAX_ENTRY_CHARS = 32 << 10
_BYTES_PER_ID = 10
_BYTES_PER_INT = 36

Entry = tuple[str, Sequence[int]]


class PromptCache:
    """LRU map of a prompt key to its rendered text and token ids, bounded in bytes."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_entry_chars: int = MAX_ENTRY_CHARS) -> None:
        self.max_bytes = max_bytes
        self.max_entry_chars = max_entry_chars
        self.size = 0  # bytes held, as counted by _cost
        self.hits = 0
        self.misses = 0
        self._entries: collections.OrderedDict[bytes | str, Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes | str) -> Entry | None:
        """The entry for ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes | str, text: str, ids: Sequence[int]) -> None:
        """Keep ``key``'s entry, unless it is too long or empty (a refused prompt); the oldest
        leave to make room."""
        if not ids or len(text) > self.max_entry_chars or len(key) > 2 * self.max_entry_chars:
            return
        cost = _cost(key, text, ids)
        if cost > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.size -= _cost(key, *old)
        self._entries[key] = (text, ids)
        self.size += cost
        while self.size > self.max_bytes:
            oldest, entry = self._entries.popitem(last=False)
            self.size -= _cost(oldest, *entry)


def _cost(key: bytes | str, text: str, ids: Sequence[int]) -> int:
    per_id = _BYTES_PER_ID if isinstance(ids, PromptIds) else _BYTES_PER_INT
    return len(key) + len(text) + per_id * len(ids)


#: the prefix cache's budget (text, ids and cuts counted; ids at ~13 bytes: u32, hashes, encoding)
PREFIX_MAX_BYTES = 64 << 20
#: longer prompts are not kept for their prefix
PREFIX_MAX_ENTRY_BYTES = 16 << 20
#: prompts kept per first piece (a system prompt many conversations share)
PREFIX_PER_KEY = 8
#: an id's share of a kept prompt: its 4 bytes, its share of the hash chains (an 8-byte slot
#: and a 36-byte int a block, two block sizes of 16), and of the encoding kept for the next
#: turn's engine request (3 bytes for ids below 2**21)
_PREFIX_BYTES_PER_ID = 13
#: a prompt's key is at most this much of its first piece (hashing more costs, finds no more)
HEAD_CHARS = 1024


@dataclasses.dataclass(eq=False, slots=True)
class Rendered:
    """A rendered chat prompt, its ids, and where its added tokens start (its cuts).

    ``counts[i]`` ids make ``text[:cuts[i]]``: the tokenizer splits at every cut
    before anything else (text/encoder.py), so the ids of a prefix that ends at
    a cut are the leading ids of the whole.
    """

    text: str
    ids: PromptIds
    cuts: list[int]
    counts: list[int]

    @property
    def cost(self) -> int:
        return len(self.text) + _PREFIX_BYTES_PER_ID * len(self.ids) + 16 * len(self.cuts)


@dataclasses.dataclass(frozen=True, slots=True)
class Reuse:
    """What a new prompt can take from a kept one: its first ``tokens`` ids (up to ``cut``)."""

    entry: Rendered
    cut: int
    tokens: int


class PrefixCache(GroupedLru[str, Rendered]):
    """Rendered chat prompts kept for the prefix the next turn of their conversation shares.

    A conversation's next request renders to the last one's text plus what is
    new, or, with a template that renders earlier turns differently once a
    turn follows (dropping their reasoning, say), to a shorter common prefix.
    :meth:`find` gives the longest prefix of a new prompt that a kept one shares
    and that ends at a cut of both, with its ids; only the rest is tokenized.
    Prompts are found by their first piece (up to the second cut: the system
    prompt, typically), the most recent first; at most :data:`PREFIX_MAX_BYTES`
    are kept, the least recently used leaving first. Sans-IO; the daemon reads
    and writes it on its event loop only.
    """

    def __init__(self, max_bytes: int = PREFIX_MAX_BYTES,
                 max_entry_bytes: int = PREFIX_MAX_ENTRY_BYTES) -> None:
        super().__init__(max_bytes, PREFIX_PER_KEY)
        self.max_entry_bytes = max_entry_bytes
        self.reused_tokens = 0
        #: the last :meth:`extended_by`'s text (that very object) and the kept prompt it
        #: begins with: :meth:`find` of that text takes the match as proven (both are
        #: immutable) instead of comparing the whole prefix again; held until the next
        #: :meth:`find` or :meth:`extended_by` (one prompt at most, outside the budget)
        self._proven: tuple[str, Rendered] | None = None

    def find(self, text: str, cuts: Sequence[int]) -> Reuse | None:
        """The kept prompt sharing the longest prefix with ``text`` (whose cuts are
        ``cuts``) that ends at a cut of both; None if none shares a whole piece."""
        proven, self._proven = self._proven, None
        head = _head(text, cuts)
        found = None if head is None else self.group(head)
        if not found:
            self.misses += 1
            return None
        whole = proven[1] if proven is not None and proven[0] is text else None
        at = set(cuts)
        best: Reuse | None = None
        for entry in reversed(found):
            reuse = _shared(text, at, entry, entry is whole)
            if reuse is not None and (best is None or reuse.tokens > best.tokens):
                best = reuse
        if best is None:
            self.misses += 1
            return None
        self.touch(best.entry)
        self.hits += 1
        self.reused_tokens += best.tokens
        return best

    def extended_by(self, text: str, early: Sequence[int]) -> Rendered | None:
        """The longest kept prompt that ``text`` begins with, among those of its first
        piece; ``early``: ``text``'s cuts up to :data:`HEAD_CHARS` at least (which
        give that piece). A look-up only: no hit or miss is counted; the next
        :meth:`find` of ``text`` takes the match as proven."""
        head = _head(text, [*early[:1], HEAD_CHARS] if len(early) < 2 else early)
        best: Rendered | None = None
        for entry in self.group(head or ""):
            if (best is None or len(entry.text) > len(best.text)) and text.startswith(entry.text):
                best = entry
        self._proven = None if best is None else (text, best)
        return best

    def put(self, entry: Rendered, replaces: Rendered | None = None) -> None:
        """Keep ``entry``; ``replaces``, a kept prompt that is a prefix of it, leaves (its
        every cut is ``entry``'s too)."""
        head = _head(entry.text, entry.cuts)
        cost = entry.cost
        if head is None or cost > self.max_entry_bytes:
            return
        if replaces is not None and entry.text.startswith(replaces.text):
            self.drop(replaces)
        self.keep(head, entry)


def _head(text: str, cuts: Sequence[int]) -> str | None:
    """The first piece of a prompt (up to its second cut; its first if it starts with text),
    at most :data:`HEAD_CHARS` of it: the key prompts are found by (:func:`_shared` checks
    the rest)."""
    ends = [c for c in cuts[:2] if c > 0]
    return text[: min(ends[0], HEAD_CHARS)] if ends else None


def _shared(text: str, at: set[int], entry: Rendered, whole: bool = False) -> Reuse | None:
    """The longest prefix of ``text`` that ``entry`` shares, ending at a cut of both;
    ``whole``: ``text`` is known to begin with ``entry``'s text."""
    cuts, counts = entry.cuts, entry.counts
    if whole or text.startswith(entry.text):
        if len(entry.text) in at:
            return Reuse(entry, len(entry.text), len(entry.ids))
        high = len(cuts)  # every cut is shared
    else:  # the first cut whose prefix differs: prefixes only differ more further on
        low, high = 0, len(cuts)
        while low < high:
            middle = (low + high) // 2
            if text.startswith(entry.text[: cuts[middle]]):
                low = middle + 1
            else:
                high = middle
    for i in range(high - 1, -1, -1):
        if cuts[i] in at and counts[i]:
            return Reuse(entry, cuts[i], counts[i])
    return None
