"""What the simulated servicers share: the checks every engine makes, the RPC handlers whose
one reply each kind writes (model and server info, health, a one-request Abort), and
common.proto's RPCs.

Only what is the same on every contract is written here, or on the contracts
that share it (SGLang's and vLLM's as smg-grpc-servicer serves both; SGLang's
and TRT-LLM's Abort of one request); each kind's module keeps its own messages
and quirks, so a difference between engines stays visible as a difference
between modules.
"""

from __future__ import annotations

import hashlib
import io
import random
import zipfile
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import grpclib.server
from grpclib import GRPCError, Status
from tokenizers import Tokenizer

from direct_frontend.protos import common_pb2
from direct_frontend.simulator.constraints import (
    InvalidConstraint,
    Unsupported,
    constrained_text,
    prompt_words,
)
from direct_frontend.simulator.core import Job, SimCore
from direct_frontend.simulator.embedding import embedding_of
from direct_frontend.simulator.logprobs import RequestLogprobs, fill_smg
from direct_frontend.simulator.model import Finish
from direct_frontend.simulator.multimodal import MediaKey
from direct_frontend.simulator.structural import structural_text

SIM_VERSION = "0.0.0-sim"
#: Generate's INVALID_ARGUMENT on an embedding model, in a real vLLM's words (docs/real-vllm.md §12)
NOT_GENERATION = "This model does not support generation"
#: Embed's INVALID_ARGUMENT on a generation model, likewise
NOT_EMBEDDING = "This model does not support pooling"
_CHUNK_BYTES = 64 * 1024  # the stock servicers' GetTokenizer chunk size
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
)


class _Named(Protocol):
    """A request naming one request id (every Generate, SGLang's and TRT-LLM's Abort)."""

    request_id: str


NamedT = TypeVar("NamedT", bound=_Named)


# -- requests ------------------------------------------------------------------


async def generate_request(core: SimCore, stream: grpclib.server.Stream[NamedT, Any]) -> NamedT:
    """The Generate request, its id noted before any check (a refused request was still seen).

    An embedding model refuses it here, before looking at the request.
    """
    request = await stream.recv_message()
    assert request is not None
    traceparent = stream.metadata.get("traceparent") if stream.metadata else None
    core.note_request(request.request_id, None if traceparent is None else str(traceparent))
    core.stats.receive(request.request_id, request)
    if not core.config.is_generation:
        raise GRPCError(Status.INVALID_ARGUMENT, NOT_GENERATION)
    return request


_tokenizers: dict[str, Tokenizer] = {}


def _tokenizer(core: SimCore) -> Tokenizer | None:
    """The engine's tokenizer (loaded once per directory), if it was given one."""
    directory = core.config.tokenizer_path
    if not directory:
        return None
    tokenizer = _tokenizers.get(directory)
    if tokenizer is None:
        tokenizer = _tokenizers[directory] = Tokenizer.from_file(
            str(Path(directory) / "tokenizer.json")
        )
    return tokenizer


def constrained_output(
    core: SimCore, constraint: tuple[str, str | Sequence[str]] | None, prompt: Sequence[int]
) -> tuple[int, ...] | None:
    """A constrained request's output tokens (None: no constraint), or the engine's refusal.

    ``constraint`` is the contract's constraint kind and value. The text is
    drawn from the prompt's hash, so every engine of one model writes the same;
    under a structural tag, a scripted completion the tag allows is the
    model's choice (simulator/structural.py).
    """
    if constraint is None:
        return None
    kind, value = constraint
    tokenizer = _tokenizer(core)
    seed = core.model.state_of(prompt)
    try:
        if kind == "structural_tag" and isinstance(value, str) and tokenizer is not None:
            script = core.scripts.completion_for(prompt) if core.scripts is not None else None
            text = structural_text(
                value, random.Random(seed),
                None if script is None else tokenizer.decode(list(script),
                                                             skip_special_tokens=False),
                tokenizer.decode(list(prompt), skip_special_tokens=False),
            )
        else:
            # the prompt's words name a free-form object's keys, as a model would take them up
            words = () if tokenizer is None else prompt_words(
                tokenizer.decode(list(prompt), skip_special_tokens=True))
            text = constrained_text(kind, value, seed, words)
    except Unsupported as exc:
        raise GRPCError(Status.UNIMPLEMENTED, str(exc)) from None
    except InvalidConstraint as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, f"Invalid {kind} constraint: {exc}") from None
    if tokenizer is None:
        raise GRPCError(
            Status.UNIMPLEMENTED, "The simulator needs a tokenizer to honour a constraint"
        )
    return tuple(tokenizer.encode(text, add_special_tokens=False).ids)


def check_prompt(core: SimCore, prompt: Sequence[int], limit: int) -> None:
    """Refuse what the real engines refuse, as ``INVALID_ARGUMENT``."""
    if not prompt:
        raise GRPCError(Status.INVALID_ARGUMENT, "The prompt cannot be empty")
    if len(prompt) >= limit:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length "
            f"({limit - 1} tokens)",
        )
    highest = max(prompt)
    if highest >= core.config.vocab_size:
        raise GRPCError(Status.INVALID_ARGUMENT, f"Token id {highest} is out of vocabulary")


def pinned_rank(core: SimCore, request: Any) -> int | None:
    """The data-parallel rank a Generate names (None: the engine picks), refused out of range.

    In a real vLLM's words (its input processor's check, which its servicer
    answers ``INVALID_ARGUMENT``). SGLang's stock servicer reads no rank.
    """
    if not request.HasField("data_parallel_rank"):
        return None
    rank: int = request.data_parallel_rank
    size = core.config.dp_size
    if not 0 <= rank < size:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"data_parallel_rank {rank} is out of range [0, {size})."
        )
    return rank


def refuse_n(n: int) -> None:
    """Refuse more than one sequence per request, as the simulator writes one."""
    if n > 1:
        raise GRPCError(Status.UNIMPLEMENTED, "The simulator does not support n > 1")


def sample_seed(params: Any) -> int | None:
    """The seed a sampling request's stream is drawn from (vLLM, TRT-LLM).

    Only a seeded request that samples (temperature unset, or above 0) has
    one; a greedy request ignores its seed.
    """
    temperature = params.temperature if params.HasField("temperature") else 1.0
    seeded = params.HasField("seed") and temperature > 0
    return params.seed if seeded else None


def admit_media(core: SimCore, job: Job, media: tuple[MediaKey, ...]) -> None:
    """Attach the request's images to ``job`` (they key its KV blocks) and count them."""
    job.media = media
    core.stats.images += len(media)


def smg_filler(
    pb2: Any, logprobs: RequestLogprobs, output: Sequence[int], *, vllm: bool
) -> Callable[[Any, int, bool], None]:
    """Fills an smg message's logprobs: output tokens from ``start`` to now, and with
    ``prompt`` the prompt's (``pb2``: the contract's messages)."""

    def fill(message: Any, start: int, prompt: bool) -> None:
        fill_smg(message, pb2, logprobs, start, len(output), prompt=prompt, vllm=vllm)

    return fill


def capped(requested: int | None, budget: int) -> int:
    """The effective output cap: the request's, clamped to what the window leaves."""
    return budget if requested is None else min(requested, budget)


def matched_stop_token(finish: Finish | None) -> int | None:
    """The stop token vLLM and TRT-LLM report: their stop_reason stays None for EOS."""
    if finish is None or finish.matched_eos:
        return None
    return finish.matched_token_id


def now_iso() -> str:
    """The ``timestamp`` of a GetLoads reply."""
    return datetime.now(UTC).isoformat()


async def refuse(stream: grpclib.server.Stream[Any, Any], message: str) -> NoReturn:
    """Read the request, then answer ``UNIMPLEMENTED``: what a stock servicer does for a gap."""
    await stream.recv_message()
    raise GRPCError(Status.UNIMPLEMENTED, message)


# -- the tokenizer bundle ----------------------------------------------------------

_bundles: dict[str, tuple[bytes, str]] = {}


def _tokenizer_bundle(directory: str) -> tuple[bytes, str]:
    """The zip archive GetTokenizer streams, and its sha256 (cached per directory)."""
    cached = _bundles.get(directory)
    if cached is not None:
        return cached
    root = Path(directory)
    buffer = io.BytesIO()
    added = 0
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        names = [*_TOKENIZER_FILES, *sorted(p.name for p in root.glob("*.jinja"))]
        for name in names:
            path = root / name
            if path.is_file():
                archive.write(path, name)
                added += 1
    if not added:
        raise GRPCError(Status.NOT_FOUND, f"No tokenizer files found in {directory}")
    data = buffer.getvalue()
    bundle = (data, hashlib.sha256(data).hexdigest())
    _bundles[directory] = bundle
    return bundle


# -- the servicers' common ground ----------------------------------------------------


class SimServicer:
    """A servicer over one :class:`SimCore`, with the RPCs every contract answers alike.

    The information RPCs read their (empty) request and answer one reply; each
    kind writes that reply in :meth:`model_info`, :meth:`server_info` and
    :meth:`health` (the handlers take ``Any``: each contract has its own messages).
    """

    def __init__(self, core: SimCore) -> None:
        self.core = core

    def model_info(self) -> Any:
        """The contract's ``GetModelInfoResponse``."""
        raise NotImplementedError

    def server_info(self) -> Any:
        """The contract's ``GetServerInfoResponse``."""
        raise NotImplementedError

    async def health(self) -> Any:
        """The contract's ``HealthCheckResponse``."""
        raise NotImplementedError

    async def GetModelInfo(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        await stream.send_message(self.model_info())

    async def GetServerInfo(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        await stream.send_message(self.server_info())

    async def HealthCheck(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        await stream.send_message(await self.health())

    async def SubscribeKvEvents(
        self,
        stream: grpclib.server.Stream[common_pb2.SubscribeKvEventsRequest, common_pb2.KvEventBatch],
    ) -> None:
        await refuse(
            stream, "KV events are not enabled (the engine has no --kv-events-config)"
        )


class AbortsOne(SimServicer):
    """An Abort naming one request (SGLang, TRT-LLM): ``success`` says whether it was found."""

    #: the contract's AbortResponse (both name its fields alike)
    abort_response: type[Any]

    async def Abort(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        found = self.core.note_abort_rpc([request.request_id])
        await stream.send_message(
            self.abort_response(
                success=found,
                message=f"Request {request.request_id} {'aborted' if found else 'not found'}",
            )
        )


class SmgServicer(SimServicer):
    """What smg-grpc-servicer 0.14.1 serves alike for SGLang and vLLM."""

    #: the contract's EmbedResponse (both name its fields alike)
    embed_response: type[Any]

    @property
    def prompt_limit(self) -> int:
        """The prompt length :func:`check_prompt` refuses (the kind's window rule)."""
        raise NotImplementedError

    async def Embed(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        """One vector for the tokenized input; a generation model refuses, as stock ones do."""
        # Any: each contract has its own EmbedRequest; both carry tokenized.input_ids.
        core = self.core
        dim = core.config.embedding_dim
        if not dim:
            await stream.recv_message()
            raise GRPCError(Status.INVALID_ARGUMENT, NOT_EMBEDDING)
        request = await stream.recv_message()
        assert request is not None
        traceparent = stream.metadata.get("traceparent") if stream.metadata else None
        if traceparent is not None:
            core.stats.traceparents[request.request_id] = str(traceparent)
        prompt = list(request.tokenized.input_ids)  # unset: empty, refused as Generate does
        check_prompt(core, prompt, self.prompt_limit)
        await stream.send_message(
            self.embed_response(
                embedding=embedding_of(prompt, dim), prompt_tokens=len(prompt), embedding_dim=dim
            )
        )
        core.stats.embeds += 1  # once sent: a call a fault cut short is not counted

    async def FlushCache(
        self,
        stream: grpclib.server.Stream[common_pb2.FlushCacheRequest, common_pb2.FlushCacheResponse],
    ) -> None:
        await stream.recv_message()
        for cache in self.core.kv_caches:  # every rank's
            cache.clear()  # publishes AllBlocksCleared
        await stream.send_message(
            common_pb2.FlushCacheResponse(success=True, message="Cache flushed")
        )

    async def StartProfile(
        self, stream: grpclib.server.Stream[Any, common_pb2.ProfileResponse]
    ) -> None:
        # Any: Start and Stop take their own request messages; both are read and dropped.
        await stream.recv_message()
        await stream.send_message(common_pb2.ProfileResponse(success=True, message="OK"))

    StopProfile = StartProfile  # there is no profiler: stopping says OK as starting does

    async def GetTokenizer(
        self,
        stream: grpclib.server.Stream[common_pb2.GetTokenizerRequest, common_pb2.GetTokenizerChunk],
    ) -> None:
        await stream.recv_message()
        if not self.core.config.tokenizer_path:
            raise GRPCError(Status.UNIMPLEMENTED, "The simulator was started without a tokenizer")
        data, digest = _tokenizer_bundle(self.core.config.tokenizer_path)
        for start in range(0, len(data), _CHUNK_BYTES):
            last = start + _CHUNK_BYTES >= len(data)
            await stream.send_message(
                common_pb2.GetTokenizerChunk(
                    data=data[start : start + _CHUNK_BYTES], sha256=digest if last else ""
                )
            )
