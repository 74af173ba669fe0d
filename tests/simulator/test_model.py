"""A simulator built from a model directory emits valid text, like a real model.

Byte-level BPE ids sampled at random decode to stray bytes (U+FFFD); a
model-dir engine samples only clean ids plus whole multi-token characters, so
its streams still split characters across tokens (the frontend must
reassemble them) but never break them, and stay a function of the prefix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from direct_frontend.simulator import (
    EngineKind,
    Generation,
    SimEngine,
    SimModel,
    SimSequence,
    StopCriteria,
)
from direct_frontend.simulator.vocab import TextVocab
from direct_frontend.text.detokenize import IncrementalDetokenizer
from tests.simulator.test_engine import KINDS, generate, output_of
from tests.support.sim import connected, run

PROMPT = [100, 101, 102]
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def model(model_dir: Path) -> SimModel:
    return SimEngine.from_model_dir("sglang", model_dir).model


def split_characters(tokenizer: Tokenizer, ids: list[int]) -> set[str]:
    """Non-ASCII characters the stream spells over more than one token."""
    found: set[str] = set()
    start = 0
    while start < len(ids):
        if REPLACEMENT not in tokenizer.decode([ids[start]]):
            start += 1
            continue
        end = start + 1
        while end <= len(ids) and REPLACEMENT in tokenizer.decode(ids[start:end]):
            end += 1
        found.add(tokenizer.decode(ids[start:end]))
        start = end
    return found


def test_the_demo_vocabulary_has_clean_ids_and_split_characters(
    model: SimModel, tokenizer: Tokenizer
) -> None:
    text = model.text
    assert text is not None and text.units and model.window >= 2  # 4-byte emoji: 3 ids
    spelled = {tokenizer.decode(list(unit)) for unit in text.units}
    assert {"ñ", "ü", "ß", "中", "文", "日", "本", "🙂", "🚀"} <= spelled
    assert "é" not in spelled  # one token in the demo vocabulary: clean, not a unit
    assert all(REPLACEMENT not in tokenizer.decode([i]) for i in text.clean_ids)
    assert model.eos_token_id not in text.clean_ids
    assert not model.special_ids & set(text.clean_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_stream_decodes_to_valid_text_with_split_characters(
    kind: EngineKind, model_dir: Path, tokenizer: Tokenizer
) -> None:
    async def body() -> list[int]:
        async with connected(SimEngine.from_model_dir(kind, model_dir)) as (_, channel):
            reply = await generate(
                kind,
                channel,
                PROMPT,
                max_tokens=3000,
                ignore_eos=True,
            )
            return output_of(kind, reply, stream=True)

    ids = run(body())
    assert len(ids) == 3000
    text = tokenizer.decode(ids)
    assert REPLACEMENT not in text
    # Characters really are split over several tokens, of several byte lengths...
    split = split_characters(tokenizer, ids)
    assert len(split) >= 10
    assert {len(c.encode()) for c in split} >= {2, 3, 4}
    assert REPLACEMENT not in "".join(split)
    # ...and the frontend's incremental detokenizer reassembles them, token by token.
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push([token]) for token in ids]
    assert "".join(pieces) + detokenizer.flush() == text
    assert any(piece == "" for piece in pieces)  # held back mid-character


def test_next_token_is_a_function_of_the_prefix_even_inside_a_character(
    model: SimModel,
) -> None:
    assert model.text is not None
    starts = set(model.text.starts)
    sequence = SimSequence(model, PROMPT)
    generated = [sequence.step() for _ in range(2000)]
    inside = [k for k in range(1, len(generated)) if generated[k - 1] in starts]
    assert len(inside) >= 20
    for k in [*inside[:20], 0, 1, 500, 1999]:
        prefix = [*PROMPT, *generated[:k]]
        assert model.next_token(prefix) == generated[k]
        resumed = SimSequence(model, prefix)
        expected = generated[k : k + 10]
        assert [resumed.step() for _ in expected] == expected
    # A prompt that ends inside a character is continued with the rest of it.
    unit = next(u for u in model.text.units if len(u) == 3)
    continued = SimSequence(model, [*PROMPT, unit[0]])
    nexts = model.text.continuation([unit[0]])
    assert nexts is not None and continued.step() in nexts


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_mid_character_over_grpc_gives_the_same_text(
    kind: EngineKind, model_dir: Path, model: SimModel, tokenizer: Tokenizer
) -> None:
    assert model.text is not None
    starts = set(model.text.starts)
    full = Generation(model, PROMPT, StopCriteria(max_tokens=400, ignore_eos=True)).run()
    cut = next(k for k in range(1, len(full)) if full[k - 1] in starts)

    async def body() -> list[int]:
        async with connected(SimEngine.from_model_dir(kind, model_dir)) as (_, channel):
            rest = await generate(
                kind,
                channel,
                [*PROMPT, *full[:cut]],
                max_tokens=400 - cut,
                ignore_eos=True,
            )
            return output_of(kind, rest, stream=True)

    assert run(body()) == full[cut:]
    assert tokenizer.decode([*full[:cut], *full[cut:]]) == tokenizer.decode(full)


def test_eos_never_cuts_a_character(model_dir: Path, tokenizer: Tokenizer) -> None:
    engine = SimEngine.from_model_dir("vllm", model_dir, eos_probability=0.2, unit_probability=0.3)
    model = engine.model
    stopped = 0
    for first in range(50, 450):
        generation = Generation(model, [first, 7, 8], StopCriteria(max_tokens=200))
        ids = generation.run()
        assert generation.finish is not None
        if generation.finish.reason == "stop":
            stopped += 1
            assert REPLACEMENT not in tokenizer.decode(ids)
    assert stopped > 300


def test_plain_vocabulary_mode_is_unchanged(model_dir: Path) -> None:
    engine = SimEngine.from_model_dir("trtllm", model_dir, text_vocab=None)
    assert engine.model.text is None and engine.model.window == 0
    plain = SimModel(engine.config.vocab_size, engine.config.eos_token_id, engine.model.special_ids)
    prompt_ids = [5, 6, 7]
    expected = Generation(plain, prompt_ids, StopCriteria(max_tokens=300, ignore_eos=True)).run()
    assert (
        Generation(engine.model, prompt_ids, StopCriteria(max_tokens=300, ignore_eos=True)).run()
        == expected
    )
    # Every ordinary id is fair game, byte fragments included.
    tokens = Generation(plain, prompt_ids, StopCriteria(max_tokens=3000, ignore_eos=True)).run()
    with_text = SimEngine.from_model_dir("trtllm", model_dir).model.text
    assert with_text is not None
    assert set(tokens) - set(with_text.clean_ids)


def test_text_vocab_rejects_units_that_could_overlap() -> None:
    TextVocab((1, 2, 3), ((10, 11), (10, 12, 13)))
    with pytest.raises(ValueError, match="single token"):
        TextVocab((1,), ((10,),))
    with pytest.raises(ValueError, match="clean"):
        TextVocab((1, 11), ((10, 11),))
    with pytest.raises(ValueError, match="starts a unit"):
        TextVocab((1,), ((10, 11), (11, 12)))
    with pytest.raises(ValueError, match="prefix"):
        TextVocab((1,), ((10, 11), (10, 11, 12)))
    vocab = TextVocab((1, 2, 3), ((10, 11), (10, 12, 13), (20, 21)))
    assert vocab.window == 2 and vocab.starts == (10, 20)
    assert vocab.continuation([5, 10]) == (11, 12)
    assert vocab.continuation([10, 12]) == (13,)
    assert vocab.continuation([10, 11]) is None  # complete: free again
    narrowed = vocab.within(20, {2})
    assert narrowed.clean_ids == (1, 3) and narrowed.units == ((10, 11), (10, 12, 13))


def test_a_sampling_seed_picks_its_own_stream_and_still_resumes_exactly(model: SimModel) -> None:
    criteria = StopCriteria(max_tokens=30, ignore_eos=True)
    greedy = Generation(model, PROMPT, criteria).run()
    assert Generation(model, PROMPT, criteria, sample_seed=None).run() == greedy
    seeded = [Generation(model, PROMPT, criteria, sample_seed=s).run() for s in (7, 8, 7)]
    assert seeded[0] == seeded[2] != seeded[1] and greedy not in seeded
    resumed = Generation(
        model, [*PROMPT, *seeded[0][:11]], StopCriteria(max_tokens=19, ignore_eos=True),
        sample_seed=7,
    ).run()
    assert seeded[0][:11] + resumed == seeded[0]
