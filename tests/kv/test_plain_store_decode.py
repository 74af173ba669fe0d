"""A store that sets only SGLang's usual page fields decodes as the general path decodes it."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv.events import BlockStored, decode_payload


@settings(max_examples=100, deadline=None)
@given(parent=st.one_of(st.none(), st.integers(0, 2**64 - 1), st.binary(min_size=32,
                                                                         max_size=32)),
       tokens=st.lists(st.integers(0, 2**32 - 1), max_size=8), lora=st.one_of(st.none(),
                                                                              st.integers(0, 9)),
       medium=st.sampled_from([None, "GPU", "CPU"]), bigram=st.booleans())
def test_a_plain_page_decodes_as_one_with_every_field(
        parent: int | bytes | None, tokens: list[int], lora: int | None, medium: str | None,
        bigram: bool) -> None:
    """The same page with a field more (nil, so it means nothing) takes the general path:
    the same event comes out."""
    page = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": parent,
            "token_ids": [[t, t] for t in tokens] if bigram else tokens, "block_size": 4,
            "lora_id": lora, "medium": medium}
    plain, full = (decode_payload(msgspec.msgpack.encode([1.0, [event], None])).events
                   for event in (page, {**page, "session_id": None}))
    assert len(plain) == 1 and isinstance(plain[0], BlockStored)
    assert plain == full
