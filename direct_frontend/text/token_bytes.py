"""The bytes each token stands for, and its strings in OpenAI's logprobs.

Logprobs name every token on its own, but a token of a byte-level BPE or a
byte-fallback vocabulary may hold part of a UTF-8 character, which no string
can show: OpenAI gives such a token's ``bytes`` and shows the partial bytes
as ``\\xHH`` escapes in ``token``. Decoding the id alone would turn them into
U+FFFD and lose them, so the bytes are read from the vocabulary itself, the
way the tokenizer's decoder reads them (byte-level alphabet, ``<0xHH>``
pieces, the metaspace ``▁``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: the character that spells each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_ALPHABET = _byte_level_alphabet()
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _ALPHABET.items()})


def byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level vocabulary entry spells, or None if ``piece`` is not one."""
    try:
        return piece.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return None


class TokenBytes:
    """Per-token bytes and logprob strings of one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Tokenizer, decoder_spec: Mapping[str, Any] | None) -> None:
        self._tokenizer = tokenizer
        spec = json.dumps(decoder_spec or {}, ensure_ascii=False)
        self._byte_level = '"ByteLevel"' in spec
        self._byte_fallback = '"ByteFallback"' in spec
        self._metaspace = '"Metaspace"' in spec or "\u2581" in spec
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes:
        """The bytes ``token_id`` contributes to the output (special tokens: their text)."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._read(token_id)
        return cached

    def _read(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _ALPHABET for c in piece):
            return bytes(_ALPHABET[c] for c in piece)
        if self._byte_fallback and (match := _BYTE_PIECE.fullmatch(piece)):
            return bytes((int(match.group(1), 16),))
        if self._metaspace:
            return piece.replace("\u2581", " ").encode()
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def chat_token(self, token_id: int) -> str:
        """OpenAI chat's ``token``: the text, with bytes of partial characters as ``\\xHH``."""
        return self.of(token_id).decode("utf-8", "backslashreplace")

    def completion_token(self, token_id: int) -> str:
        """A completions ``tokens`` entry, as vLLM writes it: partial characters as U+FFFD."""
        return self.of(token_id).decode("utf-8", "replace")
