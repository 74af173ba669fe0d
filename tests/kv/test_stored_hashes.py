"""A store's hashes chain like the request's own, however its extra keys say nothing (sans-IO)."""

from __future__ import annotations

import array

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv.events import BlockStored
from direct_frontend.kv.prefix import namespace_seed, prefix_hashes, stored_hashes

BS = 4


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=BS, max_size=12 * BS),
       extras=st.sampled_from(["absent", "all None", "fewer None"]),
       salt=st.sampled_from([None, "s1"]), lora=st.sampled_from([None, "ad"]),
       spare=st.integers(0, BS - 1))
def test_a_store_of_a_prompt_hashes_as_the_prompt(
        tokens: list[int], extras: str, salt: str | None, lora: str | None, spare: int) -> None:
    """No extra keys, extra keys all None (vLLM's usual), fewer of them than blocks, with
    a salt on the event and an adapter: the request's hashes (salted where the event's
    salt counts: without extra keys), also when the event carries a partial tail."""
    blocks = len(tokens) // BS
    keys = {"absent": None, "all None": (None,) * blocks, "fewer None": (None,)}[extras]
    event = BlockStored(tuple(range(1, blocks + 1)), None,
                        array.array("I", tokens[: blocks * BS + spare]), BS,
                        lora_name=lora, extra_keys=keys, cache_salt=salt)
    expected = prefix_hashes(tokens, BS, lora_name=lora,
                             cache_salt=salt if keys is None else None)
    assert stored_hashes(event, BS, namespace_seed(lora)) == expected
