"""An exact cache of prompts: a request's prompt → its rendered text and token ids.

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

#: the cache's budget: key, text and ids counted (ids at ~36 bytes each: a tuple slot + an int)
MAX_BYTES = 16 << 20
#: longer prompts are not kept (they are rarely repeated exactly, and would crowd out the rest)
MAX_ENTRY_CHARS = 32 << 10
_BYTES_PER_ID = 36

Entry = tuple[str, tuple[int, ...]]


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

    def put(self, key: bytes | str, text: str, ids: tuple[int, ...]) -> None:
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


def _cost(key: bytes | str, text: str, ids: tuple[int, ...]) -> int:
    return len(key) + len(text) + _BYTES_PER_ID * len(ids)
