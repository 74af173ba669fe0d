"""Which token ids a simulated model may emit so its output decodes to valid text.

Sampling any ordinary id of a byte-level BPE vocabulary emits stray byte
fragments that are not UTF-8, so the frontend would show U+FFFD where a real
model never does. A :class:`TextVocab` keeps the "clean" ids (those that
decode on their own without U+FFFD) plus "units": the id sequences that spell
a multi-byte character the tokenizer splits over several tokens. Streams then
still carry characters split across tokens, which the frontend's incremental
detokenizer must reassemble, but never broken ones.

The model stays a pure function of the token prefix: once a prefix ends
inside a unit (its longest suffix that is a proper prefix of a unit), the next
token continues that unit. Looking at the last ``window`` tokens is enough,
so each step stays O(1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"

UNIT_CHARACTERS: tuple[str, ...] = (
    *"éèñüöäçáàøåßłśžčěřő",  # Latin with diacritics
    *"ёжλΩπ",  # Cyrillic, Greek
    *"中文日本语字你好東京한글",  # CJK, Hangul
    *"€£¥₹—…→≈≠∞✓",  # symbols, punctuation
    *"🙂🚀😀🎉🤖🦜🧬🪐👍",  # emoji (4-byte)
)
"""Characters whose tokenization becomes a unit when it takes two or more ids."""


@dataclasses.dataclass(frozen=True, slots=True)
class TextVocab:
    """Clean ids to sample, and multi-token units that spell whole characters.

    Build it with :meth:`from_tokenizer` or :meth:`from_model_dir`; the
    constructor validates that units cannot overlap, which is what makes the
    longest-match rule always finish the unit it started.
    """

    clean_ids: tuple[int, ...]
    units: tuple[tuple[int, ...], ...] = ()
    continuations: Mapping[tuple[int, ...], tuple[int, ...]] = dataclasses.field(
        init=False, repr=False, compare=False
    )
    starts: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    window: int = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        clean = set(self.clean_ids)
        starts = {unit[0] for unit in self.units}
        for unit in self.units:
            if len(unit) < 2:
                raise ValueError(f"unit {unit} is a single token")
            if clean.intersection(unit):
                raise ValueError(f"unit {unit} contains a clean token")
            if starts.intersection(unit[1:]):
                raise ValueError(f"unit {unit} has an inner token that starts a unit")
        continuations: dict[tuple[int, ...], set[int]] = {}
        complete = set(self.units)
        for unit in self.units:
            for length in range(1, len(unit)):
                prefix = unit[:length]
                if prefix in complete:
                    raise ValueError(f"unit {prefix} is a prefix of unit {unit}")
                continuations.setdefault(prefix, set()).add(unit[length])
        frozen = {prefix: tuple(sorted(nexts)) for prefix, nexts in continuations.items()}
        object.__setattr__(self, "continuations", frozen)
        object.__setattr__(self, "starts", tuple(sorted(starts)))
        object.__setattr__(self, "window", max((len(u) for u in self.units), default=1) - 1)

    def continuation(self, tail: Sequence[int]) -> tuple[int, ...] | None:
        """The ids that may follow a prefix ending in ``tail``, if it ends inside a unit.

        ``tail`` holds the prefix's last :attr:`window` ids (or all of them
        when shorter); the longest suffix that is a unit's proper prefix wins.
        """
        continuations = self.continuations
        for length in range(min(self.window, len(tail)), 0, -1):
            nexts = continuations.get(tuple(tail[len(tail) - length :]))
            if nexts is not None:
                return nexts
        return None

    def within(self, vocab_size: int, excluded: Collection[int]) -> TextVocab:
        """This vocabulary without ids at or above ``vocab_size`` or in ``excluded``."""

        def allowed(token_id: int) -> bool:
            return token_id < vocab_size and token_id not in excluded

        clean = tuple(i for i in self.clean_ids if allowed(i))
        units = tuple(u for u in self.units if all(allowed(i) for i in u))
        if clean == self.clean_ids and units == self.units:
            return self
        return TextVocab(clean, units)

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Tokenizer,
        *,
        special_ids: Iterable[int] = (),
        characters: Iterable[str] = UNIT_CHARACTERS,
    ) -> TextVocab:
        """Classify every id of ``tokenizer`` by decoding it alone.

        A character becomes a unit when it encodes to 2+ ids that decode back
        to it and are none of them clean; units whose inner ids start another
        unit are dropped, so units never overlap.
        """
        special = set(special_ids)
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        clean = tuple(
            i for i, text in enumerate(texts) if i not in special and _REPLACEMENT not in text
        )
        clean_set = set(clean)
        candidates: dict[tuple[int, ...], None] = {}  # ordered and deduplicated
        for character in characters:
            ids = tuple(tokenizer.encode(character, add_special_tokens=False).ids)
            if (
                len(ids) >= 2
                and tokenizer.decode(list(ids), skip_special_tokens=False) == character
                and not clean_set.intersection(ids)
                and not special.intersection(ids)
            ):
                candidates[ids] = None
        units = list(candidates)
        starts = {unit[0] for unit in units}
        units = [u for u in units if not starts.intersection(u[1:])]
        complete = set(units)
        units = [u for u in units if not any(u[:k] in complete for k in range(1, len(u)))]
        return cls(clean, tuple(units))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, special_ids: Iterable[int] = ()) -> TextVocab:
        """The text vocabulary of a HF tokenizer directory (cached per file version)."""
        path = (Path(model_dir) / "tokenizer.json").resolve()
        stat = path.stat()
        return _cached(str(path), stat.st_mtime_ns, stat.st_size, frozenset(special_ids))


@functools.lru_cache(maxsize=8)
def _cached(path: str, mtime_ns: int, size: int, special_ids: frozenset[int]) -> TextVocab:
    # Decoding a 150k vocabulary id by id takes a while; fleets build many engines.
    del mtime_ns, size  # only part of the cache key
    return TextVocab.from_tokenizer(Tokenizer.from_file(path), special_ids=special_ids)
