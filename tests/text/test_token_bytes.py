"""Per-token bytes and logprob strings, for byte-level BPE and byte-fallback vocabularies."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE

from direct_frontend.text.model_dir import TextModel
from direct_frontend.text.token_bytes import TokenBytes


def test_byte_level_tokens_spell_the_text_byte_for_byte(text_model: TextModel) -> None:
    text = " the sea 你好 café 🦜"
    ids = text_model.encode(text)
    tokens = text_model.token_bytes
    assert b"".join(tokens.of(i) for i in ids) == text.encode()
    partial = [i for i in ids if not _whole(tokens.of(i))]
    assert partial, "the demo tokenizer should split some character into bytes"
    for token_id in partial:
        shown = tokens.chat_token(token_id)  # OpenAI's way: the partial bytes as \xHH
        assert "\\x" in shown and "\ufffd" not in shown
        if len(tokens.of(token_id)) == 1:
            assert shown == f"\\x{tokens.of(token_id)[0]:02x}"
        assert "\ufffd" in tokens.completion_token(token_id)  # vLLM's way: U+FFFD
    eos = text_model.token_to_id("<|im_end|>")
    assert eos is not None and tokens.of(eos) == b"<|im_end|>"


def _whole(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_byte_fallback_pieces_and_the_metaspace_read_as_their_bytes() -> None:
    vocab = {"<unk>": 0, "\u2581sea": 1, "<0xE4>": 2, "<0xBD>": 3, "<0xA0>": 4, "s": 5}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    spec = json.loads(tokenizer.to_str())["decoder"]
    tokens = TokenBytes(tokenizer, spec)
    assert tokens.of(1) == b" sea"  # the leading space a lone decode would strip
    assert [tokens.of(i) for i in (2, 3, 4)] == [b"\xe4", b"\xbd", b"\xa0"]
    assert tokens.chat_token(2) == "\\xe4"
    assert b"".join(tokens.of(i) for i in (1, 2, 3, 4)).decode() == " sea你"
