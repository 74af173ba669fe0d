"""Reasoning between two tags: ``<think>...</think>``, or Mistral's ``[THINK]...[/THINK]``.

A reply may start inside the block: DeepSeek-R1-0528, Qwen3-Thinking-2507
and Kimi-K2-Thinking templates end the prompt with the opening tag, so the
output holds only the closing one; pass ``starts_in_reasoning`` (see
:func:`prompt_opens_reasoning`). An opening tag at the very start is taken
either way. A template with thinking off closes the block at the end of the
prompt (Qwen3's ``enable_thinking`` off, DeepSeek-V3.1's default, GLM's), so
the reply is all content, whatever the model's default
(:func:`prompt_reasoning_state`). The block is read only at
the start of the reply; reasoning cut by the end of output stays reasoning.
Whitespace around the reasoning and before the content after it is dropped.
"""

from __future__ import annotations

from typing import ClassVar

from direct_frontend.openai.parsers.base import ParsedDelta
from direct_frontend.openai.parsers.scan import safe_end

_WS = " \t\r\n"


def prompt_opens_reasoning(prompt: str, open_tag: str = "<think>",
                           close_tag: str = "</think>") -> bool:
    """Whether the rendered prompt ends inside an open reasoning block."""
    i = prompt.rfind(open_tag)
    return i != -1 and prompt.find(close_tag, i) == -1


def prompt_reasoning_state(prompt: str, open_tag: str = "<think>",
                           close_tag: str = "</think>") -> bool | None:
    """Where the reply starts, as the prompt says: inside the block (True), after it (False).

    None when the prompt says nothing (the reasoning parser's default holds):
    the block is open at its end, closed right at its end (the template
    switched thinking off), or neither.
    """
    if prompt_opens_reasoning(prompt, open_tag, close_tag):
        return True
    if prompt.rstrip(_WS).endswith(close_tag):
        return False
    return None


class ThinkParser:
    """Splits one choice's text into ``reasoning_content`` and ``content``."""

    name: ClassVar[str] = "think"
    OPEN: ClassVar[str] = "<think>"
    CLOSE: ClassVar[str] = "</think>"
    handles_reasoning: ClassVar[bool] = True

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self.malformed = 0
        self.tool_calls_made = 0
        self._mode = "start"  # start | reasoning | content
        self._in_reasoning_first = starts_in_reasoning
        self._buf = ""
        self._trail = ""  # trailing whitespace of the reasoning, held until more follows
        self._lead = True  # drop whitespace before the first reasoning / content text

    @property
    def reasoning_open(self) -> bool:
        """Whether the text so far is inside the reasoning block (a budget may close it)."""
        return self._mode == "reasoning"

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        self._scan(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._scan(out, final=True)
        return out

    def _scan(self, out: ParsedDelta, final: bool) -> None:
        while True:
            if self._mode == "content":
                self._emit(out, self._buf, False)
                self._buf = ""
                return
            if self._mode == "start":
                stripped = self._buf.lstrip(_WS)
                if not final and (not stripped or (len(stripped) < len(self.OPEN)
                                                   and self.OPEN.startswith(stripped))):
                    return
                if stripped.startswith(self.OPEN):
                    self._buf, self._mode = stripped[len(self.OPEN):], "reasoning"
                elif self._in_reasoning_first:
                    self._mode = "reasoning"
                else:
                    self._mode = "content"
                continue
            j = self._buf.find(self.CLOSE)
            held = len(self._buf) if final else safe_end(self._buf, (self.CLOSE,))
            end = j if j != -1 else held
            self._emit(out, self._buf[:end], True)
            if j == -1:
                self._buf = self._buf[end:]
                return
            self._buf = self._buf[j + len(self.CLOSE):]
            self._mode, self._trail, self._lead = "content", "", True

    def _emit(self, out: ParsedDelta, text: str, reasoning: bool) -> None:
        """``text`` into ``out``: its reasoning (trailing whitespace held until more follows),
        or its content; whitespace that leads either is dropped."""
        if self._lead:
            text = text.lstrip(_WS)
            if not text:
                return
            self._lead = False
        if not reasoning:
            out.content += text
            return
        body = text.rstrip(_WS)
        if body:
            out.reasoning += self._trail + body
            self._trail = text[len(body):]
        else:
            self._trail += text


class MistralThinkParser(ThinkParser):
    """Magistral's ``[THINK]...[/THINK]`` (control tokens: detokenize keeping special tokens)."""

    name = "mistral"
    OPEN = "[THINK]"
    CLOSE = "[/THINK]"
