"""An admission slot's ``async with`` block (pipeline/admission.py ``Admission.slot``), and
what the admission hears and tells about its refusals.

A class rather than an ``asynccontextmanager``: every request enters one, and
an async generator's block costs about 1 µs more (the generator, its
finalizer hooks, the wrapper's frames).
"""

from __future__ import annotations

from typing import Literal, Protocol

from direct_frontend.openai.types import Tier
from direct_frontend.pipeline.preempt import Hold

#: why a request was not admitted (the ``reason`` label of the refusals counted)
Reason = Literal["queue_full", "tenant_queue_full", "pushed_out", "timeout"]


class AdmissionObserver(Protocol):
    """Hears each admission and refusal, by the tenant's label (never a key) and tier."""

    def admitted(self, tenant: str, tier: Tier, waited: float) -> None: ...

    def refused(self, tenant: str, tier: Tier, reason: Reason) -> None: ...


class Admits(Protocol):
    """What grants the slots (pipeline/admission.py ``Admission``)."""

    async def admit(self, count: int, flow: str, tier: Tier) -> Hold: ...

    def vacate(self, hold: Hold, granted: float) -> None: ...


class Slot:
    """``count`` slots for ``flow`` at ``tier``: taken on the way in (the :class:`Hold`
    the block gets), given back on the way out, whatever ended the block."""

    __slots__ = ("_admits", "_count", "_flow", "_granted", "_hold", "_tier")

    def __init__(self, admits: Admits, count: int, flow: str, tier: Tier) -> None:
        self._admits = admits
        self._count = count
        self._flow = flow
        self._tier: Tier = tier

    async def __aenter__(self) -> Hold:
        self._hold = hold = await self._admits.admit(self._count, self._flow, self._tier)
        self._granted = hold.granted  # its first admission (a requeue moves the hold's)
        return hold

    async def __aexit__(self, *exc_info: object) -> None:
        self._admits.vacate(self._hold, self._granted)
