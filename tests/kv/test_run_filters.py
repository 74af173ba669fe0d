"""A chain of stores is merged only where every store passes the filters one by one would."""

from __future__ import annotations

import array

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv.events import BlockStored
from direct_frontend.kv.filters import DEVICE_TIERS, store_rejection
from direct_frontend.kv.runs import merged

BS = 2

page = st.fixed_dictionaries({
    "blocks": st.sampled_from([1, 1, 1, 2, 0]),
    "tokens": st.sampled_from([0, 0, 0, 0, 1, -1]),  # tokens more or fewer than the blocks'
    "block_size": st.sampled_from([BS] * 6 + [1, 0]),
    "medium": st.sampled_from([None] * 4 + ["GPU", "CPU"]),
    "group_idx": st.sampled_from([None] * 6 + [0, 1]),
    "kind": st.sampled_from([None] * 6 + ["full_attention", "sliding_window"]),
    "locality": st.sampled_from([None] * 6 + ["LOCAL", "remote"]),
    "lora_name": st.sampled_from([None] * 6 + ["a"]),
    "extra": st.sampled_from([None] * 6 + [(None,), ()]),
    "bigram": st.sampled_from([False] * 6 + [True]),
})

GOOD = {"blocks": 1, "tokens": 0, "block_size": BS, "medium": None, "group_idx": None,
        "kind": None, "locality": None, "lora_name": None, "extra": None, "bigram": False}


def chain(pages: list[dict[str, object]]) -> list[BlockStored]:
    out = []
    parent = None
    next_hash = 1
    for p in pages:
        n = int(p["blocks"])  # type: ignore[call-overload]
        hashes = tuple(range(next_hash, next_hash + n))
        next_hash += n
        size = int(p["block_size"])  # type: ignore[call-overload]
        length = max(0, n * size + int(p["tokens"]))  # type: ignore[call-overload]
        out.append(BlockStored(
            hashes, parent, array.array("I", [7] * length), size, medium=p["medium"],  # type: ignore[arg-type]
            group_idx=p["group_idx"], kv_cache_spec_kind=p["kind"],  # type: ignore[arg-type]
            locality=p["locality"], lora_name=p["lora_name"],  # type: ignore[arg-type]
            extra_keys=p["extra"], bigram=bool(p["bigram"])))  # type: ignore[arg-type]
        parent = hashes[-1] if hashes else parent
    return out


@settings(max_examples=500, deadline=None)
@given(pages=st.lists(page, min_size=2, max_size=6), alike=st.booleans(),
       odd=st.sampled_from(sorted(page.wrapped_strategy.mapping)))  # type: ignore[attr-defined]
def test_a_run_merges_exactly_when_each_store_passes_the_filters(
        pages: list[dict[str, object]], alike: bool, odd: str) -> None:
    """Pages alike (and fit) but the last one's ``odd`` field, or each drawn on its own: merged
    when (and only when) each has no extra keys, the first's adapter and no filter
    against it."""
    if alike:
        pages = [GOOD] * (len(pages) - 1) + [GOOD | {odd: pages[-1][odd]}]
    run = chain(pages)
    if not all(event.block_hashes for event in run[:-1]):
        return  # a store of no blocks ends a run before merging is asked
    expected = all(event.extra_keys is None and event.lora_name == run[0].lora_name
                   and store_rejection(event, BS, DEVICE_TIERS) is None for event in run)
    assert (merged(run, {}, 1000, BS, DEVICE_TIERS) is not None) == expected
