"""A fake language model: deterministic tokens, stop criteria and timing, with no I/O.

Every token is a pure function of the token prefix (prompt plus the tokens
generated so far) and the model seed. So a request that carries a prompt plus
the first ``k`` generated tokens continues exactly where the uninterrupted run
would have gone, which is what migration and prefill/decode tests need to prove
the router resumes a stream without losing or repeating text.

The simulator is greedy-deterministic: temperature, top-p and penalties are
accepted by the servers and ignored here. A request's own sampling seed (where
its contract carries one, and it samples: temperature > 0) starts the hash
from a state of its own, so seeded requests are reproducible and differ by
seed (as the choices of one request do), and still resume token-exactly.
"""

from __future__ import annotations

import array
import collections
import dataclasses
from collections.abc import Iterable, Sequence, Set
from typing import Literal

from direct_frontend.simulator.vocab import TextVocab

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Independent salts so the EOS decision and the token choice use unrelated bits.
_SALT_EOS = 0xD1B54A32D192ED03
_SALT_TOKEN = 0x8CB92BA72F3D8DD7
_SALT_UNIT = 0x2545F4914F6CDD1D
_SALT_SEED = 0x4F1BBCDCBFA53E0B
_REDRAWS = 16


def mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap bijection on 64 bits with good avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SimModel:
    """The token distribution: which token follows a given prefix.

    Ordinary tokens are drawn uniformly (by hash) from the ids that are neither
    special nor EOS, so sampled text decodes to words; EOS is chosen with
    ``eos_probability`` per step, also from the prefix hash.

    With a :class:`TextVocab` the ordinary ids are only its whole words (or
    its clean ids, if it has too few words), and with ``unit_probability``
    per step a multi-token character starts instead; a prefix that ends
    inside one is always continued, so output decodes to valid UTF-8 and
    reads as words (see :mod:`direct_frontend.simulator.vocab`).
    """

    def __init__(
        self,
        vocab_size: int,
        eos_token_id: int,
        special_ids: Iterable[int] = frozenset(),
        eos_probability: float = 0.02,
        seed: int = 0,
        text: TextVocab | None = None,
        unit_probability: float = 0.05,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError("vocab_size must be positive")
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary")
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError("eos_probability must be within [0, 1]")
        if not 0.0 <= unit_probability <= 1.0:
            raise ValueError("unit_probability must be within [0, 1]")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.special_ids = frozenset(special_ids)
        self.eos_probability = eos_probability
        self.seed = seed
        excluded = self.special_ids | {eos_token_id}
        self.text = text.within(vocab_size, excluded) if text is not None else None
        ordinary = range(vocab_size) if self.text is None else self.text.ordinary_ids
        # An array keeps a 150k-entry vocabulary at ~1 MB per engine.
        self._candidates = array.array("q", (i for i in ordinary if i not in excluded))
        # How many trailing ids decide whether a prefix ends inside a unit (0: no units).
        self.window = self.text.window if self.text is not None and self.text.units else 0
        self._unit_threshold = int(unit_probability * (1 << 64)) if self.window else 0
        self._unit_starts = self.text.starts if self.text is not None and self.window else ()
        if not self._candidates:
            raise ValueError("the vocabulary has no ordinary (non-special) tokens")
        self._eos_threshold = int(eos_probability * (1 << 64))
        self.initial_state = mix64((seed * _GOLDEN + 0x5851F42D4C957F2D) & _MASK64)

    @staticmethod
    def advance(state: int, token_id: int) -> int:
        """Fold one more token into a prefix hash (O(1), so a sequence is O(n))."""
        return mix64(state ^ (((token_id + 1) * _GOLDEN) & _MASK64))

    def seeded_state(self, sample_seed: int | None) -> int:
        """The state before any token of a request sampled with ``sample_seed`` (None: greedy)."""
        if sample_seed is None:
            return self.initial_state
        return mix64(self.initial_state ^ ((sample_seed * _GOLDEN + _SALT_SEED) & _MASK64))

    def state_of(self, prefix: Iterable[int], sample_seed: int | None = None) -> int:
        """The hash state after ``prefix`` (of a request sampled with ``sample_seed``)."""
        state = self.seeded_state(sample_seed)
        for token_id in prefix:
            state = self.advance(state, token_id)
        return state

    def draw(self, state: int, banned: Set[int] = frozenset(), tail: Sequence[int] = ()) -> int:
        """The token that follows the prefix whose hash is ``state``.

        ``banned`` masks tokens the way an engine masks logits (EOS under
        ``min_tokens`` or ``ignore_eos``): a banned choice is replaced by a
        deterministic redraw among the allowed ordinary tokens. ``tail`` is
        the prefix's last :attr:`window` ids, which decide whether the prefix
        ends inside a multi-token character (only with a :class:`TextVocab`).
        """
        nexts = self.text.continuation(tail) if self.window and self.text is not None else None
        if nexts is not None:
            # Inside a multi-token character: finish it before anything else, even EOS.
            choice = nexts[mix64(state ^ _SALT_UNIT) % len(nexts)]
        elif mix64(state ^ _SALT_EOS) < self._eos_threshold:
            choice = self.eos_token_id
        elif mix64(state ^ _SALT_UNIT) < self._unit_threshold:
            starts = self._unit_starts
            choice = starts[mix64(state ^ _SALT_UNIT ^ _SALT_TOKEN) % len(starts)]
        else:
            choice = self._pick(state, 0)
        if choice not in banned:
            return choice
        # Attempt 0 is the ordinary choice, so a masked EOS becomes the token it displaced.
        for attempt in range(_REDRAWS + 1):
            choice = self._pick(state, attempt)
            if choice not in banned:
                return choice
        # Nearly everything is banned: scan from a hashed start for the first allowed id.
        count = len(self._candidates)
        start = mix64(state ^ _SALT_TOKEN) % count
        for offset in range(count):
            choice = self._candidates[(start + offset) % count]
            if choice not in banned:
                return choice
        return self._candidates[start]  # every ordinary token banned: nothing better to do

    def _pick(self, state: int, attempt: int) -> int:
        mixed = mix64(state ^ ((_SALT_TOKEN + attempt * _GOLDEN) & _MASK64))
        return self._candidates[mixed % len(self._candidates)]

    def next_token(self, prefix: Sequence[int]) -> int:
        """The unmasked next token after ``prefix`` (O(len(prefix)); see :class:`SimSequence`)."""
        tail = prefix[len(prefix) - self.window :] if self.window else ()
        return self.draw(self.state_of(prefix), tail=tail)


class SimSequence:
    """A running prefix hash, so each further token costs O(1)."""

    def __init__(
        self, model: SimModel, prompt_ids: Iterable[int], sample_seed: int | None = None
    ) -> None:
        self.model = model
        ids = prompt_ids if isinstance(prompt_ids, Sequence) else list(prompt_ids)
        self.state = model.state_of(ids, sample_seed)
        # The last few ids: enough to tell whether the prefix ends inside a unit.
        window = model.window
        self._tail: collections.deque[int] = collections.deque(
            ids[len(ids) - window :] if window else (), maxlen=window
        )

    def step(self, banned: Set[int] = frozenset()) -> int:
        """Draw the next token and append it to the prefix."""
        tail = self._tail
        token_id = self.model.draw(self.state, banned, tuple(tail) if tail else ())
        self.state = SimModel.advance(self.state, token_id)
        if self.model.window:
            tail.append(token_id)
        return token_id


@dataclasses.dataclass(frozen=True, slots=True)
class StopCriteria:
    """When a sequence ends, already resolved from the engine's own defaults.

    ``max_tokens`` is the effective cap (request cap clamped to the context
    window). Stop strings are not modelled: the frontend handles them.
    """

    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """Why a sequence ended.

    ``matched_token_id`` is the EOS or stop token that ended it; ``matched_eos``
    tells which, because engines differ in whether they report an EOS match.
    """

    reason: Literal["stop", "length"]
    matched_token_id: int | None = None
    matched_eos: bool = False


class Generation:
    """One sequence under its stop criteria: the sans-IO core every server paces.

    The matched EOS or stop token is part of the output (and of the counts), as
    the engines report it in ``token_ids``. Resuming from the prompt plus the
    first ``k`` tokens reproduces the rest when ``max_tokens`` and
    ``min_tokens`` are reduced by ``k``, as a migrating router does.
    """

    def __init__(
        self, model: SimModel, prompt_ids: Sequence[int], criteria: StopCriteria,
        sample_seed: int | None = None, script: Sequence[int] | None = None,
    ) -> None:
        self.criteria = criteria
        self._script = script  # given tokens to emit before EOS (see scripted.py)
        self.prompt_len = len(prompt_ids)
        self.output_ids: list[int] = []
        #: the prefix hash before each output token (what its logprobs derive from)
        self.states: list[int] = []
        self.finish: Finish | None = None
        self._sequence = SimSequence(model, prompt_ids, sample_seed)
        self._eos = model.eos_token_id
        stops = criteria.stop_token_ids
        # Below min_tokens every way to stop is masked; afterwards only an ignored EOS is.
        self._banned_early = stops | {self._eos}
        self._banned_late: frozenset[int] = (
            frozenset({self._eos}) if criteria.ignore_eos else frozenset()
        )
        if criteria.max_tokens <= 0:
            self.finish = Finish("length")

    def step(self) -> int:
        """Generate one token and update :attr:`finish`."""
        if self.finish is not None:
            raise RuntimeError("the sequence has already finished")
        early = len(self.output_ids) < self.criteria.min_tokens
        self.states.append(self._sequence.state)
        if self._script is not None:
            n = len(self.output_ids)
            token_id = self._script[n] if n < len(self._script) else self._eos
        else:
            token_id = self._sequence.step(self._banned_early if early else self._banned_late)
        self.output_ids.append(token_id)
        if token_id == self._eos and not self.criteria.ignore_eos:
            self.finish = Finish("stop", token_id, matched_eos=True)
        elif token_id in self.criteria.stop_token_ids:
            self.finish = Finish("stop", token_id)
        elif len(self.output_ids) >= self.criteria.max_tokens:
            self.finish = Finish("length")
        return token_id

    def run(self) -> list[int]:
        """Generate to the end (for tests and non-paced callers)."""
        while self.finish is None:
            self.step()
        return self.output_ids


@dataclasses.dataclass(frozen=True, slots=True)
class TimingModel:
    """How long generation takes: a linear prefill, a fixed decode step, a batch limit.

    Time to first token is ``prefill_us_per_token`` × prompt tokens, then one
    token per ``decode_us_per_token``. At most ``max_running`` sequences
    generate at once; the rest wait in FIFO order. With both times 0 the
    server never sleeps (the overhead benchmark relies on it). With
    ``chunk_tokens`` the sequences of a rank share batched steps instead, whose
    length grows with the prefill and the batch in them (simulator/steps.py).
    """

    prefill_us_per_token: float = 0.0
    decode_us_per_token: float = 0.0
    max_running: int = 256
    #: > 0: batched scheduler steps (simulator/steps.py) instead of a clock per sequence:
    #: each step prefills up to this many prompt tokens, first come first served, and
    #: decodes one token of every request past its prefill; ``decode_us_per_token`` is
    #: then each decoded request's share of a step, so decoding slows with the batch
    chunk_tokens: int = 0
    #: with ``chunk_tokens``: a step's fixed cost
    step_us: float = 0.0

    def __post_init__(self) -> None:
        if min(self.prefill_us_per_token, self.decode_us_per_token, self.step_us) < 0:
            raise ValueError("timings must not be negative")
        if self.max_running < 1:
            raise ValueError("max_running must be at least 1")
        if self.chunk_tokens < 0:
            raise ValueError("chunk_tokens must not be negative")

    @property
    def instant(self) -> bool:
        """Whether generation never sleeps."""
        return (self.prefill_us_per_token == 0 and self.decode_us_per_token == 0
                and self.step_us == 0)

    @property
    def stepped(self) -> bool:
        """Whether sequences run in batched scheduler steps (simulator/steps.py)."""
        return self.chunk_tokens > 0 and not self.instant

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Time from admission to the first token."""
        return self.prefill_us_per_token * prompt_tokens / 1e6

    @property
    def decode_seconds(self) -> float:
        """Time between two tokens of one sequence."""
        return self.decode_us_per_token / 1e6
