"""``SimEngine``: one simulated stock engine serving its real gRPC contract.

It runs on the asyncio loop that is current when :meth:`SimEngine.start` is
awaited and never creates one, so the daemon can embed engines under
trio-asyncio while the standalone CLI uses plain asyncio.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpclib.const
import grpclib.protocol
import grpclib.server
from google.protobuf import empty_pb2
from grpclib import GRPCError, Status

from direct_frontend.simulator import disagg as _disagg
from direct_frontend.simulator import faults as _faults
from direct_frontend.simulator.core import EngineStats, SimCore
from direct_frontend.simulator.faults import FaultInjector, FaultPlan, FaultStats
from direct_frontend.simulator.kv_publisher import KvEventPublisher, SimKvEvents
from direct_frontend.simulator.kvcache import HashStyle, SimPrefixCache
from direct_frontend.simulator.lora import LoraSlots
from direct_frontend.simulator.model import SimModel
from direct_frontend.simulator.servicers import servicer_for
from direct_frontend.simulator.settings import EngineConfig, EngineKind


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


class SimEngine:
    """A simulated SGLang, vLLM or TensorRT-LLM engine on a real gRPC port.

    Timing, batching and the token stream come from :class:`TimingModel` and
    :class:`SimModel`; :attr:`stats` shows what reached the engine. Set
    :attr:`healthy` to False to make health checks fail, and :attr:`faults`
    to make it die, hang, slow down or fail (see :mod:`.faults`).

    ``config.dp_size`` N > 1 serves N data-parallel ranks behind the one server,
    as vLLM ``--data-parallel-size N`` (internal load balancing) or SGLang ``--dp N``
    do: each rank has its own batch limit, prefix cache and KV-event publisher
    (:attr:`kv_ranks`). A vLLM request's ``data_parallel_rank`` pins it (SGLang's,
    as its stock servicer, is not read); an unpinned one goes to the rank with the
    fewest waiting plus running requests, ties in turn; ``stats.rank_of`` says
    where each ran.
    """

    def __init__(self, config: EngineConfig, *, faults: FaultPlan | None = None) -> None:
        """An engine set up as ``config`` says, with ``faults`` as its initial live plan."""
        if config.disaggregated and not config.kv_engine_id:  # each engine its own NIXL id
            config = dataclasses.replace(config, kv_engine_id=str(uuid.uuid4()))
        self.kind: EngineKind = config.kind
        self.config = config
        self.model = SimModel(
            config.vocab_size,
            config.eos_token_id,
            config.special_ids,
            config.eos_probability,
            config.seed,
            text=config.text_vocab,
            unit_probability=config.unit_probability,
        )
        self.core = SimCore(config, self.model)
        # Each rank's prefix cache (and KV events when a port is given; 0 picks one): kvcache.py.
        style: HashStyle = "sglang" if config.kind == "sglang" else "vllm"
        self.kv_ranks = [
            SimKvEvents(
                config.kind,
                SimPrefixCache(config.cache_capacity_blocks, config.cache_block, style,
                               enabled=config.enable_prefix_cache),
                events_port=config.kv_events_port, replay_port=config.kv_replay_port,
                rank=rank, dp_size=config.dp_size,
            )
            for rank in range(config.dp_size)
        ]
        self.kv = self.kv_ranks[0]  # rank 0's, what a single-rank engine has
        self.core.kv_caches = [rank.cache for rank in self.kv_ranks]
        if config.max_loras > 0 and config.kind == "sglang":  # the contract with LoadLoRAAdapter
            self.core.loras = LoraSlots(config.max_loras, config.lora_load_s, self._adapter_cache)
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
        cls, kind: EngineKind, model_dir: str | Path, *, faults: FaultPlan | None = None,
        **settings: Any,
    ) -> SimEngine:
        """An engine of :meth:`EngineConfig.from_model_dir` ``(kind, model_dir, **settings)``."""
        return cls(EngineConfig.from_model_dir(kind, model_dir, **settings), faults=faults)

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
