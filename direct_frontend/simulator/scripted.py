"""Scripted output: a prompt that carries a marker gets a given completion, token by token.

End-to-end tests need the engine to say exactly what a real model would (a
Hermes ``<tool_call>``, a Harmony analysis channel, a ``</think>``) to prove the
router parses it. A :class:`ScriptBook` maps marker text to completion text;
a prompt whose decoded text contains a marker is answered with that
completion, encoded with the model's own tokenizer, then EOS (``max_tokens``
still cuts it, as it would a model). A resumed request (prompt plus the first
``k`` tokens of the script, as a migrating router sends it) continues at token
``k``, so migration tests see one unbroken completion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer


class ScriptBook:
    """Marker text -> completion; the first marker (in the mapping's order) found wins."""

    def __init__(self, tokenizer: Tokenizer, scripts: Mapping[str, str]) -> None:
        if not all(scripts):
            raise ValueError("a script marker must not be empty")
        self._tokenizer = tokenizer
        self._scripts = {
            marker: tuple(tokenizer.encode(text, add_special_tokens=False).ids)
            for marker, text in scripts.items()
        }

    @classmethod
    def from_file(cls, tokenizer_json: str, scripts: Mapping[str, str]) -> ScriptBook:
        return cls(Tokenizer.from_file(tokenizer_json), scripts)

    def completion_for(self, prompt_ids: Sequence[int]) -> tuple[int, ...] | None:
        """The rest of the scripted completion for this prompt, or None if it has no marker."""
        text = self._tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        for marker, script in self._scripts.items():
            if marker in text:
                return script[_already_sent(prompt_ids, script):]
        return None


def _already_sent(prompt_ids: Sequence[int], script: tuple[int, ...]) -> int:
    """How many of the script's tokens end the prompt (a resumed request carries them)."""
    for k in range(min(len(script), len(prompt_ids)), 0, -1):
        if tuple(prompt_ids[len(prompt_ids) - k:]) == script[:k]:
            return k
    return 0
