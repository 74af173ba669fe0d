"""Disaggregated serving, the decisions (sans-IO): which engines pair, and which pair serves.

A fleet with prefill-only and decode-only engines serves a request as two
legs (docs/engine-contracts.md §9). The rule, documented in the README: a request
goes P/D whenever some prefill engine and some decode engine of the same
pairing group serve (not excluded by failover); aggregated engines are the
fallback when no pair is left. Each engine's dialect names its pairing group
(``None`` for a kind that cannot do P/D through its contract) and says whether
it can be a named prefill engine.

Each role is routed by its own instance of the fleet's policy, so a pair is
picked like any engine: the decode engine first (it is the one the client is
served from, and the one a retry or migration excludes when it fails), then a
prefill engine beside it. KV-aware routing places the prefill leg (the prefix
cache that saves work lives there); decode engines go least loaded.

What each leg carries, and whether the legs run at once or one after the
other, is the decode engine's dialect's (:meth:`Dialect.pair_legs
<direct_frontend.engines.dialects.base.Dialect.pair_legs>`). The I/O that runs
the legs is :mod:`direct_frontend.pipeline.disagg_driver`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Collection

from direct_frontend.engines.dialects import Dialect, dialect_for
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


@functools.cache
def _dialect(kind: str) -> Dialect:
    return dialect_for(kind)


def pairing_group(engine: EngineHandle) -> str | None:
    """Engines of one group can pair; ``None`` for kinds that cannot do P/D at all."""
    return _dialect(engine.kind).pairing_group(engine)


def _can_prefill(engine: EngineHandle) -> bool:
    return _dialect(engine.kind).can_prefill(engine)


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
        prefill = KvAware(policy.knobs, policy.exact,  # the live sets, shared
                          uses_events=policy.uses_events, diverged=policy.diverged)
        return prefill, LeastLoaded()
    if isinstance(policy, LeastLoaded):
        return LeastLoaded(), LeastLoaded()
    return RoundRobin(), RoundRobin()


@dataclasses.dataclass(frozen=True, slots=True)
class PairPlan:
    """The two legs of one attempt of a disaggregated request (the dialect's legs, placed)."""

    prefill: EngineHandle
    decode: EngineHandle
    prefill_call: GenerateCall
    #: with ``relays_kv_params``: still without the prefill's handoff (see :meth:`decode_after`)
    decode_call: GenerateCall
    parallel: bool  # both legs at once, or the prefill leg first
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


class DisaggPlanner:
    """Picks prefill/decode pairs and has their dialect build the legs; one per dispatcher.

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
        media = () if call.media is None else call.media.kv_items()  # images key their blocks
        request = RequestView(call.input_ids, call.sampling.max_tokens, media_keys=media)
        placement = self.prefill_policy.choose(pool, request, exclude)
        if placement is None:
            return None
        prefill, blocks = placement.engine, placement.blocks
        legs = _dialect(decode.kind).pair_legs(call, prefill, self._rng)
        return PairPlan(prefill, decode, legs.prefill_call, legs.decode_call, legs.parallel,
                        legs.relays_kv_params, blocks)
