"""Dispatch: place a request on the fleet, and run one attempt of it there.

This is the seam where retries and migration (fault tolerance) wrap one
engine call (:mod:`direct_frontend.pipeline.leg`). A placement on a decode
engine heads a prefill/decode pair: the request goes disaggregated
(:mod:`direct_frontend.pipeline.disagg`), and running it runs the prefill
leg too (:mod:`~direct_frontend.pipeline.disagg_driver`), so the relay above
sees one engine call either way. A request that finds no engine it may use
waits on the fleet for the catalog to change (:class:`WaitableFleet`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from direct_frontend.engines.neutral import EngineRole, GenerateCall
from direct_frontend.errors import NoEngineAvailable
from direct_frontend.pipeline.disagg import DisaggPlanner
from direct_frontend.pipeline.disagg_driver import run_pair
from direct_frontend.pipeline.leg import EngineCall, FleetView, run_leg
from direct_frontend.routing.catalog import Catalog, EngineHandle
from direct_frontend.routing.policies import Placement, Policy, RequestView

__all__ = ["Dispatcher", "EngineCall", "FleetView", "WaitableFleet"]


class WaitableFleet(FleetView, Protocol):
    """The fleet as requests see it, and a wait for it to change (the control plane's)."""

    async def wait_for_catalog(self, newer_than: int) -> Catalog:
        """The catalog once its version is past ``newer_than``; the caller bounds the wait."""
        ...


def by_reference(call: GenerateCall, engine: EngineHandle) -> GenerateCall:
    """``call`` with its images as ``engine`` takes them (its discovery says how): as
    references when it processes media itself and takes every image's reference, else as
    tensors, raw 8-bit pixels when it normalises them on device."""
    media = call.media
    assert media is not None
    dialect = engine.transport.dialect
    schemes = dialect.media_ref_schemes(engine.info)
    if schemes is not None and not media.can_reference(schemes):
        schemes = None
    raw = dialect.takes_raw_pixels(engine.info)
    if (schemes, raw) == (media.ref_schemes, media.raw_pixels):
        return call
    return dataclasses.replace(
        call, media=dataclasses.replace(media, ref_schemes=schemes, raw_pixels=raw))


class Dispatcher:
    """Places requests with the fleet policy of their settings; one per daemon.

    It holds no settings of its own: each call gets the policy (or stall
    timeout) of the request's snapshot.
    """

    def __init__(self, fleet: WaitableFleet, disagg: DisaggPlanner | None = None) -> None:
        self.fleet = fleet
        self.disagg = disagg if disagg is not None else DisaggPlanner()

    def choose(
        self,
        policy: Policy,
        input_ids: Sequence[int],
        max_tokens: int,
        exclude: Collection[str] = (),
        routing_key: str | None = None,
        media_keys: tuple[tuple[str, int, int], ...] = (),
    ) -> Placement:
        """Where a request goes: a pair's decode engine when P/D serves, else an aggregated one.

        A pair's placement is its decode engine's; the prefill engine is placed
        when the attempt runs (:meth:`DisaggPlanner.plan`). Engines whose kind
        cannot carry the request are in ``exclude`` (pipeline/capable.py);
        ``routing_key`` is the session's (routing/affinity.py).
        """
        catalog = self.fleet.catalog
        request = RequestView(input_ids, max_tokens, routing_key, media_keys)
        placement = self.disagg.choose_decode(catalog, request, exclude, policy)
        if placement is None:
            placement = policy.choose(catalog, request, exclude)
        if placement is None:
            raise NoEngineAvailable("no engine is serving")
        return placement

    def complete(self, policy: Policy, placement: Placement, prompt: Sequence[int],
                 answer: Sequence[int]) -> None:
        """A request ended well at ``placement``: tell the policy that placed it."""
        if placement.engine.role is EngineRole.DECODE:
            self.disagg.decode_policy.on_complete(placement, prompt, answer)
        else:
            policy.on_complete(placement, prompt, answer)

    def run(
        self,
        placement: Placement,
        call: GenerateCall,
        *,
        exclude: Collection[str] = (),
        stall_timeout_s: float,
    ) -> AbstractAsyncContextManager[EngineCall]:
        """Run ``call`` at ``placement``; leaving early aborts it on the engine.

        On a decode engine this is a disaggregated call: a prefill engine
        (not in ``exclude``) runs the prefill leg, bounded by ``stall_timeout_s``
        when it runs first, and the engine call is the decode leg's. The
        placement's KV blocks count in the engine's load while the call runs,
        and the call runs on the placement's data-parallel rank, if it names one.
        """
        if call.media is not None:
            call = by_reference(call, placement.engine)
        if placement.engine.role is EngineRole.DECODE:
            return run_pair(self.fleet, self.disagg, placement, call, exclude, stall_timeout_s)
        if call.dp_rank != placement.dp_rank:  # each attempt on its own placement's rank
            call = dataclasses.replace(call, dp_rank=placement.dp_rank)
        return run_leg(self.fleet, placement.engine, call, placement.blocks)
