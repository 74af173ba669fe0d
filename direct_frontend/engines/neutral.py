"""The neutral request and event types: the only engine vocabulary above the dialects.

Frozen values (dataclasses, and msgspec structs for the per-message events)
with no I/O, so dispatch, migration and postprocess are tested with data alone.
A dialect turns a :class:`GenerateCall` into its engine's proto and that
engine's stream back into :data:`EngineEvent` items.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from direct_frontend.multimodal.payload import MediaPayload
    from direct_frontend.observability.tracing import RequestTrace

#: the wire types every engine contract uses for counts and token ids (uint32), for
#: context lengths (int32) and for sampling floats (float32): their largest values
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38


class ConstraintKind(enum.Enum):
    """What a structured-output constraint holds; each dialect maps the kinds its contract has."""

    JSON_SCHEMA = "json_schema"  # text: a JSON schema (serialised)
    JSON_OBJECT = "json_object"  # any JSON object; text is empty
    REGEX = "regex"  # text: a regular expression
    GRAMMAR = "grammar"  # text: an EBNF grammar (the engines' grammar backends read it)
    CHOICE = "choice"  # choices: exactly one of these strings
    STRUCTURAL_TAG = "structural_tag"  # text: the structural tag object (serialised)
    #: text: a structural tag (xgrammar's ``{"type": "structural_tag", "format": …}``) that
    #: takes the model's own tool calls or the response format's JSON, for a request with
    #: tools and a response format (pipeline/parsing.py); a kind that cannot enforce one
    #: sends no constraint instead, so the tools stay callable
    TOOLS_OR_FORMAT = "tools_or_format"


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    """A request's structured-output constraint, whatever field the client named it in.

    ``param`` is that field (``response_format``, ``guided_regex``, ...), so an
    engine's refusal names what the client sent.
    """

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    param: str = "response_format"


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling settings in OpenAI terms; dialects apply each engine's defaults."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # -- logprobs (chat logprobs/top_logprobs, completions logprobs/echo) --
    #: None: no output logprobs; n: each output token's logprob and its n top alternatives
    logprobs: int | None = None
    #: None: no prompt logprobs; n: each prompt token's logprob and n top alternatives
    prompt_logprobs: int | None = None
    #: (token id, bias) pairs, sorted by token id; OpenAI's -100..100
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: the engine's own detokenization only (ours is the frontend's, which reads the request)
    skip_special_tokens: bool = True
    constraint: Constraint | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Disaggregation:
    """What one leg of a disaggregated (prefill/decode) request carries.

    The contracts are in docs/engine-contracts.md §9.

    SGLang pairs its legs by a bootstrap rendezvous sent identically on both
    (the prefill engine's bootstrap server and a room); vLLM hands the KV over
    through ``kv_transfer_params_json``, a JSON object passed to the engine
    verbatim. A leg sets the fields of its engine kind only.
    """

    bootstrap_host: str = ""
    bootstrap_port: int = 0
    bootstrap_room: int | None = None  # SGLang: set means "send DisaggregatedParams"
    kv_transfer_params_json: str | None = None  # vLLM


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateCall:
    """One request as sent to one engine.

    Stop *strings* are handled by the frontend (postprocess), not sent to the
    engine, so every engine kind stops at exactly the same place.
    """

    request_id: str
    input_ids: Sequence[int]
    sampling: SamplingOptions
    stream: bool = True
    original_text: str = ""
    disaggregation: Disaggregation | None = None  # one leg of a prefill/decode pair
    #: the LoRA adapter to run under (the id it was loaded with); None: the base model
    lora_id: str | None = None
    #: the data-parallel rank to run on (KV-aware routing picked the rank holding the
    #: prefix: each rank has a cache of its own); None: the engine balances its ranks
    dp_rank: int | None = None
    #: the request's spans when tracing is on: each leg opens its own under it
    trace: RequestTrace | None = dataclasses.field(default=None, compare=False, repr=False)
    #: the prompt's images, preprocessed (``input_ids`` hold their placeholder runs); a
    #: continuation keeps them, its prompt being this one plus the tokens produced
    media: MediaPayload | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True, slots=True)
class EmbedCall:
    """One input to embed on one engine (an embedding model's), as token ids."""

    request_id: str
    input_ids: Sequence[int]
    original_text: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Embedding:
    """An engine's embedding of one input: the vector, and the tokens it read."""

    vector: Sequence[float]
    prompt_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's log probability: the token there and its top alternatives.

    ``top`` holds (token id, logprob) pairs sorted by logprob, highest first,
    at most as many as the request asked for; the dialects sort and trim them.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


#: a prompt's logprobs, one per prompt token; None where the engine has none (the first)
PromptLogprobs = tuple[TokenLogprob | None, ...]


class FinishReason(enum.Enum):
    """Why an engine stopped generating."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the engine aborted the request
    ERROR = "error"  # the engine failed the request


class TokenDelta(msgspec.Struct, frozen=True):
    """New output tokens, in order; never a repeat of tokens already reported.

    A struct, as :class:`Finished` is: one is made per engine message, and a frozen
    dataclass sets its fields one call at a time (``msgspec.structs.replace`` copies one).
    """

    token_ids: tuple[int, ...]
    prompt_tokens: int = 0
    completion_tokens: int = 0  # running total so far, whatever the engine reports
    cached_tokens: int = 0
    #: with ``sampling.logprobs``: one per token of ``token_ids``, in order
    logprobs: tuple[TokenLogprob, ...] = ()
    #: with ``sampling.prompt_logprobs``: on the first event that has them, once
    prompt_logprobs: PromptLogprobs | None = None


class Finished(msgspec.Struct, frozen=True):
    """The terminal event of a stream: carries the final usage and why it ended.

    ``token_ids`` holds tokens not yet reported by a :class:`TokenDelta` (the
    whole output for a non-streaming call, usually empty for a streaming one).
    """

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    matched_token_id: int | None = None
    matched_stop_str: str | None = None
    #: a vLLM prefill leg's handoff to its decode leg (relayed verbatim)
    kv_transfer_params_json: str | None = None
    #: as on :class:`TokenDelta`: one per token of ``token_ids``
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


EngineEvent = TokenDelta | Finished


class EngineRole(enum.Enum):
    """What part of a request an engine serves."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    """What discovery learnt about an engine when it joined.

    ``context_length`` is what the engine reported; the fleet file may
    override it (see :mod:`direct_frontend.fleet`).
    """

    served_model_name: str
    model_path: str = ""
    context_length: int | None = None
    max_input_length: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    role: EngineRole | None = None
    data_parallel_size: int = 1
    #: the lowest data-parallel rank this servicer serves (vLLM's GetLoads lists its ranks;
    #: a servicer of one node's share of a multi-node DP engine starts above 0); None:
    #: unknown (a vLLM servicer without GetLoads), so no request is pinned to a rank
    first_dp_rank: int | None = 0
    incarnation: str = ""  # changes when the engine restarts (start time, uptime)
    details: tuple[tuple[str, str], ...] = ()  # extra facts, for `check` and /fleet
    started_at: float | None = None  # engine start (epoch s) when reported or derivable
    served_name_known: bool = True  # False: the kind reports no served name (TRT-LLM)
    bootstrap_port: int | None = None  # SGLang: the P/D bootstrap server a prefill engine runs
    #: the KV cache in tokens (SGLang, vLLM: ``max_total_num_tokens``), which is also its
    #: prefix cache: what KV-aware routing measures an engine's fullness against
    kv_capacity_tokens: int | None = None
    #: False: an embedding model (vLLM ``--runner pooling``, SGLang ``--is-embedding``), which
    #: serves ``Embed`` and not ``Generate`` (``GetModelInfo.is_generation``)
    generates: bool = True
