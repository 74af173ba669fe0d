"""The public, normalised requests the pipeline works from (frozen, already validated)."""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from direct_frontend.engines.neutral import Constraint, SamplingOptions
from direct_frontend.multimodal.parts import ImagePart

Role = Literal["system", "user", "assistant", "tool", "developer"]
ROLES: Final = ("system", "user", "assistant", "tool", "developer")

#: what a request's ``service_tier`` may ask for (OpenAI's values)
ServiceTier = Literal["auto", "default", "flex", "priority"]
SERVICE_TIERS: Final = ("auto", "default", "flex", "priority")
#: the tier a request is served at, first served first
Tier = Literal["priority", "default", "flex"]
TIERS: Final[tuple[Tier, ...]] = ("priority", "default", "flex")


class ToolCallFunction(msgspec.Struct, frozen=True):
    """The function an assistant message called; ``arguments`` is a JSON string."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call in an earlier assistant message (history sent back by the client)."""

    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class FunctionDefinition(msgspec.Struct, frozen=True, kw_only=True):
    """A tool's declaration, passed through to the chat template as is."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of ``tools``."""

    function: FunctionDefinition
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A validated chat message.

    ``content`` is the text, with the text parts of an array content joined by
    ``"\\n"`` (as vLLM does for string-format templates); ``content_parts`` keeps
    the parts in order, texts and images, for templates that iterate them. ``content``
    is ``None`` only for an assistant message that carries tool calls and no text.
    """

    role: Role
    content: str | None
    content_parts: tuple[str | ImagePart, ...] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    #: an assistant turn's reasoning, for templates that render it (within a tool loop)
    reasoning: str | None = None

    @property
    def images(self) -> tuple[ImagePart, ...]:
        """Its image parts, in order."""
        parts = self.content_parts
        if not parts:
            return ()
        return tuple(p for p in parts if isinstance(p, ImagePart))


class _RequestBase(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by both endpoints.

    Sampling fields are ``None`` when the client did not set them, so a layer
    that knows the model's generation defaults can still tell "unset" from an
    explicit value; :meth:`sampling_options` applies OpenAI defaults to the rest.
    """

    model: str
    max_tokens: int | None = None  # max_completion_tokens wins over max_tokens
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 and 0 both mean disabled
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    continuous_usage_stats: bool = False  # stream_options.continuous_usage_stats (vLLM's)
    skip_special_tokens: bool = True
    user: str | None = None  # a routing key or the tenant where configured; else not used
    #: OpenAI's stable id of the end user (the tenant where ``[frontend.tenants] field`` says)
    safety_identifier: str | None = None
    #: the tier asked for; once admitted, the tier it is served at (what the response reports)
    service_tier: ServiceTier | None = None
    #: OpenAI's key for requests that share a cache: a routing key where session_key names it
    prompt_cache_key: str | None = None
    #: the most tokens the reply may spend in its reasoning block (None: unset, -1: no
    #: limit); the relay closes the block there (pipeline/relay.py), vLLM's field
    thinking_token_budget: int | None = None

    @property
    def thinking_limit(self) -> int | None:
        """The reasoning budget the relay keeps (None: no limit)."""
        budget = self.thinking_token_budget
        return budget if budget is not None and budget >= 0 else None
    n: int = 1  # choices: each one its own engine call (pipeline/choices.py)
    #: top alternatives per output token with its logprob (None: no logprobs)
    logprobs: int | None = None
    #: likewise per prompt token (completions ``echo`` with ``logprobs``)
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # sorted by token id
    constraint: Constraint | None = None  # structured output (openai/structured.py)

    def sampling_options(self, max_tokens: int) -> SamplingOptions:
        """The neutral sampling settings; ``max_tokens`` is the budget the caller settled on.

        The caller decides the budget because it depends on the prompt length
        and the engine's context length, which this layer does not know.
        """
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=self.logit_bias,
            skip_special_tokens=self.skip_special_tokens,
            constraint=self.constraint,
        )


class ChatRequest(_RequestBase, frozen=True, kw_only=True):
    """A validated ``POST /v1/chat/completions`` body.

    ``tools`` go to the chat template (not with ``tool_choice: "none"``) and to
    the output parser. ``tool_function`` is the function a named
    ``tool_choice`` forces; a forced call (``"required"`` or named) also sets
    ``constraint`` (:mod:`~direct_frontend.openai.parsers.forced`).
    """

    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: Literal["auto", "none", "required"] = "auto"
    tool_function: str | None = None  # set: tool_choice named this function
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # false: reasoning is parsed off and not sent
    chat_template_kwargs: dict[str, Any] | None = None
    #: as the client asked (also a template variable); a model may keep it as a thinking budget
    reasoning_effort: str | None = None

    @property
    def images(self) -> tuple[ImagePart, ...]:
        """Every image of its messages, in order."""
        return tuple(image for m in self.messages if m.content_parts for image in m.images)

    @property
    def offers_tools(self) -> bool:
        """Whether the template and the parser see the tools."""
        return bool(self.tools) and self.tool_choice != "none"


Prompt = str | tuple[int, ...]


class CompletionRequest(_RequestBase, frozen=True, kw_only=True):
    """A validated ``POST /v1/completions`` body; ``prompt`` is text or token ids.

    A batch of prompts is ``prompt`` (the first) and ``more_prompts`` (the
    rest): each prompt is a request of its own with the same fields
    (:meth:`each_prompt`), and the response holds ``n`` choices per prompt.
    """

    prompt: Prompt
    more_prompts: tuple[Prompt, ...] = ()
    echo: bool = False  # the prompt leads the output text

    def each_prompt(self) -> tuple[CompletionRequest, ...]:
        """The batch as requests of one prompt each, in order (itself when it is one)."""
        if not self.more_prompts:
            return (self,)
        return tuple(msgspec.structs.replace(self, prompt=prompt, more_prompts=())
                     for prompt in (self.prompt, *self.more_prompts))


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated ``POST /v1/embeddings`` body: one input or several, each text or token ids."""

    model: str
    inputs: tuple[Prompt, ...]
    encoding_format: Literal["float", "base64"] = "float"
    #: the length the client wants; served only when it is the model's own (no truncation)
    dimensions: int | None = None
    user: str | None = None  # the tenant where ``[frontend.tenants] field`` says; else not used
    #: not OpenAI's on embeddings: a batch line's (the Batch API runs its lines at ``flex``)
    service_tier: ServiceTier | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated ``POST /tokenize`` body (vLLM's): a prompt, or a chat to render first."""

    model: str
    prompt: str | None = None
    chat: ChatRequest | None = None  # its messages, tools and template variables
    add_special_tokens: bool = True  # a chat's default is False: its template writes them
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated ``POST /detokenize`` body (vLLM's)."""

    model: str
    tokens: tuple[int, ...]


def served_tier(request: ChatRequest | CompletionRequest) -> Tier:
    """The tier a request is served at, once admission has set it (pipeline/admission.py
    ``Admission.tier``; ``default`` for one that never went through it)."""
    tier = request.service_tier
    return tier if tier in TIERS else "default"
