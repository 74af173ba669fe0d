"""The encoder: fastokens' ids are tokenizers' ids, and the ids of a text split at its added
tokens are the ids of the whole (what incremental tokenization rests on)."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from direct_frontend.text.demo_model import corpus
from direct_frontend.text.encoder import Encoder, _Splitter
from direct_frontend.text.model_dir import TextModel

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>")
PIECES = st.sampled_from([
    *"ab c\n\t.-'7é中😀", " the", "  ", "\n\n", "interactions", "1234", "don't", *SPECIALS,
    "<|im", "_start|>", "<", "|>",
])
TEXTS = st.lists(PIECES, max_size=40).map("".join)


def _copy(model_dir: Path, dest: Path) -> Path:
    target = dest / "model"
    shutil.copytree(model_dir, target)
    return target


def _metaspace_model(dest: Path) -> Path:
    """A Llama-2-like model: Metaspace (prepended on the first piece only), byte fallback."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    from tokenizers import trainers

    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"],
                                  initial_alphabet=[f"<0x{b:02X}>" for b in range(256)])
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIALS])
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(tokenizer.to_str())
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return dest


@pytest.fixture(scope="module")
def models_under_test(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> dict[str, TextModel]:
    """The demo model (byte-level), it with two more special tokens, and a Metaspace one."""
    extra = _copy(model_dir, tmp_path_factory.mktemp("extra"))
    tokenizer = Tokenizer.from_file(str(extra / "tokenizer.json"))
    tokenizer.add_special_tokens(["<think>", "</think>"])
    (extra / "tokenizer.json").write_text(tokenizer.to_str())
    return {
        "demo": TextModel.load(model_dir),
        "think": TextModel.load(extra),
        "metaspace": TextModel.load(_metaspace_model(tmp_path_factory.mktemp("meta"))),
    }


def _reference(model: TextModel, text: str, special: bool = False) -> list[int]:
    return model._tokenizer.encode(text, add_special_tokens=special).ids


def test_fastokens_encodes_the_demo_model(models_under_test: dict[str, TextModel]) -> None:
    assert models_under_test["demo"].encoder.engine == "fastokens"


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_the_encoder_gives_tokenizers_ids(models_under_test: dict[str, TextModel],
                                          text: str) -> None:
    for model in models_under_test.values():
        encoder = model.encoder
        assert encoder.encode(text) == _reference(model, text)
        assert encoder.encode(text, add_special_tokens=True) == _reference(model, text, True)
        assert encoder.encode_batch([text, text[::-1]]) == [
            _reference(model, text), _reference(model, text[::-1])]


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_pieces_between_added_tokens_tokenize_to_the_whole(
    models_under_test: dict[str, TextModel], text: str
) -> None:
    for model in models_under_test.values():
        cuts = model.encoder.boundaries(text)
        assert cuts is not None
        ends = sorted({0, *cuts, len(text)})
        pieces = [text[a:b] for a, b in itertools.pairwise(ends)]
        whole = _reference(model, text)
        encoded = model.encoder.encode_batch(pieces)
        assert [i for ids in encoded for i in ids] == whole
        # every cut starts an added token: the first id of its piece is one
        added = set(model._tokenizer.get_added_tokens_decoder())
        assert all(ids[0] in added for a, ids in zip(ends, encoded, strict=False) if a in cuts)


@settings(max_examples=200, deadline=None)
@given(text=TEXTS, more=TEXTS, at=st.integers(0, 10_000))
def test_boundaries_after_a_shared_prefix_are_the_whole_scans(
    models_under_test: dict[str, TextModel], text: str, more: str, at: int
) -> None:
    """Given the cuts of the text's first part, the rest is scanned: the same cuts, also
    where an added token straddles the end of the part or a longer one starts before it."""
    whole = text + more
    shared = at % (len(whole) + 1)
    for model in models_under_test.values():
        encoder = model.encoder
        earlier = encoder.boundaries(whole[:shared])
        assert earlier is not None
        assert encoder.boundaries_after(whole, shared, earlier) == encoder.boundaries(whole)


#: added tokens that overlap: one begins another, one ends where another begins
_OVERLAPPING = ("<a>", "<a><b>", "b><c", "<c>x", "x")


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from([*_OVERLAPPING, "<", ">", "a", "b", "<a", "c>"]),
                     max_size=30).map("".join), at=st.integers(0, 1000))
def test_starts_after_a_prefix_are_the_whole_scans_with_overlapping_tokens(
    text: str, at: int
) -> None:
    splitter = _Splitter(_OVERLAPPING)
    shared = at % (len(text) + 1)
    earlier = splitter.starts(text[:shared], 0)
    assert splitter.starts_after(text, shared, earlier) == splitter.starts(text, 0)


def test_no_cuts_where_an_added_token_takes_the_space_before_it(
    model_dir: Path, tmp_path: Path
) -> None:
    target = _copy(model_dir, tmp_path)
    spec = json.loads((target / "tokenizer.json").read_text())
    spec["added_tokens"][1]["lstrip"] = True
    (target / "tokenizer.json").write_text(json.dumps(spec))
    model = TextModel.load(target)
    assert model.encoder.boundaries("a <|im_start|>b") is None
    assert model.encode("a <|im_start|>b") == _reference(model, "a <|im_start|>b")


def test_tokenizers_encodes_what_fastokens_cannot_read(model_dir: Path, tmp_path: Path) -> None:
    target = _copy(model_dir, tmp_path)
    spec = json.loads((target / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFKC"}
    (target / "tokenizer.json").write_text(json.dumps(spec))
    model = TextModel.load(target)
    assert model.encoder.engine == "tokenizers"
    assert model.encode("ﬁne ①") == _reference(model, "ﬁne ①")


def test_a_disagreeing_fast_encoder_is_dropped(text_model: TextModel) -> None:
    spec = {"model": {"type": "BPE"}}
    encoder = Encoder(text_model._tokenizer, spec, (text_model.path / "tokenizer.json")
                      .read_text())
    assert encoder.fast
    other = Tokenizer.from_file(str(text_model.path / "tokenizer.json"))
    other.add_special_tokens(["hello"])  # tokenizers now splits "hello" out; fastokens does not
    encoder._hf = other
    assert not encoder.agrees(["say hello"])
    assert encoder.engine == "tokenizers" and encoder.encode("say hello") == other.encode(
        "say hello", add_special_tokens=False).ids
