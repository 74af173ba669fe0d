"""Request validation for ``/v1/chat/completions`` and ``/v1/completions``.

Bodies are decoded in one pass by msgspec into private *wire* structs (which
check types and ranges, and ignore unknown fields since OpenAI clients send
extras), then checked for what we do not support and normalised into frozen
public requests (:mod:`.types`). Every failure is an
:class:`~direct_frontend.openai.errors.OpenAIHTTPError`.

Numeric bounds are the OpenAI API's documented ranges where it has them, else
the widest type any engine contract carries the field in (docs/engine-contracts.md:
token counts and ids are uint32 everywhere, floats are float32); each engine
kind's dialect refuses what its own contract cannot carry. Bodies are read
by :func:`~direct_frontend.openai.body.decode_body`, which also refuses one
nested too deep.
"""

from __future__ import annotations

import json
import operator
from typing import Annotated, Any, Final, Literal

import msgspec

from direct_frontend.engines.neutral import (
    FLOAT32_MAX,
    INT32_MAX,
    UINT32_MAX,
    Constraint,
    ConstraintKind,
)
from direct_frontend.multimodal.parts import DETAILS, ImagePart
from direct_frontend.openai.body import decode_body
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.parsers.forced import named_call_schema, required_calls_schema
from direct_frontend.openai.structured import EXTENSIONS, constraint_of
from direct_frontend.openai.types import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    Prompt,
    Role,
    ServiceTier,
    TokenizeRequest,
    Tool,
    ToolCall,
)

_Count = Annotated[int, msgspec.Meta(ge=1, le=UINT32_MAX)]
_NonNegCount = Annotated[int, msgspec.Meta(ge=0, le=UINT32_MAX)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=UINT32_MAX)]
_Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
_Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
_Choices = Annotated[int, msgspec.Meta(ge=1, le=128)]  # OpenAI: n is 1..128
_MAX_STOP: Final = 16
#: Characters in all of a request's stop strings together (README, "HTTP API"). Matching
#: is linear in it, but every request's matcher holds it, so client input stays bounded.
MAX_STOP_CHARS: Final = 8192


class _ImageUrlWire(msgspec.Struct):
    url: str
    detail: str | None = None


class _ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: _ImageUrlWire | str | None = None
    #: where the part was in the body the client sent, set by the Anthropic and Responses
    #: translations (openai/messages_api.py, responses_api.py) so a refusal names it
    where: str | None = msgspec.field(default=None, name="x_direct_frontend_param")


class _MessageWire(msgspec.Struct):
    role: Role
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    # an assistant turn's reasoning, sent back as our answers carry it (vLLM's newer name too)
    reasoning_content: str | None = None
    reasoning: str | None = None


class _StreamOptionsWire(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk


class _FunctionNameWire(msgspec.Struct):
    name: str


class _NamedToolChoiceWire(msgspec.Struct):
    """``{"type": "function", "function": {"name": …}}`` (the Responses API: ``"name"`` at top)."""

    type: str
    function: _FunctionNameWire | None = None
    name: str | None = None


class _WireBase(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: _Count | None = None
    max_completion_tokens: _Count | None = None
    min_tokens: _NonNegCount | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=UINT32_MAX)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    frequency_penalty: _Penalty | None = None
    presence_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=FLOAT32_MAX)] | None = None
    seed: _Int64 | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=_MAX_STOP)] | None = None
    stop_token_ids: list[_TokenId] | None = None
    ignore_eos: bool | None = None
    n: _Choices | None = None
    stream: bool | None = None
    stream_options: _StreamOptionsWire | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    thinking_token_budget: Annotated[int, msgspec.Meta(ge=-1, le=UINT32_MAX)] | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs (openai/structured.py): response_format and the engines' extensions
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    regex: str | None = None
    guided_grammar: str | None = None
    ebnf: str | None = None
    guided_choice: list[str] | None = None
    structural_tag: dict[str, Any] | str | None = None


class _ChatWire(_WireBase, kw_only=True):
    messages: Annotated[list[_MessageWire], msgspec.Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None  # OpenAI: 0..20
    tools: list[Tool] | None = None
    tool_choice: str | _NamedToolChoiceWire | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _CompletionWire(_WireBase, kw_only=True):
    #: 0 with ``echo``: the prompt alone, scored (OpenAI's legacy API; what vLLM does too)
    max_tokens: _NonNegCount | None = None
    prompt: str | list[Any]
    logprobs: bool | Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None  # OpenAI: 0..5
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=20)] | None = None  # OpenAI: up to 20


class _EmbeddingWire(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: _Count | None = None
    user: str | None = None
    service_tier: ServiceTier | None = None


class _TokenizeWire(msgspec.Struct, kw_only=True):
    model: str
    prompt: str | None = None
    messages: Annotated[list[_MessageWire], msgspec.Meta(min_length=1)] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class _DetokenizeWire(msgspec.Struct, kw_only=True):
    model: str
    tokens: list[_TokenId]


_chat_decoder: Final = msgspec.json.Decoder(_ChatWire)
_completion_decoder: Final = msgspec.json.Decoder(_CompletionWire)
_embedding_decoder: Final = msgspec.json.Decoder(_EmbeddingWire)
_tokenize_decoder: Final = msgspec.json.Decoder(_TokenizeWire)
_detokenize_decoder: Final = msgspec.json.Decoder(_DetokenizeWire)

def _unsupported(what: str, param: str) -> OpenAIHTTPError:
    return invalid_request(f"{what} is not supported yet.", param)


_EXTENSION_NAMES: Final = tuple(name for name, _ in EXTENSIONS)
#: a body's :data:`EXTENSIONS` fields, read at once (a tuple, None where unset)
_EXTENSION_VALUES: Final = operator.attrgetter(*_EXTENSION_NAMES)


def _common(w: _WireBase) -> dict[str, Any]:
    """Checks shared by both endpoints; returns the normalised shared fields."""
    stream = bool(w.stream)
    if w.stream_options is not None and not stream:
        raise invalid_request(
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            "stream_options",
        )
    extensions = _EXTENSION_VALUES(w)
    constraint = None if (  # none asked for (the usual case): nothing to read
        w.response_format is None and w.structured_outputs is None
        and extensions.count(None) == len(extensions)
    ) else constraint_of(
        w.response_format,
        w.structured_outputs,
        dict(zip(_EXTENSION_NAMES, extensions, strict=True)),
    )
    if isinstance(w.stop, str):
        stop: tuple[str, ...] = (w.stop,)
        stop_param = "stop"
    else:
        stop = tuple(w.stop or ())
        stop_param = "stop[{}]"
    for i, s in enumerate(stop):
        if not s:
            raise invalid_request("Stop strings must not be empty.", stop_param.format(i))
    stop_chars = sum(map(len, stop))
    if stop_chars > MAX_STOP_CHARS:
        raise invalid_request(
            f"Invalid value for 'stop': the stop strings may hold at most {MAX_STOP_CHARS} "
            f"characters in total, got {stop_chars}.",
            "stop",
        )
    max_tokens = w.max_completion_tokens if w.max_completion_tokens is not None else w.max_tokens
    min_tokens = w.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid_request(
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).",
            "min_tokens",
        )
    return {
        "model": w.model,
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "temperature": w.temperature,
        "top_p": w.top_p,
        "top_k": w.top_k,
        "min_p": w.min_p,
        "frequency_penalty": w.frequency_penalty,
        "presence_penalty": w.presence_penalty,
        "repetition_penalty": w.repetition_penalty,
        "seed": w.seed,
        "stop": stop,
        "stop_token_ids": tuple(w.stop_token_ids or ()),
        "ignore_eos": bool(w.ignore_eos),
        "stream": stream,
        "include_usage": bool(w.stream_options and w.stream_options.include_usage),
        "continuous_usage_stats": bool(
            w.stream_options and w.stream_options.continuous_usage_stats
        ),
        "logit_bias": _logit_bias(w.logit_bias),
        "constraint": constraint,
        "skip_special_tokens": w.skip_special_tokens is not False,
        "user": w.user,
        "safety_identifier": w.safety_identifier,
        "service_tier": w.service_tier,
        "prompt_cache_key": w.prompt_cache_key,
        # -1: no limit, as vLLM reads it (kept: it also overrides the model's default)
        "thinking_token_budget": w.thinking_token_budget,
        "n": w.n or 1,
    }


#: OpenAI's range for a logit bias
LOGIT_BIAS_LIMIT: Final = 100.0


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"<token id>": bias}`` as (id, bias) pairs sorted by id; a 400 naming the key.

    An id is at most ``INT32_MAX``: vocabulary sizes are int32, and vLLM's contract keys the
    biases by int32 (a larger key would be a protobuf overflow, not a 400)."""
    if not raw:
        return ()
    pairs = []
    for key, bias in raw.items():
        param = f"logit_bias.{key}"
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token <= INT32_MAX:
            raise invalid_request(
                f"Invalid key in 'logit_bias': '{key}' is not a token id (an integer from 0 "
                f"to {INT32_MAX}).",
                param,
            )
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise invalid_request(
                f"Invalid value for '{param}': a bias is from -100 to 100, got {bias}.", param
            )
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _image_part(part: _ContentPart, where: str) -> ImagePart:
    """An ``image_url`` part (its URL as an object's ``url``, or the string itself)."""
    raw = part.image_url
    if raw is None:
        raise invalid_request(f"Missing required parameter: '{where}.image_url'.",
                              f"{where}.image_url")
    url, detail = (raw, None) if isinstance(raw, str) else (raw.url, raw.detail)
    if detail is not None and detail not in DETAILS:
        raise invalid_request(
            f"Invalid value for '{where}.image_url.detail': '{detail}'; expected one of "
            f"{', '.join(DETAILS)}.", f"{where}.image_url.detail",
        )
    if not url:
        raise invalid_request(f"'{where}.image_url.url' must not be empty.",
                              f"{where}.image_url.url")
    return ImagePart(url=url, detail=detail or "auto",  # type: ignore[arg-type]
                     param=part.where or f"{where}.image_url")


def _message(i: int, m: _MessageWire) -> ChatMessage:
    parts: tuple[str | ImagePart, ...] | None = None
    if m.content is None or isinstance(m.content, str):
        content = m.content
    else:
        texts: list[str] = []
        items: list[str | ImagePart] = []
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "image_url" and m.role == "user":
                items.append(_image_part(part, where))
                continue
            if part.type != "text":
                only = "'text' and 'image_url'" if m.role == "user" else "'text'"
                raise invalid_request(
                    f"Content part type '{part.type}' is not supported; only {only} parts are.",
                    f"{where}.type",
                )
            if part.text is None:
                raise invalid_request(
                    f"Missing required parameter: '{where}.text'.", f"{where}.text"
                )
            texts.append(part.text)
            items.append(part.text)
        parts = tuple(items)
        content = "\n".join(texts)
    if content is None and m.role != "assistant":
        raise invalid_request(
            f"Missing required parameter: 'messages[{i}].content' (required for role '{m.role}').",
            f"messages[{i}].content",
        )
    return ChatMessage(
        role=m.role,
        content=content if content is not None or m.tool_calls else "",
        content_parts=parts,
        name=m.name,
        tool_calls=m.tool_calls or (),
        tool_call_id=m.tool_call_id,
        reasoning=(m.reasoning_content if m.reasoning_content is not None else m.reasoning)
        if m.role == "assistant" else None,
    )


def parse_chat_request(body: bytes) -> ChatRequest:
    """Validate a chat completions body; raises :class:`OpenAIHTTPError` (400) on any problem."""
    w = decode_body(_chat_decoder, body)
    common = _common(w)
    if w.top_logprobs is not None and not w.logprobs:
        raise invalid_request(
            "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs"
        )
    tools = tuple(w.tools or ())
    tool_choice, function, forced = tool_choice_of(w.tool_choice, tools,
                                                   w.parallel_tool_calls is not False)
    if forced is not None:
        # A response format shapes a message's text, and a forced turn answers with a call
        # (OpenAI's own reading; vLLM's server drops the format too): the call's constraint
        # wins. An engine-level constraint (guided_json, regex, ...) would shape the call.
        given = common["constraint"]
        if given is not None and given.param != "response_format":
            raise invalid_request(
                f"A forced tool call cannot be combined with '{given.param}'.", "tool_choice",
            )
        common["constraint"] = forced
    template_kwargs = w.chat_template_kwargs
    if w.reasoning_effort is not None:  # templates that take it (gpt-oss) read it from here
        template_kwargs = {"reasoning_effort": w.reasoning_effort, **(template_kwargs or {})}
    return ChatRequest(
        **common,
        messages=tuple(_message(i, m) for i, m in enumerate(w.messages)),
        tools=tools,
        tool_choice=tool_choice,
        tool_function=function,
        parallel_tool_calls=w.parallel_tool_calls is not False,
        include_reasoning=w.include_reasoning is not False,
        chat_template_kwargs=template_kwargs,
        reasoning_effort=w.reasoning_effort,
        logprobs=(w.top_logprobs or 0) if w.logprobs else None,
    )


ToolChoice = Literal["auto", "none", "required"]


def tool_choice_of(
    raw: str | _NamedToolChoiceWire | None, tools: tuple[Tool, ...], parallel: bool,
) -> tuple[ToolChoice, str | None, Constraint | None]:
    """``tool_choice`` as (mode, the function a named choice forces, the constraint forcing it).

    Forced calls (``"required"``, a named function) are constrained to the
    JSON shapes of :mod:`~direct_frontend.openai.parsers.forced`, as vLLM's
    own server does, so they are well-formed by construction.
    """
    if raw is None or raw == "auto":
        return "auto", None, None
    if raw == "none":
        return "none", None, None
    if isinstance(raw, str) and raw != "required":
        raise invalid_request(
            f"Invalid value for 'tool_choice': '{raw}'; expected 'none', 'auto', "
            "'required' or an object.",
            "tool_choice",
        )
    if not tools:
        raise invalid_request("'tool_choice' forces a tool call but no 'tools' are given.",
                              "tool_choice")
    if raw == "required":
        schema = required_calls_schema(tools, parallel)
        return "required", None, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema),
                                            param="tool_choice")
    assert isinstance(raw, _NamedToolChoiceWire)
    name = raw.function.name if raw.function is not None else raw.name
    if raw.type != "function" or name is None:
        raise invalid_request(
            "Invalid value for 'tool_choice': a named choice is "
            '{"type": "function", "function": {"name": ...}}.', "tool_choice",
        )
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise invalid_request(
            f"Invalid value for 'tool_choice': no tool named '{name}' in 'tools'.", "tool_choice"
        )
    return "required", name, Constraint(ConstraintKind.JSON_SCHEMA,
                                        json.dumps(named_call_schema(tool)), param="tool_choice")


#: the most engine calls one completions request makes (prompts × n)
MAX_BATCH_CALLS: Final = 2048


def _prompts(raw: str | list[Any], param: str = "prompt") -> tuple[Prompt, ...]:
    """One prompt or a batch: text, token ids, a list of texts or a list of token-id lists.

    ``param`` names the field in errors (completions' ``prompt``, embeddings' ``input``).
    """
    if isinstance(raw, str):
        return (raw,)
    if not raw:
        raise invalid_request(f"'{param}' must not be empty.", param)
    first = raw[0]
    if not isinstance(first, str | list):
        return (_token_ids(raw, param),)  # one prompt of token ids
    prompts: list[Prompt] = []
    for k, item in enumerate(raw):
        where = f"{param}[{k}]"
        if isinstance(first, str) and isinstance(item, str):
            if not item and len(raw) > 1:
                raise invalid_request(f"'{where}' must not be empty.", where)
            prompts.append(item)
        elif isinstance(first, list) and isinstance(item, list):
            prompts.append(_token_ids(item, where))
        else:
            expected = "a string" if isinstance(first, str) else "a list of token ids"
            raise invalid_request(
                f"Invalid type for '{where}': a batch is all strings or all lists of token "
                f"ids; expected {expected}, as '{param}[0]' is.",
                where,
            )
    return tuple(prompts)


_INT = {int}  # a token id's exact type (a bool is not one)


def _token_ids(ids: list[Any], where: str) -> tuple[int, ...]:
    if not ids:
        raise invalid_request(f"'{where}' must not be empty.", where)
    if set(map(type, ids)) == _INT and min(ids) >= 0 and max(ids) <= UINT32_MAX:
        return tuple(ids)  # every id checked at once, in C: the usual case
    for k, tok in enumerate(ids):
        if type(tok) is not int or tok < 0:
            raise invalid_request(
                f"Invalid type for '{where}[{k}]': expected a string, a list of strings, "
                "a list of token ids (integers >= 0) or a list of such lists.",
                f"{where}[{k}]",
            )
        if tok > UINT32_MAX:
            raise invalid_request(
                f"Invalid value for '{where}[{k}]': a token id is an integer from 0 to "
                f"{UINT32_MAX}, got {tok}.",
                f"{where}[{k}]",
            )
    return tuple(ids)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Validate a (legacy) completions body; raises :class:`OpenAIHTTPError` (400)."""
    w = decode_body(_completion_decoder, body)
    common = _common(w)
    if w.logprobs is True:
        raise invalid_request(
            "Invalid type for 'logprobs': expected an integer from 0 to 5 (the number of "
            "top alternatives per token), got a boolean.",
            "logprobs",
        )
    logprobs = None if w.logprobs is None or w.logprobs is False else w.logprobs
    if w.suffix:
        raise _unsupported("suffix", "suffix")
    if common["max_tokens"] == 0 and not w.echo:
        raise invalid_request(
            "Invalid value for 'max_tokens': 0 is allowed only with 'echo' (the prompt alone, "
            "with its logprobs if asked for); otherwise it must be at least 1.",
            "max_tokens",
        )
    n = common["n"]
    if w.best_of is not None and w.best_of < n:
        raise invalid_request(f"best_of ({w.best_of}) must not be less than n ({n}).", "best_of")
    if w.best_of is not None and w.best_of != n:
        raise invalid_request(
            f"best_of={w.best_of} is not supported; only best_of equal to n ({n}) is.",
            "best_of",
        )
    prompts = _prompts(w.prompt)
    if len(prompts) * n > MAX_BATCH_CALLS:
        raise invalid_request(
            f"Invalid value for 'prompt': {len(prompts)} prompts of n={n} choices each make "
            f"{len(prompts) * n} engine calls; at most {MAX_BATCH_CALLS} are allowed.",
            "prompt",
        )
    return CompletionRequest(
        **common, prompt=prompts[0], more_prompts=prompts[1:], echo=bool(w.echo),
        logprobs=logprobs, prompt_logprobs=logprobs if w.echo else None,
    )


#: the most inputs one embeddings request may hold (OpenAI's limit)
MAX_EMBEDDING_INPUTS: Final = 2048


def parse_embedding_request(body: bytes) -> EmbeddingRequest:
    """Validate a ``POST /v1/embeddings`` body; raises :class:`OpenAIHTTPError` (400)."""
    w = decode_body(_embedding_decoder, body)
    inputs = _prompts(w.input, "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise invalid_request(
            f"Invalid value for 'input': {len(inputs)} inputs; at most "
            f"{MAX_EMBEDDING_INPUTS} are allowed.",
            "input",
        )
    for k, one in enumerate(inputs):
        if not one:
            where = "input" if len(inputs) == 1 else f"input[{k}]"
            raise invalid_request(f"'{where}' must not be empty.", where)
    return EmbeddingRequest(
        model=w.model, inputs=inputs, encoding_format=w.encoding_format or "float",
        dimensions=w.dimensions, user=w.user, service_tier=w.service_tier,
    )


def parse_tokenize_request(body: bytes) -> TokenizeRequest:
    """Validate a ``POST /tokenize`` body: exactly one of ``prompt`` and ``messages``."""
    w = decode_body(_tokenize_decoder, body)
    if (w.prompt is None) == (w.messages is None):
        raise invalid_request("Send exactly one of 'prompt' and 'messages'.",
                              "messages" if w.messages is not None else "prompt")
    chat = None
    if w.messages is not None:
        chat = ChatRequest(
            model=w.model, messages=tuple(_message(i, m) for i, m in enumerate(w.messages)),
            tools=tuple(w.tools or ()), chat_template_kwargs=w.chat_template_kwargs,
        )
    return TokenizeRequest(
        model=w.model, prompt=w.prompt, chat=chat,
        add_special_tokens=(w.add_special_tokens if w.add_special_tokens is not None
                            else chat is None),
        add_generation_prompt=w.add_generation_prompt is not False,
        return_token_strs=bool(w.return_token_strs),
    )


def parse_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Validate a ``POST /detokenize`` body."""
    w = decode_body(_detokenize_decoder, body)
    return DetokenizeRequest(model=w.model, tokens=tuple(w.tokens))
