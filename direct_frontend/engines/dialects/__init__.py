"""One module per engine kind: neutral request ↔ that engine's proto, status → error kind, P/D legs.

Nothing outside this package imports a proto module for the data path.
"""

from __future__ import annotations

from direct_frontend.engines.dialects.base import Dialect


def dialect_for(kind: str) -> Dialect:
    """Return the dialect for an engine kind named in the fleet file."""
    if kind == "sglang":
        from direct_frontend.engines.dialects.sglang import SglangDialect

        return SglangDialect()
    if kind == "vllm":
        from direct_frontend.engines.dialects.vllm import VllmDialect

        return VllmDialect()
    if kind == "trtllm":
        from direct_frontend.engines.dialects.trtllm import TrtllmDialect

        return TrtllmDialect()
    raise ValueError(f"no dialect for engine kind {kind!r}")


__all__ = ["Dialect", "dialect_for"]
