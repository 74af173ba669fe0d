"""Preprocess: an OpenAI request → token ids, a token budget and the engine call.

How a prompt becomes ids (on the loop or in a worker thread, refused early when it
cannot fit, reusing a recent prompt's prefix) is pipeline/tokenizing.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import msgspec

from direct_frontend.engines.neutral import GenerateCall
from direct_frontend.multimodal.payload import MediaPayload
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    context_length_exceeded,
    invalid_request,
)
from direct_frontend.openai.types import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Prompt,
)
from direct_frontend.pipeline.media import media_prompt, refuse_images
from direct_frontend.pipeline.ratelimit import Charge
from direct_frontend.pipeline.tokenizing import (
    INLINE_CHARS,
    RENDER_INLINE_CHARS,
    Tokenizing,
    chat_chars,
    chat_ids,
    context_limit,
    function_dict,
    message_dict,
    new_holding_limiter,
    new_tokenize_limiter,
    render,
)
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.text.prompt_ids import PromptIds

__all__ = [  # the tokenizing names callers import from here too
    "INLINE_CHARS", "Tokenizing", "context_limit", "message_dict", "new_holding_limiter",
    "new_tokenize_limiter",
]

Kind = Literal["chat", "completion"]


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request ready for dispatch on any engine."""

    kind: Kind
    request_id: str
    request: ChatRequest | CompletionRequest
    input_ids: Sequence[int]
    prompt_text: str
    #: the session's routing key (``[frontend.routing] session_key``), if it carries one
    routing_key: str | None = None
    #: what its output owes its tenant's rate limit (pipeline/ratelimit.py), if it has one:
    #: the relay counts each choice's output into it
    charge: Charge | None = None
    #: a chat's images, preprocessed (pipeline/media.py); ``input_ids`` hold their runs
    media: MediaPayload | None = None

    @property
    def media_keys(self) -> tuple[tuple[str, int, int], ...]:
        """(image hash, offset, length) per image: what keys the KV blocks they fill."""
        return () if self.media is None else self.media.kv_items()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.request.stop_token_ids


async def prepare(
    kind: Kind, request: ChatRequest | CompletionRequest, request_id: str, tokenizing: Tokenizing,
    routing_key: str | None = None,
) -> PreparedRequest:
    """Template and tokenize; template failures are the client's 400."""
    param = _prompt_param(kind)
    ids: Sequence[int]
    media = None
    if isinstance(request, ChatRequest) and request.images:
        prompt, ids, media = await _media_prompt(request, tokenizing)
    elif isinstance(request, ChatRequest):
        prompt, ids = await chat_prompt_ids(request, tokenizing)
    else:
        prompt, ids = await prompt_ids(request.prompt, param, tokenizing)
    if not ids:
        raise invalid_request("the prompt is empty", param)
    return PreparedRequest(kind, request_id, request, _ids(ids), prompt, routing_key,
                           media=media)


async def _media_prompt(
    request: ChatRequest, tokenizing: Tokenizing, *, add_generation_prompt: bool = True,
) -> tuple[str, Sequence[int], MediaPayload]:
    """A chat with images through pipeline/media.py; a 400 if the model takes none."""
    profile = tokenizing.media
    if profile is None or not profile.takes_images:
        raise refuse_images(request.model, request.images)

    async def encode(text: str) -> list[int]:
        return await tokenizing.encode(text, "messages", add_special_tokens=False)

    return await media_prompt(
        request, tokenizing.text_model, profile, [message_dict(m) for m in request.messages],
        [{"type": t.type, "function": function_dict(t)} for t in request.tools]
        if request.offers_tools else None, encode, add_generation_prompt=add_generation_prompt,
    )


async def chat_prompt_ids(
    request: ChatRequest, tokenizing: Tokenizing, *, add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> tuple[str, Sequence[int]]:
    """A chat's messages (and tools) through the chat template, as (prompt text, token ids).

    The template writes the special tokens itself, so the tokenizer adds none
    unless asked. Generation's prompts (the defaults) come from an exact cache;
    a large chat is rendered and tokenized in a worker thread.
    """
    if request.images:  # expanded as generation expands them, so counts agree
        prompt, expanded, _ = await _media_prompt(request, tokenizing,
                                                  add_generation_prompt=add_generation_prompt)
        return prompt, expanded
    text_model = tokenizing.text_model
    cache = tokenizing.prompts
    size = chat_chars(request)
    # (a prompt too long for the exact cache skips its key: the encoding and hashing of it
    # cost ≈ 0.6 ms for 60 kB)
    cacheable = add_generation_prompt and not add_special_tokens and size <= cache.max_entry_chars
    key = None if text_model.templates_read_clock or not cacheable else _chat_key(request)
    hit = None if key is None else cache.get(key)
    if hit is not None:
        return hit
    if size < RENDER_INLINE_CHARS:
        prompt, cuts = render(text_model, request, add_generation_prompt, tokenizing, size)
    else:
        prompt, cuts = await tokenizing.render_off_loop(request, add_generation_prompt)
    ids: Sequence[int]
    if cuts is None or add_special_tokens or len(prompt) < tokenizing.prefix_min_chars:
        ids = await tokenizing.encode_ids(prompt, "messages",
                                          add_special_tokens=add_special_tokens)
    else:
        ids = await chat_ids(tokenizing, prompt, cuts)
    if key is not None:
        cache.put(key, prompt, ids)
    return prompt, ids


async def prompt_ids(
    prompt: Prompt, param: str, tokenizing: Tokenizing, *, cached: bool = True,
) -> tuple[str, Sequence[int]]:
    """A completions prompt or an embeddings input as (its text, its token ids).

    Text is tokenized with the model's special tokens (BOS), as the engines'
    own servers do; token ids are taken as they are, once checked against the
    vocabulary. ``param`` names the field in a 400. ``cached``: through the
    exact prompt cache (not for embeddings inputs, whose many one-off texts
    would push generation's repeated prompts out of it).
    """
    if isinstance(prompt, str):
        cache = tokenizing.prompts
        hit = cache.get(prompt) if cached else None
        if hit is not None:
            return prompt, hit[1]
        ids = await tokenizing.encode_ids(prompt, param, add_special_tokens=True)
        if cached:
            cache.put(prompt, prompt, ids)
        return prompt, ids
    vocab = tokenizing.text_model.vocab_size
    if prompt and (min(prompt) < 0 or max(prompt) >= vocab):  # at C speed, no generator
        raise invalid_request(f"{param} token ids must be in [0, {vocab})", param)
    return "", prompt


async def prepare_each(
    kind: Kind, request: ChatRequest | CompletionRequest, request_id: str,
    tokenizing: Tokenizing, routing_key: str | None = None,
) -> tuple[PreparedRequest, ...]:
    """Every prompt of ``request`` prepared: its one, or each of a completions batch's.

    A batch's prompts share the request id (the response's); a prompt's 400
    names its place in the batch.
    """
    if isinstance(request, ChatRequest) or not request.more_prompts:
        return (await prepare(kind, request, request_id, tokenizing, routing_key),)
    prepared = []
    for k, one in enumerate(request.each_prompt()):
        try:
            prepared.append(await prepare(kind, one, request_id, tokenizing, routing_key))
        except OpenAIHTTPError as err:
            if err.param == "prompt":
                err.param = f"prompt[{k}]"
            raise
    return tuple(prepared)


_chat_key_encoder = msgspec.msgpack.Encoder()


def _chat_key(request: ChatRequest) -> bytes:
    """What decides a chat's rendered prompt, as bytes (chat keys are bytes, prompts str)."""
    return _chat_key_encoder.encode(
        (request.messages, request.tools if request.offers_tools else (),
         request.chat_template_kwargs)
    )


def _ids(ids: Sequence[int]) -> Sequence[int]:
    """``ids`` as a tuple; :class:`PromptIds` as they are (their hash chains go with them)."""
    return ids if isinstance(ids, (tuple, PromptIds)) else tuple(ids)


def _prompt_param(kind: Kind) -> str:
    return "messages" if kind == "chat" else "prompt"


def refuse_beyond_every_engine(counts: Sequence[int], catalog: Catalog, kind: Kind) -> None:
    """A 400 for a prompt of as many tokens as the largest context of ``catalog`` or more:
    :func:`token_budget` would refuse it on every engine, after admission and routing,
    whose work grows with the prompt (block hashes, the KV index, the engine request)."""
    limit = context_limit(catalog)
    longest = max(counts, default=0)
    if limit is not None and longest >= limit:
        raise context_length_exceeded(longest, limit, _prompt_param(kind))


def token_budget(prepared: PreparedRequest, engine: EngineHandle, default_max: int) -> int:
    """How many tokens to ask for on ``engine``; a 400 when the prompt cannot fit.

    An explicit ``max_tokens`` that overflows the context is an error (as in
    OpenAI); an unset one is clamped to what is left of the context.
    """
    prompt = len(prepared.input_ids)
    limit = engine.context_length
    asked = prepared.request.max_tokens
    if limit is None:
        return default_max if asked is None else asked
    if prompt >= limit:
        raise context_length_exceeded(prompt, limit, _prompt_param(prepared.kind))
    if asked is None:
        return min(default_max, limit - prompt)
    if prompt + asked > limit:
        raise OpenAIHTTPError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + asked} tokens ({prompt} in the prompt, {asked} for the completion). "
            "Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked


def build_call(
    prepared: PreparedRequest, max_tokens: int, *, stream: bool, trace: RequestTrace | None = None
) -> GenerateCall:
    return GenerateCall(
        request_id=prepared.request_id,
        input_ids=prepared.input_ids,
        sampling=prepared.request.sampling_options(max_tokens),
        stream=stream,
        trace=trace,
        media=prepared.media,
    )


def droppable_turns(messages: Sequence[ChatMessage]) -> list[tuple[int, int]]:
    """The message ranges ``[start, end)`` a truncation may drop, oldest first.

    System and developer messages stay, and so does the last user message
    with all that follows it (the turn being answered). An assistant message
    and the tool results that answer its calls go together, so no call is left
    without its result or a result without its call.
    """
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages))
    turns: list[tuple[int, int]] = []
    i = 0
    while i < last_user:
        if messages[i].role in ("system", "developer"):
            i += 1
            continue
        end = i + 1
        while end < last_user and messages[end].role == "tool":
            end += 1
        turns.append((i, end))
        i = end
    return turns


async def truncated_to_fit(prepared: PreparedRequest, tokenizing: Tokenizing, limit: int,
                           reserve: int) -> PreparedRequest:
    """The chat with the fewest oldest turns dropped so its prompt and ``reserve`` tokens fit
    ``limit`` (the Responses API's ``truncation: "auto"``); as it was when it fits already.

    Found by bisection over how many of the droppable turns go (fewer turns,
    fewer tokens), so a long conversation is rendered a few times, not once
    per turn. A 400 when even the turn being answered does not fit.
    """
    if len(prepared.input_ids) + reserve <= limit:
        return prepared
    request = prepared.request
    assert isinstance(request, ChatRequest)
    turns = droppable_turns(request.messages)

    async def without(count: int) -> PreparedRequest:
        gone = {i for start, end in turns[:count] for i in range(start, end)}
        kept = tuple(m for i, m in enumerate(request.messages) if i not in gone)
        shorter = msgspec.structs.replace(request, messages=kept)
        media = None
        if shorter.images:  # the images left, placed in the shorter prompt
            prompt, ids, media = await _media_prompt(shorter, tokenizing)
        else:
            prompt, ids = await chat_prompt_ids(shorter, tokenizing)
        return dataclasses.replace(prepared, request=shorter, input_ids=_ids(ids),
                                   prompt_text=prompt, media=media)

    low, high = 1, len(turns)  # the fewest turns to drop lies in [low, high]
    best = await without(high)
    if len(best.input_ids) + reserve > limit:
        raise OpenAIHTTPError(
            400, f"Even with every earlier turn dropped (truncation 'auto'), the input is "
            f"{len(best.input_ids)} tokens and the output may take {reserve}: more than the "
            f"model's context of {limit} tokens.", "invalid_request_error", "input",
            "context_length_exceeded",
        )
    while low < high:
        middle = (low + high) // 2
        candidate = await without(middle)
        if len(candidate.input_ids) + reserve <= limit:
            best, high = candidate, middle
        else:
            low = middle + 1
    return best
