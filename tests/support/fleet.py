"""A fixed catalog in place of the control plane, for the pipeline's data-only tests."""

from __future__ import annotations

import dataclasses

import trio

from direct_frontend.engines.neutral import EngineInfo, EngineRole
from direct_frontend.errors import EngineError
from direct_frontend.routing.catalog import Catalog, EngineHandle


def engine(
    name: str,
    role: EngineRole = EngineRole.BOTH,
    incarnation: int = 1,
    *,
    context_length: int | None = 4096,
    eos_token_ids: tuple[int, ...] = (),
) -> EngineHandle:
    """An engine handle with no transport: for decisions, never for calls."""
    info = EngineInfo("demo", role=role, eos_token_ids=eos_token_ids)
    return EngineHandle(name, "sglang", f"grpc://{name}:1", incarnation, role, info,
                        context_length, None)


@dataclasses.dataclass
class StaticFleet:
    """The catalog never changes; faults are only noted."""

    catalog: Catalog
    faults: list[str] = dataclasses.field(default_factory=list)

    def report_fault(self, engine: EngineHandle, error: EngineError) -> None:
        self.faults.append(engine.name)

    async def wait_for_catalog(self, newer_than: int) -> Catalog:
        await trio.sleep_forever()  # it never changes
        raise AssertionError("unreachable")
