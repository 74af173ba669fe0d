"""The machinery every tool parser shares: one call's body, and a call's life in the stream.

A *body* reads the text of one call (after its opening marker) and knows the
call's name once it can, the argument text that may go out so far, and at
``close`` whether the call is well-formed. :class:`CallParser` turns bodies into
deltas: in ``stream_arguments`` mode the name goes out as soon as it is known
and argument fragments as they come; otherwise a call goes out whole once it
closed well. A call that does not close well is content text (its raw text,
markers included) and counts in ``malformed`` -- unless its name already went
out, which only ``stream_arguments`` allows: then the call stays as sent and is
counted. So streaming equals non-streaming for every well-formed output, and
for every output when ``stream_arguments`` is off.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from direct_frontend.openai.parsers.base import ParsedDelta, ToolCallDelta, ToolSchemas, new_call_id
from direct_frontend.openai.parsers.scan import BracketScanner, find_first, safe_end

_WS = " \t\r\n"


class CallBody(Protocol):
    """One call's text, fed in pieces after its opening marker."""

    name: str | None  # known once the header parsed
    failed: bool  # set as soon as the text cannot be a call any more

    def push(self, text: str) -> int:
        """Take ``text``; return where in it a self-delimited body ended, else -1."""

    def take_arguments(self) -> str:
        """Argument text that is safe to send now (empty before the name is known)."""

    def close(self) -> str | None:
        """The call is over: the argument text not yet taken, or None if malformed."""


def _valid_arguments(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class JsonArgsBody:
    """A header that names the call, then the arguments as one raw JSON object.

    ``header`` must match the whole header and look ahead at the ``{`` that
    starts the arguments, so it matches at the same place however the text was
    split; its group ``name`` (read through ``name_of``) names the call. The
    arguments go out as the model wrote them (no re-serialising), which keeps
    every split's concatenation equal; ``json.loads`` checks them at the end.
    Text after the arguments must match ``tail``. A self-delimited body ends
    right after the arguments, or with ``closer`` if one is given (the ``}`` of
    an envelope object).
    """

    __slots__ = ("_args", "_closer", "_head", "_name_of", "_pattern", "_released", "_scanner",
                 "_self_delimited", "_tail", "_tail_text", "failed", "name")

    HEADER_LIMIT: ClassVar[int] = 512

    def __init__(self, header: re.Pattern[str], *, name_of: Callable[[str], str | None] = str,
                 tail: re.Pattern[str] | None = None, self_delimited: bool = False,
                 closer: str = "") -> None:
        self._pattern = header
        self._name_of = name_of
        self._tail = tail
        self._self_delimited = self_delimited
        self._closer = closer
        self._scanner = BracketScanner()
        self._head = ""
        self._args: list[str] = []
        self._released = 0  # chars of the arguments already taken
        self._tail_text = ""
        self.name: str | None = None
        self.failed = False

    def push(self, text: str) -> int:
        if self.failed:
            return -1
        if self.name is None:
            return self._push_header(text)
        if self._scanner.started and self._scanner.depth <= 0:
            return self._push_tail(text, 0)
        return self._push_arguments(text)

    def _push_header(self, text: str) -> int:
        self._head += text
        m = self._pattern.match(self._head)
        if m is None:
            if len(self._head) > self.HEADER_LIMIT:
                self.failed = True
            return -1
        name = self._name_of(m.group("name"))
        if not name:
            self.failed = True
            return -1
        self.name = name
        rest = self._head[m.end():]
        self._head = ""
        end = self._push_arguments(rest)
        return -1 if end == -1 else end - len(rest) + len(text)

    def _push_arguments(self, text: str) -> int:
        offset = 0
        if not self._scanner.started:
            stripped = text.lstrip(_WS)
            if not stripped:
                return -1
            if stripped[0] != "{":
                self.failed = True
                return -1
            offset = len(text) - len(stripped)
        end = self._scanner.feed(text, offset)
        if end == -1:
            self._args.append(text[offset:])
            return -1
        self._args.append(text[offset:end])
        return self._push_tail(text, end)

    def _push_tail(self, text: str, start: int) -> int:
        if not self._self_delimited:
            self._tail_text += text[start:]
            return -1
        if not self._closer:
            return start
        i = text.find(self._closer, start)
        if i == -1:
            self._tail_text += text[start:]
            return -1
        self._tail_text += text[start:i + 1]
        return i + 1

    def take_arguments(self) -> str:
        if self.name is None or not self._args:
            return ""
        text = "".join(self._args)
        self._args = [text]
        piece = text[self._released:]
        self._released = len(text)
        return piece

    def close(self) -> str | None:
        text = "".join(self._args)
        if self.failed or self.name is None or self._scanner.depth > 0:
            return None
        if not _valid_arguments(text):
            return None
        tail = self._tail_text
        if self._closer and not tail.endswith(self._closer):
            return None
        if tail.strip(_WS) and (self._tail is None or not self._tail.fullmatch(tail)):
            return None
        return text[self._released:]


#: the ``{"name": ..., "arguments": ...`` envelope most JSON formats use, up to the arguments
ENVELOPE_HEADER = re.compile(
    r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"'
    r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
#: what may follow the arguments inside the envelope: its end, maybe after an ``id``
ENVELOPE_TAIL = re.compile(r'\s*(?:,\s*"id"\s*:\s*"[^"]*"\s*)?\}\s*')


def envelope_body(*, self_delimited: bool = False) -> JsonArgsBody:
    """A body for one ``{"name": ..., "arguments": {...}}`` object."""
    return JsonArgsBody(ENVELOPE_HEADER, name_of=json_string, tail=ENVELOPE_TAIL,
                        self_delimited=self_delimited, closer="}" if self_delimited else "")


class CallParser:
    """Base of the tool parsers: content, calls and their deltas; subclasses split the text.

    A subclass implements :meth:`_scan` over ``self._buf`` with the helpers
    below and returns when it needs more text; ``final`` is true once at the end.
    """

    name: ClassVar[str] = ""
    handles_reasoning: ClassVar[bool] = False

    def __init__(self, *, tools: ToolSchemas | None = None, stream_arguments: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.tools = tools
        self.stream_arguments = stream_arguments
        self.new_id = new_id
        self.malformed = 0
        self.tool_calls_made = 0
        self._buf = ""
        self._out = ParsedDelta()
        self._body: CallBody | None = None
        self._raw: list[str] = []
        self._sent_header = False
        self._pending: list[ToolCallDelta] = []
        self._after_call = False
        self._last_ok = True  # whether the last call ended well-formed

    # -- the interface ------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        self._scan(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._scan(final=True)
        if self._body is not None:
            self._feed_call(self._buf)
            self._buf = ""
            self._end_call()
        if self._buf:
            self._content(self._buf)
            self._buf = ""
        return self._take()

    def _scan(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    # -- helpers for _scan ----------------------------------------------------------
    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call = False
        self._out.content += text

    def _until(self, markers: tuple[str, ...], final: bool, call: bool = False,
               keep: bool = True) -> str:
        """The held text up to the first marker goes out, and the marker is returned (consumed);
        with none yet, all but the tail that may start one goes out (all of it when ``final``)
        and "" is returned.

        The text is content, or with ``call`` the open call's, which ends at the marker:
        ``keep`` puts the marker into a malformed call's content text.
        """
        buf = self._buf
        i, marker = find_first(buf, markers)
        if i == -1:
            i = len(buf) if final else safe_end(buf, markers)
            self._buf = buf[i:]
        else:
            self._buf = buf[i + len(marker):]
        if not call:
            self._content(buf[:i])
            return marker
        self._feed_call(buf[:i])
        if marker:
            self._end_call(marker if keep else "")
        return marker

    def _begin_call(self, body: CallBody, opening: str) -> None:
        self._body = body
        self._raw = [opening]
        self._sent_header = False
        self._pending = []
        self._call_id = self.new_id()

    def _feed_call(self, chunk: str) -> int:
        """Give the open call ``chunk``; return where a self-delimited body ended in it, or -1."""
        body = self._body
        assert body is not None
        end = body.push(chunk)
        self._raw.append(chunk if end == -1 else chunk[:end])
        if body.failed or body.name is None:
            return end
        if self.tools is not None and body.name not in self.tools:
            body.failed = True
            return end
        if not self._pending and not self._sent_header:
            self._pending.append(ToolCallDelta(self.tool_calls_made, "", self._call_id, body.name))
        args = body.take_arguments()
        if args:
            self._pending.append(ToolCallDelta(self.tool_calls_made, args))
        if self.stream_arguments:
            self._release()
        return end

    def _release(self) -> None:
        if self._pending:
            self._sent_header = True
            self._out.add_calls(self._pending)
            self._pending = []

    def _end_call(self, closing: str = "") -> None:
        body = self._body
        assert body is not None
        self._body = None
        self._raw.append(closing)
        rest = None if body.failed else body.close()
        self._last_ok = rest is not None
        if rest is None:
            self.malformed += 1
            self._pending = []
            if not self._sent_header:
                self._out.content += "".join(self._raw)
                self._after_call = False
            else:
                self.tool_calls_made += 1
            return
        if not self._pending and not self._sent_header:
            assert body.name is not None
            self._pending.append(ToolCallDelta(self.tool_calls_made, "", self._call_id, body.name))
        if rest:
            self._pending.append(ToolCallDelta(self.tool_calls_made, rest))
        self._release()
        self.tool_calls_made += 1
        self._after_call = True

    def _call_self_delimited(self) -> bool:
        """Feed the open self-delimited call all held text; end it where it ends (True then)."""
        buf, self._buf = self._buf, ""
        end = self._feed_call(buf)
        body = self._body
        if end != -1:
            self._buf = buf[end:]
            self._end_call()
            return True
        if body is not None and body.failed:
            self._end_call()
            return True
        return False


def json_string(text: str) -> str | None:
    """A JSON string literal's value (without quotes in ``text``), None if it is no valid one."""
    try:
        value: Any = json.loads('"' + text + '"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True, slots=True)
class SectionFormat:
    """How a model marks its calls: ``section`` (open, close) around them, ``call`` (open,
    close) around each, and the body that reads one call (given the request's tools)."""

    section: tuple[str, str]
    call: tuple[str, str]
    body: Callable[[ToolSchemas | None], CallBody]


class SectionCallParser(CallParser):
    """Calls marked one by one inside a section: ``section_open (call_open body call_close)*``.

    Whitespace between calls in the section is dropped; a call marker found
    outside any section is taken too, since models skip the section at times.
    """

    FORMAT: ClassVar[SectionFormat]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._in_section = False
        (section_open, self._section_close), (call_open, call_close) = (self.FORMAT.section,
                                                                         self.FORMAT.call)
        self._outside = (section_open, call_open)  # the markers looked for outside a section
        self._inside = (call_open, self._section_close)
        self._call_close = (call_close,)

    def _scan(self, final: bool) -> None:
        while True:
            if self._body is not None:
                if not self._until(self._call_close, final, call=True):
                    return
                continue
            if not self._in_section:
                marker = self._until(self._outside, final)
            else:
                self._after_call = True  # nothing but calls belongs here
                marker = self._until(self._inside, final)
            if not marker:
                return
            if marker == self._outside[0]:
                self._in_section = True
            elif marker == self._section_close:
                self._in_section = False
            else:
                self._begin_call(self.FORMAT.body(self.tools), marker)


class LeadingCallsParser(CallParser):
    """Calls that are the reply's own structure (a list, a run of objects), not marked spans.

    The reply starts in ``FIRST_MODE``: ``content`` runs until ``TRIGGER``;
    ``start`` takes a ``TRIGGER`` the reply opens with, else reads the structure
    right away. Then :meth:`_step` reads separators and starts self-delimited
    calls. Text consumed between calls is kept in ``_opening``, so a call that
    turns out malformed comes back as content with it; after one, the rest is
    content.
    """

    TRIGGER: ClassVar[str]
    AFTER_TRIGGER: ClassVar[str]
    FIRST_MODE: ClassVar[str] = "start"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mode = self.FIRST_MODE
        self._opening = ""

    def _scan(self, final: bool) -> None:
        while True:
            if self._body is not None:
                if not self._call_self_delimited():
                    return
                self._opening = ""
                if not self._last_ok:
                    self._mode = "content"
                continue
            if self._mode == "content":
                if not self._until((self.TRIGGER,), final):
                    return
                self._mode, self._opening = self.AFTER_TRIGGER, self.TRIGGER
                continue
            stripped = self._buf.lstrip(_WS)
            if not stripped:
                if final:
                    self._to_content()
                return
            self._opening += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            if not self._structure(stripped, final):
                return

    def _to_content(self) -> None:
        """What was consumed is content after all; so is the rest."""
        self._content(self._opening)
        self._opening, self._mode = "", "content"

    def _consume(self, n: int) -> None:
        self._opening, self._buf = self._opening + self._buf[:n], self._buf[n:]

    def _structure(self, text: str, final: bool) -> bool:
        """Read the structure at the start of ``text`` (== the buffer); False to wait for more.

        In ``start`` mode a ``TRIGGER`` comes first (the mode is ``AFTER_TRIGGER`` then),
        and text that may still become one waits.
        """
        if self._mode == "start":
            if text.startswith(self.TRIGGER):
                self._consume(len(self.TRIGGER))
                self._mode = self.AFTER_TRIGGER
                return True
            if self.TRIGGER.startswith(text) and not final:
                return False
        return self._step(text, final)

    def _step(self, text: str, final: bool) -> bool:
        """Read the format's own structure at the start of ``text``; False to wait for more."""
        raise NotImplementedError


class TaggedCallParser(CallParser):
    """Each call between an ``OPEN`` and a ``CLOSE`` tag, content around them."""

    OPEN: ClassVar[str]
    CLOSE: ClassVar[str]

    def _new_body(self) -> CallBody:
        raise NotImplementedError

    def _scan(self, final: bool) -> None:
        while True:
            if self._body is None:
                if not self._until((self.OPEN,), final):
                    return
                self._begin_call(self._new_body(), self.OPEN)
            elif not self._until((self.CLOSE,), final, call=True):
                return
