"""Embedded simulated engines (``simulate = true``): started and stopped beside their incarnations.

The simulator is a product of its own (:mod:`direct_frontend.simulator`);
this room only runs one on an engine's own URL, over real gRPC on loopback,
and shares it between incarnations whose simulator settings did not change.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import trio

from direct_frontend.control.child import EngineChild, host_port
from direct_frontend.fleet.schema import EngineConfig, FleetConfig

log = logging.getLogger("direct_frontend.supervisor")


@dataclasses.dataclass(eq=False)
class _SimSlot:
    """One simulator listening on one port, shared by the incarnations that fit it."""

    key: Hashable
    users: set[int] = dataclasses.field(default_factory=set)  # incarnations
    engine: Any = None
    stop: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    stopped: trio.Event = dataclasses.field(default_factory=trio.Event)


class SimulatorPool:
    """Embedded simulators (``simulate = true``), one per port, reference-counted.

    A replaced engine whose simulator settings did not change keeps the same
    simulator (its requests in flight survive); one whose settings changed
    gets a new simulator once the old incarnation has drained off the port.
    """

    def __init__(self, fleet: Callable[[], FleetConfig]) -> None:
        self._fleet = fleet
        self._slots: dict[int, _SimSlot] = {}
        self._locks: dict[int, trio.Lock] = {}
        self._by_generation: dict[int, _SimSlot] = {}

    def engine_of(self, incarnation: int) -> Any:
        slot = self._by_generation.get(incarnation)
        return None if slot is None else slot.engine

    def blocks(self, holder: EngineChild, child: EngineChild) -> bool:
        """Whether ``child`` must wait for ``holder``'s simulator to stop to get its port.

        True when ``child`` is simulated on the port ``holder``'s simulator
        listens on, with other simulator settings, and has no simulator yet.
        """
        slot = self._by_generation.get(holder.incarnation)
        return (
            slot is not None
            and child.cfg.simulate
            and child.incarnation not in self._by_generation
            and self._slots.get(host_port(child.cfg.url)[1]) is slot
            and slot.key != self._key(child.cfg)
        )

    def _key(self, cfg: EngineConfig) -> Hashable:
        return (cfg.kind, cfg.role, cfg.simulator, *simulated_model(self._fleet(), cfg))

    async def acquire(self, nursery: trio.Nursery, child: EngineChild) -> None:
        port = host_port(child.cfg.url)[1]
        key = self._key(child.cfg)
        async with self._locks.setdefault(port, trio.Lock()):
            while (slot := self._slots.get(port)) is not None and slot.key != key:
                await slot.stopped.wait()  # the previous incarnation is still draining
            if slot is None:
                slot = _SimSlot(key)
                self._slots[port] = slot
                try:
                    await nursery.start(self._serve, port, child.cfg, slot)
                except BaseException:
                    self._slots.pop(port, None)
                    raise
            slot.users.add(child.incarnation)
            self._by_generation[child.incarnation] = slot

    def release(self, child: EngineChild) -> None:
        slot = self._by_generation.pop(child.incarnation, None)
        if slot is None:
            return
        slot.users.discard(child.incarnation)
        if not slot.users:
            slot.stop.cancel()

    async def _serve(
        self, port: int, cfg: EngineConfig, slot: _SimSlot,
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            with slot.stop:
                slot.engine = await start_embedded_simulator(self._fleet(), cfg)
                try:
                    task_status.started()
                    await trio.sleep_forever()
                finally:
                    await stop_embedded_simulator(slot.engine)
        finally:
            if self._slots.get(port) is slot:
                del self._slots[port]
            slot.stopped.set()


def simulated_model(fleet: FleetConfig, cfg: EngineConfig) -> tuple[Path, str]:
    """(tokenizer, served name) a simulated engine serves: its model's, else [frontend]'s.

    ``simulator.served_model_name`` wins for the name (set it to demo a refusal).
    """
    model = fleet.engine_model(cfg)
    tokenizer = fleet.frontend.tokenizer if model is None else model.tokenizer
    name = model.name if model is not None else fleet.frontend.served_model_name
    return tokenizer, cfg.simulator.served_model_name or name


async def start_embedded_simulator(fleet: FleetConfig, cfg: EngineConfig) -> Any:
    """Serve a simulated engine on the engine's own URL, over real gRPC on loopback."""
    import trio_asyncio

    from direct_frontend.simulator.engine import SimEngine
    from direct_frontend.simulator.model import TimingModel

    host, port = host_port(cfg.url)
    sim = cfg.simulator
    tokenizer, served_model_name = simulated_model(fleet, cfg)
    engine = SimEngine.from_model_dir(
        cfg.kind,
        tokenizer,
        served_model_name=served_model_name,
        context_length=sim.context_length,
        role=cfg.role.value,
        vocab_size=sim.vocab_size,
        timing=TimingModel(sim.prefill_us_per_token, sim.decode_us_per_token, sim.max_running),
        eos_probability=sim.eos_probability,
        unit_probability=sim.multibyte_probability,
        block_size=cfg.block_size or 16,
        page_size=cfg.block_size or 16,
        # publish KV events where the fleet file says: one rank per endpoint, from the first
        # port on (the fleet file's check holds them to base port + rank)
        dp_size=len(cfg.kv_events) or cfg.dp_ranks or 1,
        kv_events_port=_port_of(cfg.kv_events[0]) if cfg.kv_events else None,
        kv_replay_port=_port_of(cfg.kv_replay[0]) if cfg.kv_replay else None,
        max_loras=sim.max_loras,
        lora_load_s=sim.lora_load_ms / 1000,
        embedding_dim=sim.embedding_dim,
    )
    await trio_asyncio.aio_as_trio(engine.start)(host, port)
    log.info("simulated %s engine listening on %s:%d", cfg.kind, host, port)
    return engine


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


async def stop_embedded_simulator(engine: Any) -> None:
    """Close like a dying process; bounded, and done even when we are being cancelled."""
    import trio_asyncio

    engine.close()
    with trio.CancelScope(shield=True), trio.move_on_after(2):
        await trio_asyncio.aio_as_trio(engine.wait_closed)()
