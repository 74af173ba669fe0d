"""Prefill/decode roles in the simulator: what each leg must carry, and an observable handoff.

Real engines move the KV between GPUs; the simulator cannot, so it makes the
handoff checkable instead (docs/engine-contracts.md §9):

- vLLM: a prefill engine (``kv_producer``) asked for ``do_remote_decode``
  returns NIXL-shaped handoff parameters in its terminal ``complete``; a
  decode engine (``kv_consumer``) refuses a request without
  ``do_remote_prefill`` parameters (``INVALID_ARGUMENT``) and reports the
  transferred prefix (``remote_block_ids`` × block size, at most the prompt)
  as ``cached_tokens``, spending no prefill time on it.
- SGLang: prefill and decode engines refuse a request without a bootstrap
  rendezvous; the prefill leg stops after its first token, as a prefill
  server does; the decode leg reports the prompt as cached. When the named
  prefill engine is simulated on the same event loop (engines embedded in
  one daemon), the decode leg also waits, at most :data:`ROOM_WAIT_S`, until
  the prefill leg of its room has prefilled on that engine (its KV is
  ready), as a real decode engine waits for the transfer; otherwise it can
  only check that the rendezvous is there.

Every rendezvous or ``kv_transfer_params_json`` an engine receives, and
every handoff it returns, lands in its stats by request id.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import weakref
from typing import Any

from grpclib import GRPCError, Status

from direct_frontend.simulator.core import SimCore

ROOM_WAIT_S = 30.0  # how long a decode leg waits for its prefill leg's KV
NIXL_SIDE_CHANNEL_PORT = 5600
_ROOMS_KEPT = 4096  # rooms remembered per bootstrap address (never-claimed ones age out)


@dataclasses.dataclass(frozen=True, slots=True)
class Handoff:
    """What a leg's role changes about one Generate call."""

    max_tokens: int | None = None  # a cap on the output (an SGLang prefill leg: one token)
    transferred: int = 0  # prompt tokens whose KV arrived from a prefill engine
    returns: str | None = None  # vLLM prefill: kv_transfer_params_json for the complete
    ready: asyncio.Event | None = None  # SGLang prefill: set once its KV is ready

    def cap(self, max_tokens: int) -> int:
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)

    def prefilled(self) -> None:
        """The leg has run: a decode leg waiting for this room may start."""
        if self.ready is not None:
            self.ready.set()


class _Bootstrap:
    """The rooms seen at one bootstrap address (engines sharing an address share it)."""

    def __init__(self) -> None:
        self.rooms: collections.OrderedDict[int, asyncio.Event] = collections.OrderedDict()
        self.engines = 0

    def room(self, room: int) -> asyncio.Event:
        event = self.rooms.get(room)
        if event is None:
            event = self.rooms[room] = asyncio.Event()
            while len(self.rooms) > _ROOMS_KEPT:
                self.rooms.popitem(last=False)
        return event


@dataclasses.dataclass(eq=False, slots=True)
class _Attached:
    host: str
    key: tuple[asyncio.AbstractEventLoop, str, int]
    next_block: int = 0


_bootstraps: dict[tuple[asyncio.AbstractEventLoop, str, int], _Bootstrap] = {}
_attached: weakref.WeakKeyDictionary[SimCore, _Attached] = weakref.WeakKeyDictionary()


def attach(core: SimCore, host: str) -> None:
    """The engine now listens on ``host`` (call on its event loop, from ``start``)."""
    detach(core)
    key = (asyncio.get_running_loop(), host, core.config.bootstrap_port)
    _attached[core] = _Attached(host, key)
    if core.config.kind == "sglang" and core.config.role == "prefill":
        _bootstraps.setdefault(key, _Bootstrap()).engines += 1


def detach(core: SimCore) -> None:
    """The engine stopped: a decode leg no longer waits for rooms at its address."""
    attached = _attached.pop(core, None)
    if attached is None or attached.key not in _bootstraps:
        return
    bootstrap = _bootstraps[attached.key]
    bootstrap.engines -= 1
    if bootstrap.engines <= 0:
        del _bootstraps[attached.key]


async def sglang_leg(core: SimCore, request: Any, prompt_tokens: int) -> Handoff:
    """Check an SGLang Generate against the engine's role; a decode leg meets its prefill."""
    role = core.config.role
    params = request.disaggregated_params
    present = (
        request.HasField("disaggregated_params")
        and params.bootstrap_host != ""  # the servicer treats "" and 0 as unset
        and params.bootstrap_port != 0
    )
    if present:
        core.stats.kv_params_received[request.request_id] = json.dumps({
            "bootstrap_host": params.bootstrap_host,
            "bootstrap_port": params.bootstrap_port,
            "bootstrap_room": params.bootstrap_room,
        })
    if role == "both":
        return Handoff()
    if not present:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"disaggregation mode {role} needs bootstrap_host, bootstrap_port and bootstrap_room",
        )
    room = params.bootstrap_room
    if role == "prefill":
        attached = _attached.get(core)
        bootstrap = _bootstraps.get(attached.key) if attached is not None else None
        return Handoff(max_tokens=1, ready=bootstrap.room(room) if bootstrap else None)
    key = (asyncio.get_running_loop(), params.bootstrap_host, params.bootstrap_port)
    bootstrap = _bootstraps.get(key)
    if bootstrap is not None:  # the prefill engine is ours to watch
        try:  # asyncio.timeout, not wait_for: a cancelled call stays cancelled (core.probe)
            async with asyncio.timeout(ROOM_WAIT_S):
                await bootstrap.room(room).wait()
        except TimeoutError:
            raise GRPCError(
                Status.INTERNAL,
                f"Request aborted: bootstrap room {room} never reached "
                f"{params.bootstrap_host}:{params.bootstrap_port}",
            ) from None
        finally:
            bootstrap.rooms.pop(room, None)
    return Handoff(transferred=prompt_tokens)


def vllm_leg(core: SimCore, request: Any, prompt_tokens: int) -> Handoff:
    """Check a vLLM Generate against the engine's role; a prefill leg prepares its handoff."""
    role = core.config.role
    params: dict[str, Any] | None = None
    if request.HasField("kv_transfer_params_json"):  # already checked to be an object
        core.stats.kv_params_received[request.request_id] = request.kv_transfer_params_json
        params = json.loads(request.kv_transfer_params_json)
    if role == "decode":
        if params is None or params.get("do_remote_prefill") is not True:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                "this kv_consumer engine needs kv_transfer_params_json with "
                "do_remote_prefill (the prefill leg's handoff)",
            )
        blocks = params.get("remote_block_ids")
        size = core.config.block_size
        if isinstance(blocks, list):
            return Handoff(transferred=min(prompt_tokens, len(blocks) * size))
        return Handoff(transferred=prompt_tokens)  # Mooncake names a transfer, not blocks
    if (
        role == "prefill"
        and params is not None
        and params.get("do_remote_decode") is True
        and core.config.connector != "MooncakeConnector"
    ):
        attached = _attached.get(core)
        count = math.ceil(prompt_tokens / core.config.block_size)
        first = 0
        if attached is not None:
            first, attached.next_block = attached.next_block, attached.next_block + count
        handoff = json.dumps({
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(first, first + count)),
            "remote_engine_id": core.config.kv_engine_id,
            "remote_host": attached.host if attached is not None else "127.0.0.1",
            "remote_port": NIXL_SIDE_CHANNEL_PORT,
            "tp_size": 1,
        })
        core.stats.kv_params_returned[request.request_id] = handoff
        return Handoff(returns=handoff)
    return Handoff()
