"""Which token ids a simulated model may emit so its output decodes to valid text.

Sampling any ordinary id of a byte-level BPE vocabulary emits stray byte
fragments that are not UTF-8, so the frontend would show U+FFFD where a real
model never does. A :class:`TextVocab` keeps the "clean" ids (those that
decode on their own without U+FFFD) plus "units": the id sequences that spell
a multi-byte character the tokenizer splits over several tokens. Streams then
still carry characters split across tokens, which the frontend's incremental
detokenizer must reassemble, but never broken ones.

Clean ids are still mostly fragments ("ation", a lone "\t", a control
byte), so a vocabulary also names its "words": the clean ids that spell a
space and a common English word (" router", from :data:`WORDS`: a token
alone cannot tell " calcul" from " cache"). A model samples those when there
are enough of them, so a demo prints readable (if aimless) text.

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

_COMMON_WORDS = """
    about across after again all almost along already also always an and animals another
    answer any apples are around as ask asleep at autumn away back band be because become
    before begins best better between big birds blue boats book box bread bridge bright
    bring build but by cache can cards carry cat cells change check children choose city
    clean clear client close cold colour come common could count cross cut dark dawn day
    deep do document dog door down draw each early earth east easy eat end energy engine
    evening every everyone far fast feathers few field fill find fine finish fire first
    fish five for forest forget found four fox friend from full garden gather give go
    good grass great green grey grow half hand harbour have heat heavy help here high hill
    hold home honey how however idea in into is island it its just keep kind know lake
    land large last later learn leaves left lemon light like line list listen little live
    long look low make many map market matter may me measure model moon more morning most
    mountain move much music must my name narrow near need never new next night north not
    nothing now number of often old on once one only open or order other our out over own
    pack paper part people pick piece place plain plan plant play point quick quickly
    quiet rain rare rather read ready red request rest return right rise river road rock
    roof room round router run salt same say sea season see send set several shape share
    short should side sign simple simply sing single small smell smoke snow so soft some
    something soon south speak split spoon spring stand star start state step still stone
    stop store story stream string study such summer sun table take talk tell test text
    than thank that the their them then there these they thing this those three through
    time to today together token too top total tree true turn two under until up us use
    valley village visit voice wait walk want warm was watch water way we weather well
    went west what when where which while white who whole why wide wind window winter with
    wood word work world would year yellow yes you young your
"""
WORDS: frozenset[str] = frozenset(_COMMON_WORDS.split())
"""Common English words: a vocabulary's ids that spell one of them after a space are
the words a simulated model says (the demo tokenizer has a few hundred)."""

MIN_WORDS = 64
"""Fewer word ids than this (a tokenizer in another language, or one that decodes
ids without their space) and the model samples every clean id instead."""


@dataclasses.dataclass(frozen=True, slots=True)
class TextVocab:
    """Clean ids to sample, whole words among them, and units that spell whole characters.

    Build it with :meth:`from_tokenizer` or :meth:`from_model_dir`; the
    constructor validates that units cannot overlap, which is what makes the
    longest-match rule always finish the unit it started.
    """

    clean_ids: tuple[int, ...]
    units: tuple[tuple[int, ...], ...] = ()
    words: tuple[int, ...] = ()  # clean ids spelling " word"; empty: sample every clean id
    continuations: Mapping[tuple[int, ...], tuple[int, ...]] = dataclasses.field(
        init=False, repr=False, compare=False
    )
    starts: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    window: int = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        clean = set(self.clean_ids)
        if not clean.issuperset(self.words):
            raise ValueError("every word must be a clean id")
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

    @property
    def ordinary_ids(self) -> tuple[int, ...]:
        """What a model samples outside units: the words, or every clean id without them."""
        return self.words or self.clean_ids

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
        words = tuple(i for i in self.words if allowed(i))
        if clean == self.clean_ids and units == self.units and words == self.words:
            return self
        return TextVocab(clean, units, words if len(words) >= MIN_WORDS else ())

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
        unit are dropped, so units never overlap. A clean id is a word when it
        decodes to a space and one of :data:`WORDS` (kept if there are
        :data:`MIN_WORDS` of them).
        """
        special = set(special_ids)
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        clean = tuple(
            i for i, text in enumerate(texts) if i not in special and _REPLACEMENT not in text
        )
        clean_set = set(clean)
        words = tuple(i for i in clean if texts[i][:1] == " " and texts[i][1:] in WORDS)
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
        return cls(clean, tuple(units), words if len(words) >= MIN_WORDS else ())

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
