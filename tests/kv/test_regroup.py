"""Engines whose KV page size is not ours: their pages re-cut into our blocks."""

from __future__ import annotations

import array

import pytest

from direct_frontend.kv.events import BlockRemoved, BlockStored
from direct_frontend.kv.index import KvIndex
from direct_frontend.kv.regroup import Regrouper, compatible

BS = 4


def pages(tokens: list[int], page: int, first_hash: int, parent: int | None) -> BlockStored:
    n = len(tokens) // page
    return BlockStored(
        block_hashes=tuple(first_hash + i for i in range(n)), parent_block_hash=parent,
        token_ids=array.array("I", tokens[: n * page]), block_size=page, medium="GPU",
    )


def test_compatible_page_sizes() -> None:
    assert compatible(1, 16) and compatible(8, 16) and compatible(16, 16) and compatible(64, 16)
    assert not compatible(12, 16) and not compatible(24, 16) and not compatible(0, 16)
    with pytest.raises(ValueError):
        Regrouper(12, 16)


@pytest.mark.parametrize("page", [1, 2, 8])
def test_a_page_sized_engine_matches_like_a_block_sized_one(page: int) -> None:
    """A conversation's prompts (a trunk and two branches, one inside a block) stored as pages."""
    trunk = list(range(100, 110))  # 10 tokens: 2 full blocks and half of one
    left = trunk + list(range(200, 210))
    right = trunk[:9] + list(range(300, 311))  # branches inside the trunk's third block
    index = KvIndex(BS)
    ids = iter(range(1, 10_000, 100))
    step = max(page, 1)
    # the engine stores its radix tree as pages; a branch's parent is the last shared page
    if page <= BS:
        t_first = next(ids)
        index.store("a", pages(trunk, page, t_first, None))
        t_pages = len(trunk) // step
        index.store("a", pages(left[t_pages * step:], page, next(ids), t_first + t_pages - 1))
        shared = len(right[:9]) // step
        index.store("a", pages(right[shared * step:], page, next(ids), t_first + shared - 1))
    else:  # coarser pages: one page of 8 = two of our blocks (padded to whole pages)
        index.store("a", pages(left + [0] * 4, page, next(ids), None))
        index.store("a", pages(right + [0] * 4, page, next(ids), None))
    native = KvIndex(BS)
    native.store("a", pages(left, BS, 5000, None))
    shared_blocks = 2
    native.store("a", pages(right[shared_blocks * BS:], BS, 6000, 5000 + shared_blocks - 1))
    for prompt in (left, right, trunk + [999] * 8, [*right[:13], 7, 7, 7]):
        # (coarser pages: the index still matches in our blocks, inside a page too)
        assert index.lookup(prompt) == native.lookup(prompt), prompt


def test_removing_a_blocks_last_page_removes_the_block() -> None:
    index = KvIndex(BS)
    tokens = list(range(100, 112))  # three blocks of 4, as 12 one-token pages 1..12
    index.store("a", pages(tokens, 1, 1, None))
    assert index.lookup(tokens) == {"a": 3} and len(index) == 3
    index.remove("a", BlockRemoved((12, 11), medium="GPU"))  # leaves first, as a radix cache
    assert index.lookup(tokens) == {"a": 2}
    index.remove("a", BlockRemoved((10, 9), medium="GPU"))  # inside block 3 … and its first
    assert index.lookup(tokens) == {"a": 2} and len(index) == 2
    index.remove("a", BlockRemoved((8,), medium="GPU"))
    assert index.lookup(tokens) == {"a": 1} and len(index) == 1


def test_coarse_page_removal_removes_all_its_blocks() -> None:
    index = KvIndex(BS)
    tokens = list(range(100, 116))
    index.store("a", pages(tokens, 8, 1, None))  # pages 1, 2 = blocks 1-2, 3-4
    assert index.lookup(tokens) == {"a": 4}
    index.remove("a", BlockRemoved((2,), medium="GPU"))
    assert index.lookup(tokens) == {"a": 2} and len(index) == 2


def test_clearing_forgets_the_pages_too() -> None:
    index = KvIndex(BS)
    index.store("a", pages(list(range(100, 106)), 1, 1, None))  # a block and 2 pages
    index.clear_engine("a")
    # the continuation's parent page was forgotten: it cannot be placed
    assert index.store("a", pages(list(range(106, 110)), 1, 7, 6)) == 0
    assert index.lookup(list(range(100, 110))) == {}


def test_a_partial_page_is_skipped_not_a_reason_to_start_over() -> None:
    index = KvIndex(BS)
    index.store("a", pages(list(range(100, 106)), 2, 1, None))  # pages 1-3: a block and a page
    partial = BlockStored(block_hashes=(9,), parent_block_hash=3,
                          token_ids=array.array("I", [106]), block_size=1, medium="GPU")
    index.store("a", partial)  # a radix node's last, partial page
    index.store("a", pages(list(range(106, 108)), 2, 4, 3))  # page 4 completes block 2
    assert index.lookup(list(range(100, 108))) == {"a": 2}
