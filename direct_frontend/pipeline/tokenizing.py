"""A request's prompt as token ids: rendered, bounded, tokenized, cached; large ones off the loop.

- Small prompts are tokenized on the event loop: below :data:`INLINE_CHARS_FAST`
  characters to tokenize (≈ 1 ms of fastokens' work, ids included) or
  :data:`INLINE_CHARS` with tokenizers (≈ 1 ms); chats of less than
  :data:`RENDER_INLINE_CHARS` are rendered there too (≈ 1 ms at most).
- Larger ones are rendered, bounded and tokenized in worker threads, so
  ``/health`` and every stream keep being served meanwhile: tokenized at most one
  per core at a time (:func:`new_tokenize_limiter`; the encoders release the GIL
  while they work; a text that is not a chat is bounded there too), a chat
  rendered and bounded one at a time (:func:`new_holding_limiter`: Jinja and the
  bound hold the GIL, yielding it to the loop every switch interval).
- Before a large text is tokenized, a prompt that certainly cannot fit the
  fleet's largest context is refused from its bytes (``TextModel.fewest_tokens``).
- A chat prompt's ids (of :data:`PREFIX_MIN_CHARS` or more) reuse the ids of the
  longest prefix it shares with a chat rendered recently (pipeline/prompt_cache.py
  ``PrefixCache``): a conversation's
  next turn tokenizes only its new part, exactly as a whole tokenization would
  (text/encoder.py says why), and its ids (text/prompt_ids.py ``PromptIds``) take the
  block hashes of that prefix from the earlier prompt's. Where it begins with a
  kept prompt whole, that one's cuts are taken too and only the rest is scanned
  for added tokens.

The caches are read and written on the event loop only; worker threads compute.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import TypeVar

import trio

from direct_frontend.openai.errors import context_length_exceeded, invalid_request
from direct_frontend.openai.types import ChatMessage, ChatRequest
from direct_frontend.pipeline.media import MediaProfile
from direct_frontend.pipeline.prompt_cache import HEAD_CHARS, PrefixCache, PromptCache, Rendered
from direct_frontend.pipeline.render_cache import TurnCache, render_turns
from direct_frontend.routing.catalog import Catalog
from direct_frontend.text.model_dir import ChatTemplateError, TextModel
from direct_frontend.text.prompt_ids import PromptIds

T = TypeVar("T")

#: below this many characters fastokens tokenizes on the loop (≈ 1 ms at most; a thread hop
#: costs ≈ 60 µs of CPU, as much as ≈ 15,000 characters' tokenizing)
INLINE_CHARS_FAST = 256 << 10
#: the same with tokenizers, ~50× slower (≈ 1 ms at most)
INLINE_CHARS = 4096
#: from this many characters on, a prompt's ids come as the tokenizer's u32 bytes (where
#: fewer, its list of ints costs less than the flat call and the conversion to bytes)
RAW_MIN_CHARS = 2048
#: chats whose messages hold fewer characters are rendered on the loop (Jinja: ≈ 1 ms per MiB)
RENDER_INLINE_CHARS = 1 << 20
#: shorter chats are tokenized whole, and not kept for their prefix: tokenizing them costs
#: ≈ 10 µs, less than looking for a prefix does
PREFIX_MIN_CHARS = 8192
#: chats of fewer messages are rendered whole, not from an earlier turn's: a render's own cost
#: (≈ 15 µs of Jinja's) and the look-up's are as much as rendering ≈ 16 messages costs
TURNS_MIN_MESSAGES = 16
#: request bodies of fewer bytes are parsed on the loop (JSON with its depth check: ≈ 1 ms
#: per MB)
PARSE_INLINE_BYTES = 256 << 10


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: glibc's mallopt parameter, and the size from which buffers are always the OS's: above
#: the 256 KiB that asyncio's socket reads allocate for every receive (at 256 KiB each engine
#: read would map, fault in and unmap its buffer)
_M_MMAP_THRESHOLD = -3
LARGE_BUFFER = 512 << 10


def give_large_buffers_back() -> None:
    """Have glibc take buffers of :data:`LARGE_BUFFER` or more from the OS one by one, so
    freeing one (a large prompt's body, text or bytes, when its request ends) returns it.

    By default glibc raises that threshold to the size of the first such buffer freed, and
    keeps later ones in its heaps (one per thread), where a burst of large prompts stays
    resident long after it ended. A no-op where glibc is not the allocator.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, LARGE_BUFFER)


def new_tokenize_limiter() -> trio.CapacityLimiter:
    """The limiter every request of a daemon prepares its large prompt under: one per core
    (a bound on their memory, and on the cores taken from the loop)."""
    return trio.CapacityLimiter(cores())


def new_holding_limiter() -> trio.CapacityLimiter:
    """The limiter for work that holds the GIL throughout (decoding a large body, rendering
    and bounding a large chat): one thread at a time. More would not run together anyway,
    only take turns with each other and with the event loop for the GIL, and a thread the
    OS preempts while holding it stalls the loop; with one, 8 concurrent 1.6 MB prompts
    lag the loop about half as much at worst, and take about 10 % longer in all."""
    return trio.CapacityLimiter(1)


def context_limit(catalog: Catalog) -> int | None:
    """The largest context a serving engine offers; None if one has no limit, or none serves."""
    limits = [engine.context_length for engine in catalog.engines]
    if not limits or None in limits:
        return None
    return max(limit for limit in limits if limit is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class Tokenizing:
    """How a daemon tokenizes: its model, the fleet it serves, its limiters (shared by all
    requests: tokenizing, and rendering with bounding).

    Made once per daemon (per model). The fleet's largest context
    (:func:`context_limit`) is read only for a large prompt, the one case that needs it.
    """

    text_model: TextModel
    catalog: Callable[[], Catalog]  # the catalog in force
    limiter: trio.CapacityLimiter = dataclasses.field(default_factory=new_tokenize_limiter)
    #: repeated identical prompts are rendered and tokenized once (pipeline/prompt_cache.py)
    prompts: PromptCache = dataclasses.field(default_factory=PromptCache)
    #: rendered chats, for the prefix the next turn of their conversation shares
    prefixes: PrefixCache = dataclasses.field(default_factory=PrefixCache)
    #: the template's output over conversations' earlier messages, for their next turn's
    turns: TurnCache = dataclasses.field(default_factory=TurnCache)
    #: chats of fewer messages are rendered whole (:data:`TURNS_MIN_MESSAGES`)
    turns_min_messages: int = TURNS_MIN_MESSAGES
    #: chats shorter than this are tokenized whole (:data:`PREFIX_MIN_CHARS`)
    prefix_min_chars: int = PREFIX_MIN_CHARS
    #: how the model takes images (None: it takes none)
    media: MediaProfile | None = None
    #: rendering and bounding a large chat (:func:`new_holding_limiter`)
    holding: trio.CapacityLimiter = dataclasses.field(default_factory=new_holding_limiter)

    @property
    def inline_chars(self) -> int:
        """Texts shorter than this are tokenized on the event loop."""
        return INLINE_CHARS_FAST if self.text_model.encoder.fast else INLINE_CHARS

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread, under the daemon's limiter."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def render_off_loop(self, request: ChatRequest, add_generation_prompt: bool
                              ) -> tuple[str, list[int] | None]:
        """:meth:`render_bounded` in a worker thread, one at a time (it holds the GIL)."""
        return await trio.to_thread.run_sync(self.render_bounded, request,
                                             add_generation_prompt, limiter=self.holding)

    def refuse_beyond(self, text: str, known: int, param: str) -> None:
        """A 400 when ``known`` tokens and ``text``'s certainly exceed the fleet's context."""
        limit = context_limit(self.catalog())
        if limit is not None and known + len(text) >= limit:  # else no bound can prove it
            fewest = known + self.text_model.fewest_tokens(text, limit - known)
            if fewest >= limit:
                raise context_length_exceeded(fewest, limit, param, at_least=True)

    async def encode(self, text: str, param: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (a new list); a 400 without tokenizing when it certainly
        cannot fit."""
        if len(text) < self.inline_chars:
            return self.text_model.encode(text, add_special_tokens=add_special_tokens)
        return await self.off_loop(self._encode_large, text, param, add_special_tokens)

    def _encode_large(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        self.refuse_beyond(text, 0, param)
        return self.text_model.encoder.encode_batch([text],
                                                    add_special_tokens=add_special_tokens)[0]

    async def encode_ids(self, text: str, param: str, *, add_special_tokens: bool
                         ) -> PromptIds:
        """:meth:`encode` as :class:`PromptIds`: the ids of a text of
        :data:`RAW_MIN_CHARS` or more are never made ints."""
        if len(text) < min(RAW_MIN_CHARS, self.inline_chars):
            return PromptIds(self.text_model.encode(text,
                                                    add_special_tokens=add_special_tokens))
        if len(text) < self.inline_chars:
            raw, _ = self.text_model.encoder.encode_batch_raw(
                [text], add_special_tokens=add_special_tokens)
            return PromptIds(raw)
        return PromptIds(await self.off_loop(self._encode_large_raw, text, param,
                                             add_special_tokens))

    def _encode_large_raw(self, text: str, param: str, add_special_tokens: bool) -> bytes:
        self.refuse_beyond(text, 0, param)
        raw, _ = self.text_model.encoder.encode_batch_raw([text],
                                                          add_special_tokens=add_special_tokens)
        return raw

    def encode_rest(self, pieces: list[str], known: int) -> tuple[bytes, list[int]]:
        """The ids of a chat's pieces after ``known`` tokens, once the bound allows, as
        u32 bytes and each piece's count (a worker thread's call)."""
        self.refuse_beyond("".join(pieces), known, "messages")
        return self.text_model.encoder.encode_batch_raw(pieces)

    def cuts(self, prompt: str) -> list[int] | None:
        """A rendered chat's cuts (text/encoder.py ``boundaries``); one that begins with a
        kept prompt (a conversation's previous turn) takes that one's and scans only the
        rest. Reads the prefix cache: on the event loop only."""
        encoder = self.text_model.encoder
        if len(prompt) < self.prefix_min_chars:  # (never kept, nor does it extend a kept one)
            return encoder.boundaries(prompt)
        # (the cuts of its first HEAD_CHARS, exact for added tokens shorter than that many more)
        early = encoder.boundaries(prompt[: 2 * HEAD_CHARS])
        earlier = None if early is None else self.prefixes.extended_by(prompt, early)
        if earlier is None:
            return encoder.boundaries(prompt)
        return encoder.boundaries_after(prompt, len(earlier.text), earlier.cuts)

    def render_bounded(self, request: ChatRequest, add_generation_prompt: bool
                       ) -> tuple[str, list[int] | None]:
        """:func:`render`, then a 400 if the prompt certainly cannot fit (a worker thread's
        call: a refused prompt leaves the thread as an error, its text gone)."""
        prompt, cuts = render(self.text_model, request, add_generation_prompt)
        self.refuse_beyond(prompt, 0, "messages")
        return prompt, cuts


def message_dict(message: ChatMessage) -> dict[str, object]:
    """The HF chat-template view of one message."""
    out: dict[str, object] = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning:
        # under both names templates read it by: reasoning_content (Qwen3, GLM, DeepSeek),
        # thinking (gpt-oss); each renders it where its model expects it, or not at all
        out["reasoning_content"] = out["thinking"] = message.reasoning
    return out


def chat_chars(request: ChatRequest) -> int:
    """The characters a chat's messages bring to its prompt (its size before rendering)."""
    total = 0
    for m in request.messages:
        total += len(m.content or "") + len(m.reasoning or "")
        for call in m.tool_calls:
            total += len(call.function.arguments)
    return total


def render(text_model: TextModel, request: ChatRequest, add_generation_prompt: bool,
           tokenizing: Tokenizing | None = None, size: int = 0) -> tuple[str, list[int] | None]:
    """A chat's prompt text and its cuts (text/encoder.py ``boundaries``); a template
    failure is the client's 400.

    With ``tokenizing`` (on the event loop only), a chat of
    :attr:`Tokenizing.turns_min_messages` messages or more that hold ``size``
    characters, :attr:`Tokenizing.prefix_min_chars` or more, renders only the messages
    after those a recent render began with (pipeline/render_cache.py), and the cuts
    come from :meth:`Tokenizing.cuts`: a conversation's next prompt scans only what
    follows its previous one.
    """
    tools: list[dict[str, object]] | None = (
        [{"type": t.type, "function": function_dict(t)} for t in request.tools]
        if request.offers_tools else None)
    try:
        split = (None if tokenizing is None or size < tokenizing.prefix_min_chars
                 or len(request.messages) < tokenizing.turns_min_messages
                 else text_model.split_template(tools))
        if split is not None:
            assert tokenizing is not None
            prompt = render_turns(tokenizing.turns, text_model, split, request.messages,
                                  message_dict, tools, request.tools if tools else (),
                                  request.chat_template_kwargs, add_generation_prompt)
        else:
            prompt = text_model.render_chat(
                [message_dict(m) for m in request.messages],
                add_generation_prompt=add_generation_prompt, tools=tools,
                extra=request.chat_template_kwargs,
            )
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None
    if tokenizing is None:
        return prompt, text_model.encoder.boundaries(prompt)
    return prompt, tokenizing.cuts(prompt)


async def chat_ids(tokenizing: Tokenizing, prompt: str, cuts: list[int]) -> PromptIds:
    """A rendered chat's ids, taking the prefix it shares with a recent one from that one's,
    and kept for the next turn's.

    The prompt is tokenized piece by piece between its cuts (one call: the
    encoder works on the pieces at once), which gives its ids at every cut.
    """
    reuse = tokenizing.prefixes.find(prompt, cuts)
    start = 0 if reuse is None else reuse.cut
    first = bisect.bisect_left(cuts, start)
    if reuse is not None and reuse.entry.cuts[:first] != cuts[:first]:
        reuse, start, first = None, 0, 0  # (cannot happen: the same text before a shared cut)
    ends = [*cuts[first:], len(prompt)]
    lead = 0 if cuts[first:first + 1] == [start] else 1  # a piece before the first cut
    if lead:
        ends.insert(0, start)
    pieces = [prompt[a:b] for a, b in itertools.pairwise(ends)]
    known = 0 if reuse is None else reuse.tokens
    if len(prompt) - start < tokenizing.inline_chars:
        raw, sizes = tokenizing.text_model.encoder.encode_batch_raw(pieces)
    else:
        raw, sizes = await tokenizing.off_loop(tokenizing.encode_rest, pieces, known)
    counts = [] if reuse is None else reuse.entry.counts[:first]
    total = known
    for k, size in enumerate(sizes):
        if k >= lead:  # piece k starts at a cut
            counts.append(total)
        total += size
    if reuse is None:
        ids = PromptIds(raw, keep_encoded=True)
    else:
        earlier = reuse.entry.ids
        whole, known = joined(earlier, known, raw)
        ids = PromptIds(whole, earlier.chains, known, encoded_source=earlier.encoded,
                        keep_encoded=True)
    # kept even when no engine can hold it: a Responses chat with truncation "auto" is cut to
    # fit, not refused, and its next turn shares this prefix
    tokenizing.prefixes.put(Rendered(prompt, ids, cuts, counts),
                            None if reuse is None else reuse.entry)
    return ids


def joined(earlier: PromptIds, known: int, rest: bytes) -> tuple[bytes, int]:
    """The first ``known`` ids of ``earlier`` and then ``rest`` (u32 bytes), and how many
    ids they share with ``earlier`` from its start.

    Where ``rest`` begins with the rest of ``earlier`` (a conversation's next
    turn, after the generation prompt the last one ended with), the ids are
    ``earlier`` whole and what follows, and all of ``earlier`` is shared.
    """
    raw = earlier.raw
    tail = len(raw) - 4 * known
    if tail <= len(rest) and rest.startswith(memoryview(raw)[4 * known:]):  # (a memcmp)
        return raw + rest[tail:], len(earlier)
    return raw[:4 * known] + rest, known


def function_dict(tool: object) -> dict[str, object]:
    fn = tool.function  # type: ignore[attr-defined]
    out: dict[str, object] = {"name": fn.name}
    if fn.description is not None:
        out["description"] = fn.description
    if fn.parameters is not None:
        out["parameters"] = fn.parameters
    return out
