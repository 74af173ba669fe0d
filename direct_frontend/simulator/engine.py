"""``SimEngine``: one simulated stock engine serving its real gRPC contract.

It runs on the asyncio loop that is current when :meth:`SimEngine.start` is
awaited and never creates one, so the daemon can embed engines under
trio-asyncio while the standalone CLI uses plain asyncio.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, get_args

import grpclib.const
import grpclib.protocol
import grpclib.server
from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from tokenizers import Tokenizer

from direct_frontend.simulator import disagg as _disagg
from direct_frontend.simulator import faults as _faults
from direct_frontend.simulator.core import (
    EngineConfig,
    EngineKind,
    EngineStats,
    SimCore,
    SimRole,
)
from direct_frontend.simulator.faults import FaultInjector, FaultPlan, FaultStats
from direct_frontend.simulator.kv_publisher import KvEventPublisher, SimKvEvents
from direct_frontend.simulator.kvcache import HashStyle, SimPrefixCache
from direct_frontend.simulator.lora import LoraSlots
from direct_frontend.simulator.model import SimModel, TimingModel
from direct_frontend.simulator.servicers import servicer_for
from direct_frontend.simulator.vocab import TextVocab


class _QuietCancels(logging.Filter):
    """grpclib logs every call its client cancels at INFO; for an engine that is routine.

    The frontend cancels the call at every stop-string hit and every client
    that hangs up (and counts those itself), so the line becomes DEBUG.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and record.msg == "Request was cancelled: %s":
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_QUIET_CANCELS = _QuietCancels()


async def _method_not_found(stream: grpclib.server.Stream[Any, Any]) -> None:
    raise GRPCError(Status.UNIMPLEMENTED, "Method not found!")


_NOT_FOUND = grpclib.const.Handler(_method_not_found, grpclib.const.Cardinality.UNARY_UNARY,
                                   empty_pb2.Empty, empty_pb2.Empty)


class _EveryMethod(dict[str, grpclib.const.Handler]):
    """A server's methods, where a method it lacks answers as a stock engine's server does."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key, _NOT_FOUND)


class _Server(grpclib.server.Server):
    """A grpclib server that can drop its open connections on close, and answers as grpcio.

    grpclib's own ``close`` cancels handlers but leaves idle HTTP/2
    connections serving new calls; a closed engine must look dead instead.
    A method the engine lacks (a client that takes it for another kind) gets the
    stock engines' (grpcio's) answer, UNIMPLEMENTED "Method not found!" with its
    content-type; grpclib's own answer has none, which a grpclib client reports as
    UNKNOWN "Missing content-type header" instead.
    """

    def __init__(self, handlers: Iterable[Any]) -> None:
        super().__init__(list(handlers))
        self._mapping = _EveryMethod(self._mapping)
        self._protocols: weakref.WeakSet[grpclib.protocol.H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> grpclib.protocol.H2Protocol:
        protocol = super()._protocol_factory()
        self._protocols.add(protocol)
        return protocol

    def drop_connections(self) -> None:
        for protocol in list(self._protocols):
            processor = getattr(protocol, "processor", None)  # set once connected
            if processor is not None:
                processor.close("Server closed")


def _check_shape(kind: EngineKind, role: SimRole, context_length: int, embedding_dim: int,
                 dp_size: int) -> None:
    """Refuse an engine no stock engine of ``kind`` could be, with ``ValueError``."""
    trtllm = kind == "trtllm"
    rules = (  # in order: the first broken one is reported
        (kind not in get_args(EngineKind), f"unknown engine kind {kind!r}"),
        (role not in get_args(SimRole), f"unknown role {role!r}"),
        (trtllm and role != "both", "the TRT-LLM contract has no disaggregation role"),
        (embedding_dim < 0, "embedding_dim must not be negative"),
        (trtllm and bool(embedding_dim), "the TRT-LLM contract serves no embeddings"),
        (context_length < 2, "context_length must be at least 2"),
        (dp_size < 1, "dp_size must be at least 1"),
        (trtllm and dp_size != 1,
         "the TRT-LLM contract has no data-parallel rank: dp_size must be 1"),
    )
    for broken, message in rules:
        if broken:
            raise ValueError(message)


class SimEngine:
    """A simulated SGLang, vLLM or TensorRT-LLM engine on a real gRPC port.

    Timing, batching and the token stream come from :class:`TimingModel` and
    :class:`SimModel`; :attr:`stats` shows what reached the engine. Set
    :attr:`healthy` to False to make health checks fail, and :attr:`faults`
    to make it die, hang, slow down or fail (see :mod:`.faults`).

    ``dp_size`` N > 1 serves N data-parallel ranks behind the one server, as
    vLLM ``--data-parallel-size N`` (internal load balancing) or SGLang ``--dp N``
    do: each rank has its own batch limit, prefix cache and KV-event publisher
    (:attr:`kv_ranks`; with ``kv_events_port`` P rank r publishes on P + r, its
    replay on ``kv_replay_port`` + r). A vLLM request's ``data_parallel_rank``
    pins it (SGLang's, as its stock servicer, is not read); an unpinned one goes
    to the rank with the fewest waiting plus running requests, ties in turn;
    ``stats.rank_of`` says where each ran. The KV sizes
    (``kv_capacity_blocks``, ``kv_pool_tokens``) and ``max_running`` are per rank.
    """

    def __init__(
        self,
        kind: EngineKind,
        *,
        served_model_name: str,
        model_path: str = "sim",
        vocab_size: int,
        eos_token_id: int,
        special_ids: Iterable[int] = frozenset(),
        context_length: int = 4096,
        role: SimRole = "both",
        timing: TimingModel | None = None,
        seed: int = 0,
        eos_probability: float = 0.02,
        kv_pool_tokens: int | None = None,
        page_size: int = 1,
        block_size: int = 16,
        kv_connector: str | None = None,
        trtllm_reported_max_len: int = 1024,
        trtllm_empty_finish_reason: bool = False,
        tokenizer_path: str = "",
        bos_token_id: int = 0,
        pad_token_id: int = 0,
        health_timeout: float = 20.0,
        report_uptime: bool = True,
        serve_get_loads: bool = True,
        text_vocab: TextVocab | None = None,
        unit_probability: float = 0.05,
        faults: FaultPlan | None = None,
        enable_prefix_cache: bool = True,
        kv_capacity_blocks: int | None = None,
        kv_events_port: int | None = None,
        kv_replay_port: int | None = None,
        max_loras: int = 0,
        lora_load_s: float = 0.05,
        embedding_dim: int = 0,
        dp_size: int = 1,
    ) -> None:
        _check_shape(kind, role, context_length, embedding_dim, dp_size)
        disaggregated = role != "both"
        self.kind: EngineKind = kind
        self.model = SimModel(
            vocab_size,
            eos_token_id,
            special_ids,
            eos_probability,
            seed,
            text=text_vocab,
            unit_probability=unit_probability,
        )
        self.timing = timing if timing is not None else TimingModel()
        cache_block = page_size if kind == "sglang" else block_size
        self.config = EngineConfig(
            kind=kind,
            served_model_name=served_model_name,
            model_path=model_path,
            vocab_size=vocab_size,
            eos_token_id=eos_token_id,
            context_length=context_length,
            # Deliberately not the window: SGLang reports this as max_context_length.
            kv_pool_tokens=kv_pool_tokens if kv_pool_tokens is not None else 8 * context_length,
            role=role,
            page_size=page_size,
            block_size=block_size,
            kv_connector=(
                kv_connector
                if kv_connector is not None
                else ("NixlConnector" if disaggregated else "")
            ),
            kv_engine_id=str(uuid.uuid4()) if disaggregated else "",
            trtllm_reported_max_len=trtllm_reported_max_len,
            trtllm_empty_finish_reason=trtllm_empty_finish_reason,
            tokenizer_path=tokenizer_path,
            bos_token_id=bos_token_id,
            pad_token_id=pad_token_id,
            health_timeout=health_timeout,
            report_uptime=report_uptime,
            kv_capacity_tokens=(kv_capacity_blocks or 0) * cache_block,
            serve_get_loads=serve_get_loads,
            embedding_dim=embedding_dim,
            dp_size=dp_size,
        )
        self.core = SimCore(self.config, self.model, self.timing)
        # Each rank's prefix cache (and KV events when a port is given; 0 picks one): kvcache.py.
        capacity = max(1, kv_capacity_blocks or self.config.kv_pool_tokens // cache_block)
        style: HashStyle = "sglang" if kind == "sglang" else "vllm"
        self.kv_ranks = [
            SimKvEvents(
                kind, SimPrefixCache(capacity, cache_block, style, enabled=enable_prefix_cache),
                events_port=kv_events_port, replay_port=kv_replay_port, rank=rank, dp_size=dp_size,
            )
            for rank in range(dp_size)
        ]
        self.kv = self.kv_ranks[0]  # rank 0's, what a single-rank engine has
        self.core.kv_caches = [rank.cache for rank in self.kv_ranks]
        if max_loras > 0 and kind == "sglang":  # the one contract with LoadLoRAAdapter
            self.core.loras = LoraSlots(max_loras, lora_load_s, self._adapter_cache)
        self._injector = FaultInjector(self.core)
        if faults is not None:
            self._injector.install(faults)
        self.host = ""
        self.port = 0
        self._server: _Server | None = None
        self._stopped: asyncio.Event | None = None

    def _adapter_cache(self) -> SimPrefixCache:
        """A prefix cache for one LoRA adapter, shaped like the engine's (events unpublished)."""
        cache = self.kv.cache
        return SimPrefixCache(cache.capacity_blocks, cache.block_size, cache.style,
                              enabled=cache.enabled)

    @classmethod
    def from_model_dir(
        cls,
        kind: EngineKind,
        model_dir: str | Path,
        *,
        served_model_name: str | None = None,
        vocab_size: int | None = None,
        **options: Any,
    ) -> SimEngine:
        """An engine whose vocabulary, EOS and special ids match a HF tokenizer directory.

        Reads ``tokenizer.json`` plus ``generation_config.json`` /
        ``tokenizer_config.json``, so sampled ids decode to real words with the
        frontend's tokenizer. Output is valid text, as a real model's is: only
        ids that decode cleanly, plus whole multi-token characters (pass
        ``text_vocab=None`` to sample every ordinary id). ``vocab_size``
        overrides the tokenizer's; ``options`` are the other constructor arguments.
        """
        facts = read_tokenizer_dir(model_dir)
        directory = str(Path(model_dir).resolve())
        if "text_vocab" not in options:
            options["text_vocab"] = TextVocab.from_model_dir(
                directory, special_ids=facts.special_ids
            )
        options.setdefault("model_path", directory)
        options.setdefault("tokenizer_path", directory)
        if facts.bos_token_id is not None:
            options.setdefault("bos_token_id", facts.bos_token_id)
        if facts.pad_token_id is not None:
            options.setdefault("pad_token_id", facts.pad_token_id)
        return cls(
            kind,
            served_model_name=served_model_name or Path(directory).name,
            vocab_size=facts.vocab_size if vocab_size is None else vocab_size,
            eos_token_id=facts.eos_token_id,
            special_ids=facts.special_ids,
            **options,
        )

    # -- observation ------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """Live counters: running/waiting sequences, aborts, cancellations, ids seen."""
        return self.core.stats

    @property
    def healthy(self) -> bool:
        """What health checks report (the server keeps serving either way)."""
        return self.core.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self.core.healthy = value

    @property
    def faults(self) -> FaultPlan:
        """The live fault plan; mutate it, or assign a new one (from any thread)."""
        return self.core.faults

    @faults.setter
    def faults(self, plan: FaultPlan) -> None:
        self._injector.install(plan)

    @property
    def fault_stats(self) -> FaultStats:
        """Which calls the faults hit: Generate calls seen, died, hung, failed."""
        return self._injector.stats

    @property
    def listening(self) -> bool:
        """Whether new connections are accepted."""
        return self._server is not None and _faults.is_listening(self._server)

    @property
    def kv_publisher(self) -> KvEventPublisher | None:
        """Rank 0's KV-event publisher while running (test helpers: drop_next, reset_sequence)."""
        return self.kv.publisher

    @property
    def kv_events_endpoint(self) -> str | None:
        """``tcp://host:port`` of rank 0's KV-event PUB once started, if enabled."""
        publisher = self.kv.publisher
        return None if publisher is None else publisher.endpoint

    @property
    def kv_replay_endpoint(self) -> str | None:
        """``tcp://host:port`` of rank 0's replay ROUTER once started, if enabled."""
        publisher = self.kv.publisher
        return None if publisher is None else publisher.replay_endpoint

    @property
    def kv_events_endpoints(self) -> list[str]:
        """Every rank's KV-event PUB, in rank order (empty unless started and enabled)."""
        return [p.endpoint for p in self._kv_publishers()]

    @property
    def kv_replay_endpoints(self) -> list[str]:
        """Every rank's replay ROUTER, in rank order (empty unless started and enabled)."""
        return [p.replay_endpoint for p in self._kv_publishers() if p.replay_endpoint]

    def _kv_publishers(self) -> list[KvEventPublisher]:
        return [rank.publisher for rank in self.kv_ranks if rank.publisher is not None]

    @property
    def address(self) -> str:
        """``host:port`` once started."""
        return f"{self.host}:{self.port}"

    # -- lifecycle --------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen on ``host:port`` (0 picks a free port, see :attr:`port`).

        Returns once the socket is listening, so a client may connect at once.
        """
        if self._server is not None:
            raise RuntimeError("the engine is already running")
        servicer = servicer_for(self.core)
        server_log = logging.getLogger(grpclib.server.__name__)
        if _QUIET_CANCELS not in server_log.filters:
            server_log.addFilter(_QUIET_CANCELS)
        sock = await _faults.listen_socket(host, port)
        try:
            server = _Server([servicer])
            self._injector.attach(server)
            await server.start(sock=sock)  # asyncio listens before this returns
        except BaseException:
            sock.close()
            raise
        self._server = server
        self._stopped = asyncio.Event()
        self.host = host
        self.port = int(sock.getsockname()[1])
        self.core.closing = False
        self.core.mark_started()
        for rank in self.kv_ranks:
            rank.start(host)
        _disagg.attach(self.core, host)  # P/D rendezvous between engines on this loop

    def close(self) -> None:
        """Stop like a dying process: refuse connections, drop open ones, end every call."""
        server = self._server
        if server is None or self.core.closing:
            return
        self.core.closing = True
        _disagg.detach(self.core)
        self.core.abort_all()
        for rank in self.kv_ranks:
            rank.close()
        server.close()
        server.drop_connections()
        if self._stopped is not None:
            self._stopped.set()

    async def wait_closed(self) -> None:
        """Wait until every call handler has ended; the engine may then start again."""
        server = self._server
        if server is None:
            return
        await server.wait_closed()
        self._server = None

    async def stop_listening(self) -> None:
        """Refuse new connections, as a wedged or restarting process does; open ones serve on."""
        if self._server is None:
            raise RuntimeError("the engine is not running")
        _faults.stop_listening(self._server)

    async def resume_listening(self) -> None:
        """Accept connections on the same port again (a no-op while listening)."""
        if self._server is None:
            raise RuntimeError("the engine is not running")
        await _faults.resume_listening(self._server, self.host, self.port)

    async def restart(self) -> None:
        """Come back on the same port like a restarted process.

        Every connection is dropped and every running request forgotten; the
        new incarnation reports a new start time and uptime (restart fencing).
        Stats, the fault plan and :meth:`serve_forever` carry on.
        """
        if self._server is None:
            raise RuntimeError("the engine is not running")
        stopped, self._stopped = self._stopped, None  # not a shutdown: serve_forever keeps going
        try:
            self.close()
            await self.wait_closed()
            await self.start(self.host, self.port)
        except BaseException:
            if stopped is not None:
                stopped.set()  # could not come back: let serve_forever end
            raise
        self._stopped = stopped

    async def serve_forever(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Start, call ``ready``, then serve until :meth:`close` or cancellation."""
        await self.start(host, port)
        if ready is not None:
            ready()
        stopped = self._stopped
        assert stopped is not None
        try:
            await stopped.wait()
        finally:
            self.close()
            await self.wait_closed()


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerFacts:
    """What a simulated engine needs to know about a real tokenizer."""

    vocab_size: int
    eos_token_id: int
    special_ids: frozenset[int]
    bos_token_id: int | None = None
    pad_token_id: int | None = None


def read_tokenizer_dir(model_dir: str | Path) -> TokenizerFacts:
    """Vocabulary size, EOS, BOS/PAD and special ids of a HF tokenizer directory.

    EOS comes from ``generation_config.json`` (the first id when it is a
    list), else from ``tokenizer_config.json``'s ``eos_token``.
    """
    root = Path(model_dir)
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    special_ids = {
        token_id
        for token_id, added in tokenizer.get_added_tokens_decoder().items()
        if added.special
    }
    generation = _read_json(root / "generation_config.json")
    tokenizer_config = _read_json(root / "tokenizer_config.json")

    def token_id(key: str) -> int | None:
        value = generation.get(f"{key}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
        token = tokenizer_config.get(f"{key}_token")
        if isinstance(token, Mapping):
            token = token.get("content")
        if isinstance(token, str):
            return tokenizer.token_to_id(token)
        return None

    eos = token_id("eos")
    if eos is None:
        raise ValueError(f"no EOS token id found in {root}")
    return TokenizerFacts(
        vocab_size=vocab_size,
        eos_token_id=eos,
        special_ids=frozenset(special_ids),
        bos_token_id=token_id("bos"),
        pad_token_id=token_id("pad"),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}
