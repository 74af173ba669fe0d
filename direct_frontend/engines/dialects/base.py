"""The dialect seam: what every engine kind provides, and the checks every kind runs.

A dialect is sans-IO. It builds request messages, decodes response messages
into neutral events (one decoder per stream, because engines differ in whether
counts are cumulative and whether the terminal message repeats tokens),
classifies failures into :class:`~direct_frontend.errors.ErrorKind` once, so
the layers above never see a gRPC status code, and builds the two legs of a
prefill/decode pair, so nothing above it knows how a kind hands KV over.
What the SMG contracts' messages share is in
:mod:`~direct_frontend.engines.dialects.smg`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import operator
import random
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol
from urllib.parse import urlsplit

from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from direct_frontend.engines.dialects.ids import IdRuns
from direct_frontend.engines.neutral import (
    FLOAT32_MAX,
    INT32_MAX,
    UINT32_MAX,
    Constraint,
    ConstraintKind,
    EmbedCall,
    Embedding,
    EngineEvent,
    EngineInfo,
    GenerateCall,
)
from direct_frontend.errors import EngineError, ErrorKind


@dataclasses.dataclass(frozen=True, slots=True)
class Rpc:
    """One gRPC call, ready for the transport: method path, request, reply type.

    ``optional``: discovery goes on without it when it fails (the dialect then
    gets ``None`` for its reply), for facts an older servicer may not serve.
    """

    path: str
    request: Any
    response_type: type[Any]
    optional: bool = False
    #: the request's prompt ids, held encoded rather than in its list
    #: (engines/dialects/ids.py :func:`~direct_frontend.engines.dialects.ids.encode_request`)
    runs: IdRuns | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine kind can do through its contract, so routing never asks for more."""

    prefill_decode: bool
    #: the fleet file may name a prefill engine's bootstrap server port (SGLang)
    bootstrap_server: bool = False
    #: the contract returns prompt logprobs with the first output (completions ``echo``)
    prompt_logprobs: bool = True
    #: the structured-output constraints the contract carries (natively or translated)
    constraints: frozenset[ConstraintKind] = frozenset(ConstraintKind)
    #: sampling fields only some contracts carry ("seed", "logit_bias"), that this one does
    optional: frozenset[str] = frozenset()
    #: a request may name a LoRA adapter, which the router may load and unload (SGLang)
    lora_adapters: bool = False
    #: an embedding model of this kind serves ``Embed`` through the contract (SGLang, vLLM)
    embeddings: bool = False
    #: a request may name the data-parallel rank it runs on, and the stock engine honours it
    #: (vLLM; SGLang's contract has the field, its stock servicer drops it)
    dp_rank_pin: bool = False
    #: a request's preprocessed images (``MultimodalInputs``: tensors, placeholder ranges,
    #: image hashes) reach the engine (SGLang, vLLM; TensorRT-LLM's takes raw bytes only)
    images: bool = False
    #: discovery reports the served model's name, so an engine need not be told its model
    #: (not TensorRT-LLM, whose ``model_id`` is its launch path)
    reports_model: bool = True


class OptionalFields(Protocol):
    """The fields only some kinds carry: on :class:`SamplingOptions`, and on a parsed request."""

    @property
    def seed(self) -> int | None: ...

    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...

    @property
    def constraint(self) -> Constraint | None: ...

    @property
    def prompt_logprobs(self) -> int | None: ...


def missing_capability(capabilities: Capabilities, sampling: OptionalFields) -> str | None:
    """The request field ``sampling`` sets that a kind with ``capabilities`` cannot carry.

    Routing avoids such engines (pipeline/capable.py); the dialect refuses
    the request outright if it is sent one anyway.
    """
    constraint = sampling.constraint
    if constraint is not None and constraint.kind not in capabilities.constraints:
        return constraint.param
    optional = capabilities.optional
    if sampling.seed is not None and "seed" not in optional:
        return "seed"
    if sampling.logit_bias and "logit_bias" not in optional:
        return "logit_bias"
    if sampling.prompt_logprobs is not None and not capabilities.prompt_logprobs:
        return "echo"  # prompt logprobs are asked for by echo with logprobs
    return None


def why_missing(param: str) -> str:
    """Why a kind lacks what :func:`missing_capability` named, for the client's 400."""
    if param == "echo":
        return ("prompt logprobs, asked for by 'echo' with 'logprobs', come back only with the "
                "last message of their contract")
    return "their contract cannot carry it"


def escape_choice(choice: str) -> str:
    """``choice`` as a regex that matches it literally, in the grammar backends' regex syntax.

    Only the characters special in that syntax are escaped (Python's
    ``re.escape`` escapes more, such as spaces, which not every backend reads).
    """
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in choice)


_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}/")


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices``: a choice for kinds without that constraint."""
    return "(" + "|".join(escape_choice(c) for c in choices) + ")"


#: the schema a json_object request stands for, for a contract without its own json_object
ANY_OBJECT_SCHEMA = '{"type":"object"}'


@dataclasses.dataclass(frozen=True, slots=True)
class LoraReply:
    """An engine's answer to a LoRA load or unload: and which adapter ids it holds now."""

    ok: bool
    message: str
    loaded: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class HealthResult:
    healthy: bool
    message: str


#: the bootstrap server port SGLang (``--disaggregation-bootstrap-port``) and vLLM's
#: Mooncake connector both listen on unless told otherwise
DEFAULT_BOOTSTRAP_PORT = 8998


class PairingFacts(Protocol):
    """What a dialect reads of an engine to pair it: where it is and what discovery said.

    Routing's ``EngineHandle`` is one; the dialects stay below the catalog that holds it.
    """

    @property
    def url(self) -> str: ...

    @property
    def info(self) -> EngineInfo: ...

    @property
    def bootstrap_port(self) -> int | None:
        """The prefill engine's bootstrap server port, if the fleet file or discovery gave one."""


def bootstrap_address(prefill: PairingFacts) -> tuple[str, int]:
    """The host and port of ``prefill``'s bootstrap server, as its partner reaches it."""
    return urlsplit(prefill.url).hostname or "", prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT


@dataclasses.dataclass(frozen=True, slots=True)
class LegPlan:
    """The two legs of one disaggregated attempt, as the decode engine's kind runs them."""

    prefill_call: GenerateCall
    #: with ``relays_kv_params``: still without the handoff the prefill leg returns
    decode_call: GenerateCall
    parallel: bool  # both legs at once (SGLang), or the prefill leg first (vLLM)
    relays_kv_params: bool  # the decode leg carries the prefill's kv_transfer_params


@dataclasses.dataclass(frozen=True, slots=True)
class WireLimits:
    """The largest values one contract's Generate request carries (docs/engine-contracts.md).

    Every contract sends token counts and token ids as uint32 and sampling
    floats as float32, and reports context windows as int32, so a prompt plus
    its budget beyond int32 can fit no engine. They differ in ``top_k``
    (int32 or uint32), and a kind that cannot carry a ``top_k`` sends it as
    "disabled" instead: a ``top_k`` beyond int32 exceeds any vocabulary
    (vocabulary sizes are int32 too), so it keeps every token either way.
    That is why no value is refused by one kind and carried by another, why
    every kind has the same limits, and why routing need not know them.
    Seeds are folded into each kind's type by its dialect.
    """

    count: int = UINT32_MAX  # max_tokens, min_tokens
    token_id: int = UINT32_MAX  # stop_token_ids (prompt ids are checked by the parser)
    sequence: int = INT32_MAX  # prompt + max_tokens


_FLOATS = (
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty",
)
_FLOAT_VALUES = operator.attrgetter(*_FLOATS)


def _refused(param: str, value: object, limit: str) -> EngineError:
    return EngineError(
        ErrorKind.BAD_REQUEST, f"Invalid value for '{param}': {value} is beyond {limit}.",
        param=param,
    )


def check_limits(call: GenerateCall, limits: WireLimits) -> None:
    """Refuse (a BAD_REQUEST naming the field) what the contract of ``limits`` cannot carry.

    Run before a request is built, so an out-of-range value is the client's
    400, never a protobuf overflow; it costs a few comparisons per request.
    """
    s = call.sampling
    if not 1 <= s.max_tokens <= limits.count:
        raise _refused("max_tokens", s.max_tokens, f"the engine's range 1..{limits.count}")
    if not 0 <= s.min_tokens <= limits.count:
        raise _refused("min_tokens", s.min_tokens, f"the engine's range 0..{limits.count}")
    if len(call.input_ids) + s.max_tokens > limits.sequence:
        raise _refused(
            "max_tokens", s.max_tokens,
            f"what any engine can hold after a {len(call.input_ids)}-token prompt "
            f"({limits.sequence} tokens in all)",
        )
    for i, token in enumerate(s.stop_token_ids):
        if not 0 <= token <= limits.token_id:
            raise _refused(f"stop_token_ids[{i}]", token, f"the token ids 0..{limits.token_id}")
    if not 0 <= s.top_k <= UINT32_MAX:
        raise _refused("top_k", s.top_k, f"the engine's range 0..{UINT32_MAX}")
    values = _FLOAT_VALUES(s)
    if all(map(math.isfinite, values)) and max(map(abs, values)) <= FLOAT32_MAX:
        return  # all of them at once, in C: the usual case
    for name, value in zip(_FLOATS, values, strict=True):
        if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise _refused(name, value, "what a float32 holds")


STATUS_KINDS: dict[Status, ErrorKind] = {
    Status.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    Status.DEADLINE_EXCEEDED: ErrorKind.TIMEOUT,
    Status.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED,
    Status.CANCELLED: ErrorKind.CANCELLED,
    Status.INVALID_ARGUMENT: ErrorKind.BAD_REQUEST,
    Status.OUT_OF_RANGE: ErrorKind.BAD_REQUEST,
    Status.FAILED_PRECONDITION: ErrorKind.BAD_REQUEST,
    Status.NOT_FOUND: ErrorKind.BAD_REQUEST,
    Status.ALREADY_EXISTS: ErrorKind.BAD_REQUEST,
    Status.UNIMPLEMENTED: ErrorKind.BAD_REQUEST,
    Status.PERMISSION_DENIED: ErrorKind.BAD_REQUEST,
    Status.UNAUTHENTICATED: ErrorKind.BAD_REQUEST,
    Status.ABORTED: ErrorKind.INTERNAL,
    Status.DATA_LOSS: ErrorKind.INTERNAL,
    Status.INTERNAL: ErrorKind.INTERNAL,
    Status.UNKNOWN: ErrorKind.INTERNAL,
}


def classify_exception(exc: BaseException) -> EngineError:
    """Map a transport fault or gRPC status to our error kind (shared by all dialects)."""
    if isinstance(exc, EngineError):
        return exc
    if isinstance(exc, GRPCError):
        kind = STATUS_KINDS.get(exc.status, ErrorKind.INTERNAL)
        return EngineError(kind, f"{exc.status.name}: {exc.message or ''}".rstrip(": "))
    if isinstance(exc, TimeoutError):  # grpclib's timeout= raises the builtin
        return EngineError(ErrorKind.TIMEOUT, "deadline exceeded")
    if isinstance(exc, (OSError, StreamTerminatedError, ProtocolError, EOFError)):
        return EngineError(ErrorKind.UNAVAILABLE, f"transport: {exc!r}")
    return EngineError(ErrorKind.INTERNAL, f"unexpected: {exc!r}")


ENGINE_ABORTED = "the engine aborted the request"


def engine_aborted() -> EngineError:
    """The one error every kind reports for an abort seen on the stream.

    SGLang ends an aborted stream with a status, vLLM with finish_reason
    "abort", TRT-LLM with "cancelled": the layers above see one error for all
    three. Our own aborts are sent after the stream is dropped, so an abort
    seen here was the engine's (or another client's): a 500, not a cancel.
    """
    return EngineError(ErrorKind.INTERNAL, ENGINE_ABORTED)


class StreamDecoder(abc.ABC):
    """Turns one Generate stream's messages into neutral events, in order.

    ``feed`` returns ``None`` for a message that carries nothing new (e.g. a
    terminal message that only repeats the last delta). ``end`` is called when
    the transport closes the stream: a stream without a terminal message is a
    protocol fault (the engine died mid-stream).
    """

    finished: bool = False

    @abc.abstractmethod
    def feed(self, message: Any) -> EngineEvent | None: ...

    def end(self) -> None:
        if not self.finished:
            raise EngineError(ErrorKind.PROTOCOL, "stream ended without a terminal message")


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    """Where discovery reads one fact of an engine kind, and what a fleet without an
    override for it should know (empty: nothing)."""

    where: str
    advice: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class DiscoverySources:
    """Per fact, where an engine kind's discovery (:meth:`Dialect.engine_info`) reads it.

    The kinds differ in what they report and how far it can be trusted, the usual
    reason a fleet needs an override; ``direct-frontend check`` shows these.
    """

    model: Source
    context_length: Source
    block_size: Source
    kv_capacity: Source
    data_parallel: Source
    serves: Source
    role: Source
    #: how a restart shows (control/restarts.py)
    restarts: Source


class Dialect(abc.ABC):
    """One engine kind's side of the seam."""

    kind: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    limits: ClassVar[WireLimits] = WireLimits()
    #: where :meth:`engine_info` reads each fact, kept beside it
    discovers: ClassVar[DiscoverySources]

    def check(self, call: GenerateCall) -> None:
        """Raise a BAD_REQUEST :class:`EngineError` for what this contract cannot carry."""
        check_limits(call, self.limits)
        param = missing_capability(self.capabilities, call.sampling)
        if param is not None:
            raise EngineError(
                ErrorKind.BAD_REQUEST,
                f"'{param}' is not supported by {self.kind} engines ({why_missing(param)}).",
                param=param,
            )
        if call.lora_id is not None and not self.capabilities.lora_adapters:
            raise EngineError(ErrorKind.BAD_REQUEST,
                              f"{self.kind} engines' contract carries no LoRA adapter",
                              param="model")
        if call.dp_rank is not None and not self.capabilities.dp_rank_pin:
            raise EngineError(ErrorKind.INTERNAL,
                              f"{self.kind} engines' contract carries no data-parallel rank")

    # -- LoRA adapters (only for kinds whose capabilities say lora_adapters) --

    def load_lora(self, lora_id: str, name: str, path: str) -> Rpc:
        raise NotImplementedError(f"{self.kind} engines cannot load LoRA adapters")

    def unload_lora(self, lora_id: str, name: str) -> Rpc:
        raise NotImplementedError(f"{self.kind} engines cannot unload LoRA adapters")

    def list_loras(self) -> Rpc:
        raise NotImplementedError(f"{self.kind} engines cannot list LoRA adapters")

    def lora_reply(self, reply: Any) -> LoraReply:
        """A load's or unload's reply; for a list's, every adapter id it holds (``ok``)."""
        raise NotImplementedError(f"{self.kind} engines have no LoRA replies")

    # -- embeddings (only for kinds whose capabilities say embeddings) --

    def embed(self, call: EmbedCall) -> Rpc:
        """The Embed call for one input (an embedding model's engine)."""
        raise NotImplementedError(f"{self.kind} engines serve no embeddings")

    def embedding(self, reply: Any) -> Embedding:
        """The vector and token count of an Embed reply; a malformed one is a PROTOCOL error."""
        raise NotImplementedError(f"{self.kind} engines serve no embeddings")

    def generate(self, call: GenerateCall) -> Rpc:
        """The Generate call for ``call``, refused by :meth:`check` if the contract cannot
        carry it."""
        self.check(call)
        return self.build(call)

    @abc.abstractmethod
    def build(self, call: GenerateCall) -> Rpc:
        """The Generate call for ``call``, which :meth:`check` passed."""

    @abc.abstractmethod
    def stream_decoder(self, call: GenerateCall) -> StreamDecoder: ...

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str = "") -> Rpc: ...

    @abc.abstractmethod
    def health(self) -> Rpc: ...

    @abc.abstractmethod
    def health_result(self, response: Any) -> HealthResult: ...

    @abc.abstractmethod
    def discovery(self) -> Sequence[Rpc]: ...

    def loads(self) -> Rpc | None:
        """The call that reports the engine's requests from every client (None: none does)."""
        return None

    def engine_requests(self, response: Any) -> int:
        """Requests the engine has, from every client, from the reply to :meth:`loads`."""
        raise NotImplementedError(f"{self.kind} engines report no load")

    def rank_requests(self, response: Any) -> dict[int, int]:
        """The same, per data-parallel rank ({}: not reported per rank)."""
        return {}

    @abc.abstractmethod
    def engine_info(self, responses: Sequence[Any]) -> EngineInfo:
        """Build :class:`EngineInfo` from the replies to :meth:`discovery`, in order."""

    def classify(self, exc: BaseException) -> EngineError:
        return classify_exception(exc)

    def media_ref_schemes(self, info: EngineInfo) -> frozenset[str] | None:
        """The URL schemes an engine fetches images of when it processes media itself
        (None: it takes preprocessed tensors only)."""
        return None

    def takes_raw_pixels(self, info: EngineInfo) -> bool:
        """Whether an engine rescales and normalises image pixels itself (on device)."""
        return False

    # -- prefill/decode pairs (only for kinds whose capabilities say prefill_decode) --

    def pairing_group(self, engine: PairingFacts) -> str | None:
        """Engines of one group can pair; ``None``: this kind cannot do P/D at all."""
        return self.kind if self.capabilities.prefill_decode else None

    def can_prefill(self, engine: PairingFacts) -> bool:
        """Whether ``engine`` can be the named prefill engine of a pair of its group."""
        return True

    def pair_legs(self, call: GenerateCall, prefill: PairingFacts, rng: random.Random) -> LegPlan:
        """The legs of ``call`` with ``prefill`` (of this kind and group) computing the KV.

        ``rng`` draws whatever a pair needs to be told apart (a room, a transfer id).
        """
        raise NotImplementedError(f"{self.kind} engines cannot serve prefill/decode legs")
