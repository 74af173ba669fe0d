"""Disaggregated serving, the decisions (sans-IO): which engines pair, and what each leg carries.

A fleet with prefill-only and decode-only engines serves a request as two
legs (docs/engine-contracts.md §9). The rule, documented in the README: a request
goes P/D whenever some prefill engine and some decode engine of the same
pairing group serve (not excluded by failover); aggregated engines are the
fallback when no pair is left. A pairing group is an engine kind that can do
P/D through its contract (never TensorRT-LLM), and for vLLM also the KV
connector, since a NIXL prefill cannot hand its KV to a Mooncake decode.

Each role is routed by its own instance of the fleet's policy, so a pair is
picked like any engine: the decode engine first (it is the one the client is
served from, and the one a retry or migration excludes when it fails), then a
prefill engine beside it. KV-aware routing places the prefill leg (the prefix
cache that saves work lives there); decode engines go least loaded.

The legs:

- SGLang: both legs carry the same bootstrap rendezvous (the prefill
  engine's host and bootstrap port, a random room in ``[0, 2^31 - 1)``) and
  run in parallel; the client is served from the decode leg.
- vLLM: the prefill leg runs first with ``max_tokens = 1`` and
  ``{"do_remote_decode": true, "do_remote_prefill": false}``; NIXL (and any
  connector but Mooncake) returns handoff parameters in its terminal message,
  relayed verbatim to the decode leg. Mooncake instead pairs the legs by a
  router-minted ``transfer_id``, and the decode leg names the prefill engine.

The I/O that runs the legs is :mod:`direct_frontend.pipeline.disagg_driver`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Collection
from urllib.parse import urlsplit

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.neutral import Disaggregation, EngineRole, Finished, GenerateCall
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.kv_aware import KvAware
from direct_frontend.routing.policies import (
    LeastLoaded,
    Placement,
    Policy,
    RequestView,
    RoundRobin,
)

ROOM_LIMIT = 2**31 - 1  # bootstrap_room is an int32: rooms are drawn from [0, ROOM_LIMIT)
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port (and Mooncake's) default
MOONCAKE = "MooncakeConnector"
NIXL = "NixlConnector"


def _json(value: dict[str, object]) -> str:
    return json.dumps(value, separators=(",", ":"))


#: what a vLLM prefill leg asks of its engine: compute the KV, keep it for a remote decode
PREFILL_PARAMS = _json({"do_remote_decode": True, "do_remote_prefill": False})


@functools.cache
def _can_pair(kind: str) -> bool:
    return dialect_for(kind).capabilities.prefill_decode


def kv_connector(engine: EngineHandle) -> str:
    """A vLLM engine's KV connector as discovery reported it (NIXL when unreported)."""
    return dict(engine.info.details).get("kv_connector") or NIXL


def pairing_group(engine: EngineHandle) -> str | None:
    """Engines of one group can pair; ``None`` for kinds that cannot do P/D at all."""
    if not _can_pair(engine.kind):
        return None
    if engine.kind == "vllm":
        return f"vllm/{kv_connector(engine)}"
    return engine.kind


def _can_prefill(engine: EngineHandle) -> bool:
    # Mooncake names the prefill engine by id, which gets a _dp<rank> suffix with DP > 1;
    # we do not pin ranks, so such an engine cannot be named reliably.
    return not (
        engine.kind == "vllm"
        and kv_connector(engine) == MOONCAKE
        and engine.info.data_parallel_size > 1
    )


def _members(catalog: Catalog, role: EngineRole, group: str | None = None) -> list[EngineHandle]:
    return [
        e for e in catalog.engines
        if e.role is role and (g := pairing_group(e)) is not None and (group is None or g == group)
        and (role is not EngineRole.PREFILL or _can_prefill(e))
    ]


def pairable_groups(catalog: Catalog, exclude: Collection[str] = ()) -> set[str]:
    """Groups with at least one prefill and one decode engine not excluded."""
    prefill = {pairing_group(e) for e in _members(catalog, EngineRole.PREFILL)
               if e.name not in exclude}
    decode = {pairing_group(e) for e in _members(catalog, EngineRole.DECODE)
              if e.name not in exclude}
    return {g for g in prefill & decode if g is not None}


@dataclasses.dataclass(frozen=True, slots=True)
class _Pool(Catalog):
    """One role's engines, which a policy sees as if they were aggregated ones."""

    @property
    def aggregated(self) -> tuple[EngineHandle, ...]:
        return self.engines


def role_policies(policy: Policy) -> tuple[Policy, Policy]:
    """Fresh (prefill, decode) policies modelled on the fleet's.

    KV-aware routing applies to the prefill leg (sharing the KV-event index);
    a decode engine receives its KV by transfer, so it goes least loaded.
    """
    if isinstance(policy, KvAware):
        prefill = KvAware(policy.knobs, policy.exact)
        prefill.uses_events = policy.uses_events  # the live set, shared
        return prefill, LeastLoaded()
    if isinstance(policy, LeastLoaded):
        return LeastLoaded(), LeastLoaded()
    return RoundRobin(), RoundRobin()


@dataclasses.dataclass(frozen=True, slots=True)
class PairPlan:
    """The two legs of one attempt of a disaggregated request."""

    prefill: EngineHandle
    decode: EngineHandle
    prefill_call: GenerateCall
    #: NIXL-style vLLM: still without the prefill's handoff (see :meth:`decode_after`)
    decode_call: GenerateCall
    parallel: bool  # SGLang: both legs at once; vLLM: the prefill leg first
    relays_kv_params: bool  # the decode leg carries what the prefill leg returned
    prefill_blocks: tuple[int, ...] = ()  # the prompt's KV blocks, in the prefill engine's load

    def decode_after(self, finished: Finished) -> GenerateCall:
        """The decode leg once the prefill leg has ended with ``finished``."""
        if not self.relays_kv_params:
            return self.decode_call
        params = finished.kv_transfer_params_json
        if params is None:
            raise EngineError(
                ErrorKind.INTERNAL,
                "the prefill leg returned no kv_transfer_params (is a KV connector configured?)",
                engine=self.prefill.name,
            )
        return dataclasses.replace(
            self.decode_call, disaggregation=Disaggregation(kv_transfer_params_json=params)
        )


def sglang_legs(
    call: GenerateCall, prefill: EngineHandle, room: int
) -> tuple[GenerateCall, GenerateCall]:
    """(prefill, decode) legs sharing one rendezvous; the prefill result is only drained."""
    rendezvous = Disaggregation(
        bootstrap_host=urlsplit(prefill.url).hostname or "",
        bootstrap_port=prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
        bootstrap_room=room,
    )
    return (
        dataclasses.replace(call, stream=False, disaggregation=rendezvous),
        dataclasses.replace(call, disaggregation=rendezvous),
    )


def vllm_prefill_leg(call: GenerateCall, params_json: str = PREFILL_PARAMS) -> GenerateCall:
    """The prefill leg: one token (discarded), the KV kept for the decode engine."""
    sampling = dataclasses.replace(call.sampling, max_tokens=1, min_tokens=0)
    return dataclasses.replace(
        call, sampling=sampling, stream=False,
        disaggregation=Disaggregation(kv_transfer_params_json=params_json),
    )


def mooncake_legs(
    call: GenerateCall, prefill: EngineHandle, transfer_id: str
) -> tuple[GenerateCall, GenerateCall]:
    """Mooncake: both legs name the router's ``transfer_id``; the decode names the prefill."""
    host = urlsplit(prefill.url).hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    prefill_params = _json(
        {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    )
    decode_params = _json({
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": dict(prefill.info.details).get("kv_engine_id", ""),
        "remote_bootstrap_addr": f"http://{host}:{port}",
    })
    return (
        vllm_prefill_leg(call, prefill_params),
        dataclasses.replace(
            call, disaggregation=Disaggregation(kv_transfer_params_json=decode_params)
        ),
    )


class DisaggPlanner:
    """Picks prefill/decode pairs and builds their legs; one per dispatcher.

    It follows the fleet's policy: when a reload replaces that policy, the
    per-role policies are rebuilt from the new one.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._source: Policy | None = None
        self.prefill_policy: Policy = RoundRobin()
        self.decode_policy: Policy = RoundRobin()
        self._before: tuple[Policy | None, Policy, Policy] = (None, RoundRobin(), RoundRobin())

    def follow(self, policy: Policy) -> None:
        """Pair with per-role policies modelled on ``policy``, the fleet policy of a request.

        Requests admitted before a reload still carry the fleet policy before
        it, so the role policies of that one are kept too: a retry of such a
        request going back to them loses no routing state.
        """
        if policy is self._source:
            return
        before = (self._source, self.prefill_policy, self.decode_policy)
        if policy is self._before[0]:
            _, self.prefill_policy, self.decode_policy = self._before
        else:
            self.prefill_policy, self.decode_policy = role_policies(policy)
        self._source = policy
        self._before = before

    def choose_decode(
        self,
        catalog: Catalog,
        request: RequestView,
        exclude: Collection[str] = (),
        fleet_policy: Policy | None = None,
    ) -> Placement | None:
        """The decode engine's placement for a P/D pair, or ``None``: serve it aggregated."""
        if fleet_policy is not None:
            self.follow(fleet_policy)
        groups = pairable_groups(catalog, exclude)
        if not groups:
            return None
        decodes = tuple(
            e for e in _members(catalog, EngineRole.DECODE) if pairing_group(e) in groups
        )
        return self.decode_policy.choose(_Pool(catalog.version, decodes), request, exclude)

    def mint_room(self) -> int:
        return self._rng.randrange(ROOM_LIMIT)

    def mint_transfer_id(self) -> str:
        return f"{self._rng.getrandbits(128):032x}"

    def plan(
        self,
        catalog: Catalog,
        decode: EngineHandle,
        call: GenerateCall,
        exclude: Collection[str] = (),
    ) -> PairPlan | None:
        """Pick a prefill engine for ``decode`` and build both legs; ``None`` if none serves."""
        group = pairing_group(decode)
        if group is None:
            return None
        pool = _Pool(catalog.version, tuple(_members(catalog, EngineRole.PREFILL, group)))
        request = RequestView(call.input_ids, call.sampling.max_tokens)
        placement = self.prefill_policy.choose(pool, request, exclude)
        if placement is None:
            return None
        prefill, blocks = placement.engine, placement.blocks
        if decode.kind == "sglang":
            prefill_call, decode_call = sglang_legs(call, prefill, self.mint_room())
            return PairPlan(prefill, decode, prefill_call, decode_call, True, False, blocks)
        if kv_connector(prefill) == MOONCAKE:
            prefill_call, decode_call = mooncake_legs(call, prefill, self.mint_transfer_id())
            return PairPlan(prefill, decode, prefill_call, decode_call, False, False, blocks)
        return PairPlan(prefill, decode, vllm_prefill_leg(call), call, False, True, blocks)
