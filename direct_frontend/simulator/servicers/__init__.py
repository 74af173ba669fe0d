"""grpclib servicers that speak each stock engine's SMG contract, quirks included.

One module per engine kind, as ``engines/dialects/`` has one per kind on the
router's side; ``common`` holds what the contracts share. Each servicer
reproduces what the stock servicer puts on the wire (docs/engine-contracts.md
§4–§6), because the point of the simulator is to catch a router that decodes
one engine's stream with another's rules:

- SGLang: ``request_id`` on every message; chunk counts cumulative; the last
  delta is sent as a chunk *and again* as the streaming ``complete``.
- vLLM: chunk/complete are oneof numbers 1/2 with no ``request_id``; chunk
  ``completion_tokens`` is the delta count; the streaming ``complete`` repeats
  the last delta with ``completion_tokens`` = its length.
- TRT-LLM: chunk counts cumulative; the ``complete`` carries the whole output
  (cumulative), after the final delta chunk.

Stop strings are accepted and ignored (the frontend applies them), as are
temperature and the other sampling knobs: the model is deterministic, but a
sampling request's seed (vLLM, TRT-LLM) picks its own deterministic stream.
"""

from __future__ import annotations

from direct_frontend.simulator.core import SimCore
from direct_frontend.simulator.servicers.common import SimServicer
from direct_frontend.simulator.servicers.sglang import SglangServicer
from direct_frontend.simulator.servicers.trtllm import TrtllmServicer
from direct_frontend.simulator.servicers.vllm import VllmServicer


def servicer_for(core: SimCore) -> SimServicer:
    """The servicer for the engine kind ``core`` simulates."""
    kind = core.config.kind
    if kind == "sglang":
        return SglangServicer(core)
    if kind == "vllm":
        return VllmServicer(core)
    return TrtllmServicer(core)


__all__ = [
    "SglangServicer",
    "SimServicer",
    "TrtllmServicer",
    "VllmServicer",
    "servicer_for",
]
