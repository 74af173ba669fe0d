"""``EngineConfig``: a simulated engine's settings, one frozen record passed whole.

The engine, its core and its servicers read every setting from this record,
and the command lines build it once. A setting whose default follows from
others (the KV pool, a disaggregated role's connector, the prefix cache's
size) is a property, so a copy made with :func:`dataclasses.replace` stays
consistent. A record no stock engine of its kind could be is refused when it
is built, with ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from tokenizers import Tokenizer

from direct_frontend.simulator.model import TimingModel
from direct_frontend.simulator.vocab import TextVocab

EngineKind = Literal["sglang", "vllm", "trtllm"]
SimRole = Literal["both", "prefill", "decode"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """What a simulated engine reports about itself, the limits it enforces, how it samples.

    ``dp_size`` N > 1 serves N data-parallel ranks behind the one server; the
    KV sizes (``kv_capacity_blocks``, ``kv_pool_tokens``) and the timing's
    ``max_running`` are then per rank, and rank r publishes KV events on
    ``kv_events_port`` + r (its replay on ``kv_replay_port`` + r).
    """

    kind: EngineKind
    served_model_name: str
    vocab_size: int
    eos_token_id: int
    model_path: str = "sim"
    special_ids: frozenset[int] = frozenset()
    context_length: int = 4096
    role: SimRole = "both"
    timing: TimingModel = dataclasses.field(default_factory=TimingModel)
    seed: int = 0
    eos_probability: float = 0.02
    #: the chance per token of a character split over several tokens (with ``text_vocab``)
    unit_probability: float = 0.05
    #: the ids that decode to clean text, which sampling keeps to (None: every ordinary id)
    text_vocab: TextVocab | None = dataclasses.field(default=None, compare=False)
    #: the KV pool SGLang reports as ``max_context_length`` (None: 8 × the window, not the window)
    kv_pool_tokens: int | None = None
    page_size: int = 1  # SGLang --page-size
    block_size: int = 16  # vLLM cache_config.block_size
    #: vLLM's KV connector (None: NixlConnector for a prefill or decode role, else none)
    kv_connector: str | None = None
    #: the NIXL engine id a vLLM prefill leg hands over ("": each disaggregated engine
    #: gets a fresh uuid when it is built)
    kv_engine_id: str = ""
    bootstrap_port: int = 8998
    trtllm_reported_max_len: int = 1024  # TRT-LLM max_input_len / max_seq_len as reported
    trtllm_empty_finish_reason: bool = False
    tokenizer_path: str = ""
    bos_token_id: int = 0
    pad_token_id: int = 0
    health_timeout: float = 20.0
    #: vLLM: False reports uptime_seconds 0, as the stock servicer 0.14.1 does (its
    #: restarts then show only in its KV events and its connections)
    report_uptime: bool = True
    #: vLLM: False answers GetLoads UNIMPLEMENTED, as a servicer without it would
    serve_get_loads: bool = True
    enable_prefix_cache: bool = True
    #: the prefix cache's size in blocks (None: the KV pool's)
    kv_capacity_blocks: int | None = None
    #: where rank 0 publishes KV events and serves their replay (0 picks a port; None: not)
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    #: above 0 the engine loads LoRA adapters into this many slots (SGLang's contract only)
    max_loras: int = 0
    lora_load_s: float = 0.05
    #: above 0 an embedding model of that many dimensions (vLLM ``--runner pooling``, SGLang
    #: ``--is-embedding``): it answers Embed and refuses Generate; 0 a generation model
    embedding_dim: int = 0
    #: data-parallel ranks behind the one server (vLLM ``--data-parallel-size``, SGLang
    #: ``--dp``), each with its own batch limit and prefix cache
    dp_size: int = 1

    def __post_init__(self) -> None:
        trtllm = self.kind == "trtllm"
        rules = (  # in order: the first broken one is reported
            (self.kind not in get_args(EngineKind), f"unknown engine kind {self.kind!r}"),
            (self.role not in get_args(SimRole), f"unknown role {self.role!r}"),
            (trtllm and self.disaggregated, "the TRT-LLM contract has no disaggregation role"),
            (self.embedding_dim < 0, "embedding_dim must not be negative"),
            (trtllm and bool(self.embedding_dim), "the TRT-LLM contract serves no embeddings"),
            (self.context_length < 2, "context_length must be at least 2"),
            (self.dp_size < 1, "dp_size must be at least 1"),
            (trtllm and self.dp_size != 1,
             "the TRT-LLM contract has no data-parallel rank: dp_size must be 1"),
        )
        for broken, message in rules:
            if broken:
                raise ValueError(message)

    @classmethod
    def from_model_dir(
        cls, kind: EngineKind, model_dir: str | Path, **settings: Any
    ) -> EngineConfig:
        """Settings whose vocabulary, EOS, BOS/PAD and special ids match a HF tokenizer directory.

        Reads ``tokenizer.json`` plus ``generation_config.json`` /
        ``tokenizer_config.json``, so sampled ids decode to real words with the
        frontend's tokenizer. Output is valid text, as a real model's is: only
        ids that decode cleanly, plus whole multi-token characters (pass
        ``text_vocab=None`` to sample every ordinary id). ``settings`` are the
        other fields and win over the directory's, except an empty
        ``served_model_name`` (the directory's name) and a None ``vocab_size`` (the tokenizer's).
        """
        facts = read_tokenizer_dir(model_dir)
        directory = str(Path(model_dir).resolve())
        found: dict[str, Any] = {
            "served_model_name": Path(directory).name, "vocab_size": facts.vocab_size,
            "eos_token_id": facts.eos_token_id, "special_ids": facts.special_ids,
            "model_path": directory, "tokenizer_path": directory,
            "bos_token_id": facts.bos_token_id or 0, "pad_token_id": facts.pad_token_id or 0,
        }
        given = dict(settings)
        if not given.get("served_model_name"):  # None or "": the directory's name
            given.pop("served_model_name", None)
        if given.get("vocab_size") is None:
            given.pop("vocab_size", None)
        if "text_vocab" not in given:
            found["text_vocab"] = TextVocab.from_model_dir(directory, special_ids=facts.special_ids)
        return cls(kind, **{**found, **given})

    @property
    def disaggregated(self) -> bool:
        """Whether the engine is one leg of prefill/decode disaggregation."""
        return self.role != "both"

    @property
    def pool_tokens(self) -> int:
        """The KV pool in tokens (SGLang reports it as ``max_context_length``)."""
        return self.kv_pool_tokens if self.kv_pool_tokens is not None else 8 * self.context_length

    @property
    def connector(self) -> str:
        """The KV connector vLLM reports."""
        if self.kv_connector is not None:
            return self.kv_connector
        return "NixlConnector" if self.disaggregated else ""

    @property
    def cache_block(self) -> int:
        """The prefix cache's block: SGLang's page, vLLM's and TRT-LLM's block."""
        return self.page_size if self.kind == "sglang" else self.block_size

    @property
    def cache_capacity_blocks(self) -> int:
        """One rank's prefix cache in blocks: as set, else the whole KV pool (at least one)."""
        return max(1, self.kv_capacity_blocks or self.pool_tokens // self.cache_block)

    @property
    def kv_capacity_tokens(self) -> int:
        """The prefix cache's size in tokens as set (0: not set, the pool's)."""
        return (self.kv_capacity_blocks or 0) * self.cache_block

    @property
    def is_generation(self) -> bool:
        """What GetModelInfo reports: False for an embedding model."""
        return self.embedding_dim == 0

    @property
    def kv_reported_capacity(self) -> int:
        """What ``max_total_num_tokens`` reports: the KV pool, which is the prefix cache."""
        return self.kv_capacity_tokens or self.pool_tokens

    @property
    def sglang_max_req_len(self) -> int:
        """SGLang's cap on prompt plus output (one below the window and the pool)."""
        return min(self.context_length - 1, self.pool_tokens - 1)

    @property
    def sglang_max_req_input_len(self) -> int:
        """SGLang's prompt limit: ``max_req_len - 5``."""
        return self.sglang_max_req_len - 5


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerFacts:
    """What a simulated engine needs to know about a real tokenizer."""

    vocab_size: int
    eos_token_id: int
    special_ids: frozenset[int]
    bos_token_id: int | None = None
    pad_token_id: int | None = None


def read_tokenizer_dir(model_dir: str | Path) -> TokenizerFacts:
    """Vocabulary size, EOS, BOS/PAD and special ids of a HF tokenizer directory.

    EOS comes from ``generation_config.json`` (the first id when it is a
    list), else from ``tokenizer_config.json``'s ``eos_token``.
    """
    root = Path(model_dir)
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    special_ids = {
        token_id
        for token_id, added in tokenizer.get_added_tokens_decoder().items()
        if added.special
    }
    generation = _read_json(root / "generation_config.json")
    tokenizer_config = _read_json(root / "tokenizer_config.json")

    def token_id(key: str) -> int | None:
        value = generation.get(f"{key}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
        token = tokenizer_config.get(f"{key}_token")
        if isinstance(token, Mapping):
            token = token.get("content")
        if isinstance(token, str):
            return tokenizer.token_to_id(token)
        return None

    eos = token_id("eos")
    if eos is None:
        raise ValueError(f"no EOS token id found in {root}")
    return TokenizerFacts(
        vocab_size=vocab_size,
        eos_token_id=eos,
        special_ids=frozenset(special_ids),
        bos_token_id=token_id("bos"),
        pad_token_id=token_id("pad"),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}
