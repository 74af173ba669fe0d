"""LoRA adapters served under their own names: adapter-aware placement, loading on demand.

An adapter's requests go to its base model's engines whose contract carries
an adapter (``Capabilities.lora_adapters``). Placement prefers an engine that
holds the adapter already (:class:`AdapterPolicy`); failing that, the base
policy picks among the capable ones, and before the call runs there the
adapter is loaded (``LoadLoRAAdapter``), the least recently used idle adapter
unloaded first when the engine already holds ``max_adapters_per_engine``
(:class:`AdapterDispatcher`). What each engine holds is our own record
(:class:`Residency`, sans-IO), set from the engines' replies, which list what
they hold after each load and unload; an engine is asked once what it holds
before its first load (adapters preloaded at its start count).

An adapter is a cache namespace of its own: its policy never reads the
fleet's KV-event index (whose blocks carry no adapter), only its own prefix
memory, so an adapter's cache never credits another's, or the base model's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Collection, Sequence

import trio

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import Dialect, LoraReply
from direct_frontend.engines.neutral import EngineRole, GenerateCall
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.fleet.schema import AdapterConfig
from direct_frontend.pipeline.dispatch import Dispatcher, EngineCall, WaitableFleet
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.policies import Placement, Policy, RequestView

log = logging.getLogger("direct_frontend.adapters")

#: how long one LoadLoRAAdapter / UnloadLoRAAdapter / list may take
LORA_RPC_TIMEOUT_S = 60.0


def carries_adapters(engine: EngineHandle) -> bool:
    """Whether ``engine`` may serve an adapter: its contract carries one, it serves alone."""
    return dialect_for(engine.kind).capabilities.lora_adapters and engine.role is EngineRole.BOTH


@dataclasses.dataclass(slots=True)
class _Held:
    """The adapters one engine incarnation holds, least recently used first."""

    order: collections.OrderedDict[str, None] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    in_use: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    listed: bool = False  # asked once what it holds


class Residency:
    """Which adapters each engine of one base model holds, and which to unload (sans-IO)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: dict[int, _Held] = {}

    def of(self, incarnation: int) -> _Held:
        held = self._held.get(incarnation)
        if held is None:
            held = self._held[incarnation] = _Held()
        return held

    def holds(self, incarnation: int, adapter: str) -> bool:
        held = self._held.get(incarnation)
        return held is not None and adapter in held.order

    def touch(self, incarnation: int, adapter: str) -> None:
        self.of(incarnation).order.move_to_end(adapter)

    def sync(self, incarnation: int, loaded: Sequence[str]) -> None:
        """What the engine says it holds now (its reply to a load, an unload or a list)."""
        held = self.of(incarnation)
        held.listed = True
        for name in [n for n in held.order if n not in loaded]:
            del held.order[name]
        for name in loaded:
            if name not in held.order:
                held.order[name] = None

    def victim(self, incarnation: int) -> str | None:
        """The adapter to unload before another can load, or None if a slot is free.

        Raises :class:`EngineError` (``OVERLOADED``: another engine may serve) when
        every slot holds an adapter with requests running.
        """
        held = self.of(incarnation)
        if len(held.order) < self.capacity:
            return None
        for name in held.order:
            if not held.in_use[name]:
                return name
        raise EngineError(ErrorKind.OVERLOADED,
                          f"all {self.capacity} LoRA slots hold adapters in use")

    def begin(self, incarnation: int, adapter: str) -> None:
        self.of(incarnation).in_use[adapter] += 1

    def end(self, incarnation: int, adapter: str) -> None:
        held = self.of(incarnation)
        held.in_use[adapter] -= 1
        if held.in_use[adapter] <= 0:
            del held.in_use[adapter]

    def prune(self, live: Collection[int]) -> None:
        """Forget incarnations no longer serving (bounded memory)."""
        for incarnation in [i for i in self._held if i not in live]:
            del self._held[incarnation]


class AdapterPolicy:
    """The base policy, over the engines that hold the adapter when any can take the request."""

    def __init__(self, inner: Policy, residency: Residency, adapter: AdapterConfig) -> None:
        self.inner = inner
        self.residency = residency
        self.adapter = adapter
        self.name = f"{inner.name}+lora"

    def choose(
        self, catalog: Catalog, request: RequestView, exclude: Collection[str] = ()
    ) -> Placement | None:
        name = self.adapter.name
        holding = tuple(e for e in catalog.engines if self.residency.holds(e.incarnation, name))
        if holding:
            placement = self.inner.choose(Catalog(catalog.version, holding), request, exclude)
            if placement is not None:
                return placement
        if self.adapter.path is None:
            return None  # preloaded only: no engine can be given it
        return self.inner.choose(catalog, request, exclude)

    def on_complete(self, placement: Placement, prompt: Sequence[int],
                    answer: Sequence[int]) -> None:
        self.inner.on_complete(placement, prompt, answer)


class AdapterDispatcher(Dispatcher):
    """Runs an adapter's calls: loads the adapter on the engine first if it lacks it."""

    def __init__(
        self, fleet: WaitableFleet, adapter: AdapterConfig, residency: Residency,
        locks: dict[int, trio.Lock],
    ) -> None:
        super().__init__(fleet)
        self.adapter = adapter
        self.residency = residency
        self._locks = locks  # one per engine incarnation, shared by the model's adapters

    @contextlib.asynccontextmanager
    async def run(
        self, placement: Placement, call: GenerateCall, *, exclude: Collection[str] = (),
        stall_timeout_s: float,
    ) -> AsyncIterator[EngineCall]:
        """The dispatcher's run of ``call`` naming the adapter, on an engine holding it."""
        engine, name = placement.engine, self.adapter.name
        call = dataclasses.replace(call, lora_id=name)
        try:
            await self.ensure(engine)
        except EngineError as error:  # the relay tries another engine, as for any failure
            raise error.at(engine.name) from None
        self.residency.begin(engine.incarnation, name)
        try:
            async with super().run(placement, call, exclude=exclude,
                                   stall_timeout_s=stall_timeout_s) as engine_call:
                yield engine_call
        finally:
            self.residency.end(engine.incarnation, name)

    async def ensure(self, engine: EngineHandle) -> None:
        """The adapter is loaded on ``engine`` when this returns (else an :class:`EngineError`)."""
        residency, adapter = self.residency, self.adapter
        incarnation = engine.incarnation
        residency.prune({e.incarnation for e in self.fleet.catalog.engines})
        self._locks.setdefault(incarnation, trio.Lock())
        async with self._locks[incarnation]:  # one load or unload at a time per engine
            if not residency.of(incarnation).listed:
                reply = await _unary(engine, engine.transport.dialect.list_loras())
                residency.sync(incarnation, reply.loaded)
            if residency.holds(incarnation, adapter.name):
                residency.touch(incarnation, adapter.name)
                return
            if adapter.path is None:
                raise EngineError(ErrorKind.OVERLOADED, f"LoRA adapter {adapter.name!r} has no"
                                  " path to load from and is not loaded here", engine=engine.name)
            dialect: Dialect = engine.transport.dialect
            while (victim := residency.victim(incarnation)) is not None:
                reply = await _unary(engine, dialect.unload_lora(victim, victim))
                residency.sync(incarnation, reply.loaded)
                log.info("engine %s: unloaded LoRA adapter %s (least recently used)",
                         engine.name, victim, extra={"engine": engine.name})
                if not reply.ok:
                    raise EngineError(ErrorKind.OVERLOADED, reply.message, engine=engine.name)
            reply = await _unary(engine, dialect.load_lora(adapter.name, adapter.name,
                                                           adapter.path))
            residency.sync(incarnation, reply.loaded)
            if not reply.ok or not residency.holds(incarnation, adapter.name):
                raise EngineError(ErrorKind.OVERLOADED,
                                  f"could not load LoRA adapter {adapter.name!r}: {reply.message}",
                                  engine=engine.name)
            log.info("engine %s: loaded LoRA adapter %s", engine.name, adapter.name,
                     extra={"engine": engine.name})


async def _unary(engine: EngineHandle, rpc: object) -> LoraReply:
    reply = await engine.transport.unary(rpc, LORA_RPC_TIMEOUT_S)
    result: LoraReply = engine.transport.dialect.lora_reply(reply)
    return result
