"""A GPU-free stand-in for stock SGLang, vLLM and TensorRT-LLM engines.

Serves the real SMG gRPC contracts with each engine's stream quirks, a
deterministic token model and a simple timing model, so the router can be
tested end to end without GPUs.
"""

from direct_frontend.simulator.core import EngineStats
from direct_frontend.simulator.engine import SimEngine
from direct_frontend.simulator.faults import FaultPlan, FaultStats
from direct_frontend.simulator.model import (
    Finish,
    Generation,
    SimModel,
    SimSequence,
    StopCriteria,
    TimingModel,
)
from direct_frontend.simulator.settings import (
    EngineConfig,
    EngineKind,
    SimRole,
    TokenizerFacts,
    read_tokenizer_dir,
)
from direct_frontend.simulator.vocab import TextVocab

__all__ = [
    "EngineConfig",
    "EngineKind",
    "EngineStats",
    "FaultPlan",
    "FaultStats",
    "Finish",
    "Generation",
    "SimEngine",
    "SimModel",
    "SimRole",
    "SimSequence",
    "StopCriteria",
    "TextVocab",
    "TimingModel",
    "TokenizerFacts",
    "read_tokenizer_dir",
]
