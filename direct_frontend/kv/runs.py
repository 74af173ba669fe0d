"""Chained stores taken as one: SGLang's one ``BlockStored`` per page, indexed in bulk (sans-IO).

SGLang publishes a prompt's pages one event each (docs/kv-events.md), each the
previous one's child, so an 18k-token prompt is a thousand stores of one block.
Indexed one by one, each pays its own filters, parent lookup, hashing call and
placing; :func:`merged` makes such a run one store of all its blocks, where
that is certain to leave the index exactly as the stores one by one would.
"""

from __future__ import annotations

import array
import operator
from collections.abc import Mapping, Sequence, Set

import msgspec

from direct_frontend.kv.events import BlockStored
from direct_frontend.kv.filters import store_rejection

__all__ = ["continues", "merged"]


def continues(previous: BlockStored, event: BlockStored) -> bool:
    """Whether ``event`` stores the child of ``previous``'s last block (a store of no
    blocks, such as an offload placeholder, has none to continue)."""
    return bool(previous.block_hashes) and event.parent_block_hash == previous.block_hashes[-1]


def merged(run: Sequence[BlockStored], blocks: Mapping[int, int], room: int, block_size: int,
           tiers: Set[str]) -> BlockStored | None:
    """``run`` (each a :func:`continues` of the one before) as one store, or None where the
    stores one by one could end otherwise.

    One by one, each store's parent is looked up among the engine's blocks
    (``blocks``: engine hash → our prefix hash) and must chain on what the
    store before placed: so every store must pass the filters, carry nothing
    mixed into its hashes (no extra keys, one adapter), the first one's parent
    must be known (or none), none of the run's blocks may be known already or
    repeat (a known one keeps its old prefix, which the next would chain on),
    and the run must fit in ``room`` (no eviction between two of its stores).
    """
    first = run[0]
    hashes = [h for event in run for h in event.block_hashes]
    if (len(hashes) > room or len(set(hashes)) != len(hashes)
            or first.parent_block_hash in hashes
            or (first.parent_block_hash is not None and first.parent_block_hash not in blocks)
            or list(map(blocks.get, hashes)).count(None) != len(hashes)):
        return None
    if not _each_fits(run, block_size, tiers):
        return None
    tokens = array.array(first.token_ids.typecode)
    for event in run:
        tokens.extend(event.token_ids)
    return msgspec.structs.replace(first, block_hashes=tuple(hashes), token_ids=tokens)


#: the fields the filters and the hashing read that a run's stores must share
_SHARED = operator.attrgetter("bigram", "group_idx", "kv_cache_spec_kind", "locality", "medium",
                              "block_size", "lora_name")
_EXTRA = operator.attrgetter("extra_keys")
_HASHES = operator.attrgetter("block_hashes")
_TOKENS = operator.attrgetter("token_ids")


def _each_fits(run: Sequence[BlockStored], block_size: int, tiers: Set[str]) -> bool:
    """Whether every store passes the filters, with no extra keys and the first's adapter.

    The usual run (pages alike in all but their blocks) is checked in C: the
    first store through the filters, then that the others share its fields and
    each has tokens for its blocks (a parent inside its own blocks or a block
    twice is ruled out by :func:`merged`'s checks of the whole run). Any other
    run is checked store by store.
    """
    first = run[0]
    if list(map(_EXTRA, run)).count(None) != len(run):
        return False
    if len(set(map(_SHARED, run))) == 1:
        sizes = list(map(len, map(_HASHES, run)))
        return (store_rejection(first, block_size, tiers) is None and 0 not in sizes
                and list(map(len, map(_TOKENS, run))) == [n * block_size for n in sizes])
    return all(event.lora_name == first.lora_name
               and store_rejection(event, block_size, tiers) is None for event in run)
