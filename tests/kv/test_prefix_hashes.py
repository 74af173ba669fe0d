"""A request's prefix hashes equal the chain docs/kv-events.md defines, however computed (sans-IO).

The reference below hashes block by block, as the definition reads; the
module cuts and chains the blocks in bulk and reuses a known prefix's chain.
"""

from __future__ import annotations

import array
import random

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv.prefix import (
    extend_hashes,
    namespace_seed,
    prefix_hashes,
    prompt_hashes,
)
from direct_frontend.text.prompt_ids import PromptIds

BS = 4
U32 = st.integers(0, 2**32 - 1)


def reference(tokens: list[int], block_size: int, lora: str | None = None,
              salt: str | None = None) -> list[int]:
    """``h_i = XXH3_64(block_i as LE u32 [+ the salt, block 0 only], seed=h_{i-1})``."""
    h = 1337 if lora is None else (1337 + xxhash.xxh3_64_intdigest(lora.encode())) % 2**64
    out = []
    for i in range(len(tokens) // block_size):
        data = array.array("I", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        if i == 0 and salt:
            data += msgspec.msgpack.encode([salt])
        h = xxhash.xxh3_64_intdigest(data, h)
        out.append(h)
    return out


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(U32, max_size=14 * BS), salt=st.sampled_from([None, "s1"]),
       lora=st.sampled_from([None, "ad"]), block_size=st.sampled_from([1, BS, 16]))
def test_the_chain_is_the_definitions(tokens: list[int], salt: str | None, lora: str | None,
                                      block_size: int) -> None:
    """A list, a tuple and an array of ids, salted or not, under an adapter or not, any size
    of block, a partial tail or none: the reference's hashes."""
    expected = reference(tokens, block_size, lora, salt)
    for ids in (tokens, tuple(tokens), array.array("I", tokens)):
        assert prefix_hashes(ids, block_size, lora_name=lora, cache_salt=salt) == expected
    assert namespace_seed(lora) == (1337 if lora is None else
                                    (1337 + xxhash.xxh3_64_intdigest(b"ad")) % 2**64)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(U32, max_size=12 * BS), more=st.lists(U32, max_size=6 * BS),
       known=st.integers(0, 14 * BS), salt=st.sampled_from([None, "s1"]))
def test_ids_that_know_their_prefix_chain_on_from_it(
        tokens: list[int], more: list[int], known: int, salt: str | None) -> None:
    """Ids built from an earlier prompt (:class:`PromptIds`) take its chain for the blocks they
    share and hash the rest: the reference's hashes of the whole, and asked twice, the same."""
    earlier = PromptIds(tokens)
    assert prefix_hashes(earlier, BS, cache_salt=salt) == reference(tokens, BS, salt=salt)
    shared = min(known, len(tokens))
    later = PromptIds([*tokens[:shared], *more], earlier.chains, shared)
    expected = reference([*tokens[:shared], *more], BS, salt=salt)
    assert prefix_hashes(later, BS, cache_salt=salt) == expected
    assert prefix_hashes(later, BS, cache_salt=salt) == expected


@settings(max_examples=200, deadline=None)
@given(turns=st.lists(st.tuples(st.integers(0, 12 * BS), st.lists(U32, max_size=6 * BS)),
                      min_size=1, max_size=6),
       first=st.lists(U32, max_size=10 * BS))
def test_a_conversations_turns_hash_only_their_new_blocks_and_equal_the_definition(
        turns: list[tuple[int, list[int]]], first: list[int]) -> None:
    """Turn after turn, each built from the last (its first ``keep`` ids known, a whole
    block or not, then new ids), as the prompt cache builds them: each turn's tuple equals
    the reference's hashes of its ids, is the one tuple it keeps (asked again, the same
    object), and begins with the very hashes of the blocks it shares with the last."""
    ids = PromptIds(first)
    hashes = prompt_hashes(ids, BS)
    assert hashes == tuple(reference(first, BS))
    for keep, new in turns:
        known = min(keep, len(ids))
        later = PromptIds([*ids[:known], *new], ids.chains, known)
        got = prompt_hashes(later, BS)
        assert got == tuple(reference(list(later), BS))
        assert prompt_hashes(later, BS) is got
        shared = min(known // BS, len(hashes))
        assert all(a is b for a, b in zip(got[:shared], hashes, strict=False))
        ids, hashes = later, got


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(U32, max_size=10 * BS), answer=st.lists(U32, max_size=4 * BS))
def test_extending_a_prompts_hashes_by_its_answer_hashes_the_whole(
        prompt: list[int], answer: list[int]) -> None:
    """The prompt's full blocks' hashes, then the ids after them: the whole's hashes."""
    known = prefix_hashes(prompt, BS)
    rest = [*prompt[len(known) * BS:], *answer]
    assert extend_hashes(tuple(known), rest, BS) == tuple(reference([*prompt, *answer], BS))


def test_ids_after_the_last_full_block_are_not_hashed() -> None:
    """An id no u32 holds in the partial tail is not hashed, so it is no error; within the
    blocks it is (the KV index then asks nothing)."""
    assert prefix_hashes([1, 2, 3, 4, 2**40], BS) == reference([1, 2, 3, 4], BS)
    assert extend_hashes((), [1, 2, 3, 4, -1], BS) == tuple(reference([1, 2, 3, 4], BS))
    with pytest.raises(OverflowError):
        prefix_hashes([1, 2, 2**40, 4, 5], BS)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(-50, 50),
       st.integers(-50, 50), st.sampled_from([None, 1, 2, -1]))
def test_prompt_ids_read_as_the_tuple_of_their_ids(tokens: list[int], start: int, stop: int,
                                                   step: int | None) -> None:
    """Held as u32 bytes, read as a tuple: length, items, slices, iteration, equality,
    adding, and the hash of an equal tuple."""
    ids, same = PromptIds(tokens), tuple(tokens)
    assert len(ids) == len(same) and list(ids) == tokens and ids.ints() == same
    assert ids[start:stop:step] == same[start:stop:step]
    for at in (start, stop):
        if -len(same) <= at < len(same):
            assert ids[at] == same[at]
        else:
            with pytest.raises(IndexError):
                ids[at]
    assert ids == same and ids == PromptIds(ids.raw) and ids != list(same)
    assert hash(ids) == hash(same)
    assert ids + (1,) == (*same, 1) and (1,) + ids == (1, *same)  # noqa: RUF005
    assert PromptIds(array.array("I", tokens).tobytes()) == ids


def test_prompt_ids_from_bytes_are_whole_u32s() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        PromptIds(b"\x01\x00\x00")


def test_a_later_prompt_hashes_on_from_what_only_it_holds() -> None:
    """Once the earlier prompt is gone, its chains live on through the later one's source."""
    tokens = [7 + i % 1000 for i in range(512 + 3 * BS)]
    earlier = PromptIds(tokens)
    hashes = prefix_hashes(earlier, BS)
    later = PromptIds([*tokens, 1, 2, 3, 4], earlier.chains, len(tokens))
    del earlier
    assert prefix_hashes(later, BS) == [*hashes, *reference([*tokens, 1, 2, 3, 4], BS)[-1:]]


@pytest.mark.parametrize("block_size", [1, BS, 16])
def test_long_ids_cut_in_runs_of_blocks_chain_as_the_definition(block_size: int) -> None:
    """Ids of hundreds of blocks (cut many blocks at a time, then the rest one by one), with
    a partial tail or none, whole and on from a known prefix: the reference's hashes."""
    rng = random.Random(block_size)
    for blocks in (63, 64, 65, 128, 200, 331):
        tokens = [rng.randrange(2**32) for _ in range(blocks * block_size + blocks % 3)]
        expected = reference(tokens, block_size)
        assert prefix_hashes(tokens, block_size) == expected
        earlier = PromptIds(tokens[: len(tokens) // 2])
        prompt_hashes(earlier, block_size)
        later = PromptIds(tokens, earlier.chains, len(earlier))
        assert prompt_hashes(later, block_size) == tuple(expected)
