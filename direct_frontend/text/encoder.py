"""Token ids of a text exactly as the model's ``tokenizers`` Tokenizer makes them, fast.

``fastokens`` (a Rust BPE that reads the same ``tokenizer.json``) encodes the
pipelines it supports tens of times faster than ``tokenizers`` (demo model,
18k tokens: ≈ 0.2 ms against ≈ 13 ms of CPU). It is used only when it loads the
file and agrees with ``tokenizers`` on every probe text (:data:`PROBES`, the
model's added tokens, and whatever the caller adds, such as a rendered chat);
otherwise ``tokenizers`` encodes, as it always decodes.

Both libraries release the GIL inside their batch calls (fastokens' ``encode_batch`` and
``encode_batch_flat`` for the tokenizing, not for making the ids' lists;
``encode_batch_fast``), which is what :meth:`Encoder.encode_batch` and
:meth:`Encoder.encode_batch_raw` call, from a worker thread where the text is large;
:meth:`Encoder.encode` holds the GIL and is for short texts.

:meth:`Encoder.boundaries` finds where the tokenizer's added tokens start (the
ones matched on the raw text, before normalizing: chat templates' special
tokens). The tokenizer splits the text there before anything else, so the ids
of a text are the ids of its pieces between such boundaries, end to end: what
lets a conversation's next turn reuse the ids of the prefix it shares with the
last one (pipeline/prompt_cache.py). Tokenizers where that does not hold (an
added token that takes the whitespace before it, or matches whole words only,
or BPE dropout) have no boundaries (None).
"""

from __future__ import annotations

import array
import bisect
import itertools
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer

from direct_frontend.text.prompt_ids import u32_bytes, u32_ids

log = logging.getLogger(__name__)

#: texts both encoders must agree on before the fast one is trusted (with the added tokens)
PROBES: tuple[str, ...] = (
    "",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.\n\nA second paragraph, indented:\n    code",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows line ends\r\n\n\n   \n",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 2024-05-17 09:30:00",
    "it's don't we'll they've I'm you'd SHE'S",
    "def f(x: int) -> list[int]:\n    return [x ** 2 for x in range(10)]  # squares\n",
    '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1}',
    "Café naïve résumé Straße Москва Ελλάδα 日本語の文章 中文 한국어 😀 👍🏽 🦜 ∑ ≈ €",
    "a" * 300 + " " + "b" * 300,
    "!!!???... ---- ==== **** #### @@@@ $$$$ %%%% ^^^^ &&&& (((( )))) [[[[ ]]]]",
    "\u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom",
)


class _Fast(Protocol):
    def encode(self, input: str, add_special_tokens: bool = ...) -> Any: ...
    def encode_batch(self, inputs: list[str], add_special_tokens: bool = ...) -> list[Any]: ...
    def encode_batch_flat(self, inputs: list[str], add_special_tokens: bool = ...
                          ) -> tuple[bytes, bytes]: ...


#: fastokens' BPE worker threads: one. Requests are prepared side by side already (one worker
#: thread per core); its own pool would add ≈ 16 MiB of caches per core and no CPU saved.
BPE_THREADS = "1"


def _load_fast(spec_text: str) -> _Fast | None:
    """fastokens over the same tokenizer.json, or None if it is not installed or refuses it."""
    os.environ.setdefault("FASTOKENS_BPE_THREADS", BPE_THREADS)  # read when its pool starts
    try:
        import fastokens
    except ImportError:
        return None
    try:
        fast = fastokens.Tokenizer.from_json_str(spec_text)
        fast.no_truncation()
        fast.no_padding()
    except (ValueError, RuntimeError, OSError) as exc:
        log.info("fastokens does not read this tokenizer (%s); tokenizers encodes", exc)
        return None
    return fast  # type: ignore[no-any-return]


class Encoder:
    """A model's encoder: fastokens when it agrees with tokenizers, else tokenizers."""

    def __init__(self, tokenizer: Tokenizer, spec: Mapping[str, Any], spec_text: str) -> None:
        self._hf = tokenizer
        added = tokenizer.get_added_tokens_decoder().values()
        self._fast = _load_fast(spec_text) if not _has_dropout(spec) else None
        #: which library encodes: ``fastokens`` or ``tokenizers``
        self.engine = "tokenizers"
        if self._fast is not None and self.agrees((*PROBES, *_added_probes(added))):
            self.engine = "fastokens"
        raw = [t for t in added if not t.normalized]
        self._splitter: _Splitter | None = None
        if not _has_dropout(spec) and not any(t.lstrip or t.single_word for t in raw) and raw:
            self._splitter = _Splitter(t.content for t in raw)

    @property
    def fast(self) -> bool:
        return self.engine == "fastokens"

    def agrees(self, texts: Iterable[str]) -> bool:
        """Whether fastokens gives tokenizers' ids for every text (with and without the
        special tokens added); if not, tokenizers encodes from now on."""
        if self._fast is None:
            return False
        texts = list(texts)
        for special in (False, True):
            flat, offsets = self._fast.encode_batch_flat(texts, add_special_tokens=special)
            ids, ends = u32_ids(flat), array.array("Q", offsets)
            want = self._hf.encode_batch_fast(texts, add_special_tokens=special)
            for i, encoding in enumerate(want):
                if ids[ends[i]:ends[i + 1]].tolist() != encoding.ids:
                    log.warning("fastokens disagrees with tokenizers on %r; tokenizers encodes",
                                texts[i][:80])
                    self._fast = None
                    self.engine = "tokenizers"
                    return False
        return True

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of a short text, on the calling thread (holds the GIL throughout)."""
        if self._fast is not None:
            ids: list[int] = self._fast.encode(text, add_special_tokens=add_special_tokens).ids
            return ids
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False
                     ) -> list[list[int]]:
        """The ids of each text, each a new list; the GIL is released while they are made
        (a worker thread's call)."""
        # (Rust makes the ids' lists: twice as fast as ints taken from a flat buffer; each
        # is taken as it is, not copied again)
        batch = self._hf.encode_batch_fast if self._fast is None else self._fast.encode_batch
        return [e.ids for e in batch(list(texts), add_special_tokens=add_special_tokens)]

    def encode_batch_raw(self, texts: Sequence[str], *, add_special_tokens: bool = False
                         ) -> tuple[bytes, list[int]]:
        """The ids of the texts end to end as little-endian u32 bytes, and how many each text
        has; no int is made where fastokens encodes (its flat output). The GIL is released
        while fastokens or tokenizers encode."""
        if self._fast is None:
            made = self._hf.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
            ids: list[int] = []
            counts = []
            for encoding in made:
                one = encoding.ids  # (each read makes a new list)
                ids += one
                counts.append(len(one))
            return u32_bytes(ids), counts
        flat, offsets = self._fast.encode_batch_flat(list(texts),
                                                     add_special_tokens=add_special_tokens)
        ends = array.array("Q", offsets)
        return flat, [b - a for a, b in itertools.pairwise(ends)]

    def boundaries(self, text: str, start: int = 0) -> list[int] | None:
        """Where added tokens start in ``text`` from ``start`` on (the tokenizer's first
        split), ascending; None when this tokenizer's ids do not split there."""
        if self._splitter is None:
            return None
        return self._splitter.starts(text, start)

    def boundaries_after(self, text: str, shared: int, earlier: Sequence[int]
                         ) -> list[int] | None:
        """:meth:`boundaries` of ``text``, given ``earlier``: those of a text its first
        ``shared`` characters are (a conversation's previous prompt); only what
        follows is scanned. None as :meth:`boundaries` gives it."""
        if self._splitter is None:
            return None
        return self._splitter.starts_after(text, shared, earlier)


class _Splitter:
    """Finds the added tokens the way tokenizers' added vocabulary does: leftmost first,
    the longest at a position, the scan going on after the match."""

    def __init__(self, contents: Iterable[str]) -> None:
        ordered = sorted({c for c in contents if c}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(c) for c in ordered))
        self._longest = len(ordered[0]) if ordered else 1
        self._firsts = sorted({c[0] for c in ordered})

    def starts(self, text: str, start: int) -> list[int]:
        candidates: list[int] = []
        for first in self._firsts:
            at = text.find(first, start)
            while at != -1:
                candidates.append(at)
                at = text.find(first, at + 1)
        if len(self._firsts) > 1:
            candidates.sort()
        out: list[int] = []
        free = start  # the scan's position: matches may not overlap
        match = self._pattern.match
        for at in candidates:
            if at < free:
                continue
            found = match(text, at)
            if found is not None:
                out.append(at)
                free = found.end()
        return out

    def starts_after(self, text: str, shared: int, earlier: Sequence[int]) -> list[int]:
        """:meth:`starts` of ``text`` from 0, given ``earlier``, those of ``text[:shared]``.

        Whether an added token matches at a position depends on the text from
        there to the longest token's length only: below ``shared`` less that
        length, the scan of the earlier text found what this one's finds, and it
        goes on from the end of the last match found there.
        """
        safe = max(0, shared - self._longest + 1)
        kept = bisect.bisect_left(earlier, safe)
        out = list(earlier[:kept])
        free = safe
        if out:
            found = self._pattern.match(text, out[-1])
            if found is None:  # (not ``text[:shared]``'s starts: scanned whole)
                return self.starts(text, 0)
            free = max(free, found.end())
        out += self.starts(text, free)
        return out


def _has_dropout(spec: Mapping[str, Any]) -> bool:
    model = spec.get("model")
    return isinstance(model, dict) and bool(model.get("dropout"))


def _added_probes(added: Iterable[Any]) -> list[str]:
    """Each added token alone, between words and doubled: where the matchers must agree."""
    out = []
    for token in added:
        content = token.content
        out += [content, f"say {content} now", f"{content}{content}x", f"\n{content}\n"]
    return out
