"""gpt-oss Harmony output: channels for reasoning, answers and tool calls, in one parser.

The text form (detokenized with special tokens kept) is a run of messages,
``[<|start|>assistant][ to=R]<|channel|>CH[ to=R][ <|constrain|>json]<|message|>BODY``
ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (or by the end of output,
since engines stop on ``<|call|>`` / ``<|return|>`` and may drop them). The
``analysis`` channel is reasoning; ``final`` is content; ``commentary`` to a
recipient ``functions.NAME`` is a call of NAME (other recipients keep their
full name), and ``commentary`` to nobody (a preamble) is content.

The ``openai-harmony`` package parses the same format from token ids, but it
needs the o200k vocabulary at run time (downloaded; not possible here and not
wanted in a router), so this parser reads the documented text form itself.
"""

from __future__ import annotations

import re
from typing import Any

from direct_frontend.openai.parsers.calls import CallParser, JsonArgsBody
from direct_frontend.openai.parsers.scan import find_first, safe_end

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_ARGS_START = re.compile(r"(?P<name>)\s*(?=\{)")
HEADER_LIMIT = 256


class HarmonyParser(CallParser):
    name = "harmony"
    handles_reasoning = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode = "header"  # header | reasoning | content | call | text (not Harmony after all)

    def _scan(self, final: bool) -> None:
        while True:
            mode = self._mode
            if mode == "text":
                self._content(self._buf)
                self._buf = ""
                return
            if mode == "call":
                if not self._until(ENDS, final, call=True, keep=False):
                    return
                self._mode = "header"
            elif mode == "header":
                if not self._header(final):
                    return
            elif not self._message_body(final):
                return

    def _header(self, final: bool) -> bool:
        i = self._buf.find(MESSAGE)
        if i == -1:
            if len(self._buf) > HEADER_LIMIT or (final and self._buf.strip()):
                self.malformed += 1
                self._mode = "text"
                return True
            return False
        header, self._buf = self._buf[:i], self._buf[i + len(MESSAGE):]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and (channel is None or channel.group(1) != "analysis"):
            name = recipient.group(1).removeprefix("functions.")
            self._begin_call(JsonArgsBody(_ARGS_START, name_of=lambda _: name), "")
            self._mode = "call"
        elif channel is not None and channel.group(1) == "analysis":
            self._mode = "reasoning"
        else:
            self._mode = "content"
        return True

    def _message_body(self, final: bool) -> bool:
        j, marker = find_first(self._buf, ENDS)
        end = j if j != -1 else (len(self._buf) if final else safe_end(self._buf, ENDS))
        text = self._buf[:end]
        if self._mode == "reasoning":
            self._out.reasoning += text
        else:
            self._content(text)
        if j == -1:
            self._buf = self._buf[end:]
            return False
        self._buf = self._buf[j + len(marker):]
        self._mode = "header"
        return True
