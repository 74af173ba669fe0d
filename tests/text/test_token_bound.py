"""The byte-level bound: never above the real count, and far above the uniform one on prose."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.text.demo_model import corpus
from direct_frontend.text.model_dir import TextModel
from direct_frontend.text.token_bound import ByteLevelBound

PIECES = st.sampled_from([
    *"ab c\n\t.-'7é中😀 ", " the", "  ", "\n\n", "interactions", "1234", "<|im_start|>",
    "telescopes", "====", "    ", "\r\n",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=60).map("".join))
def test_the_bound_never_exceeds_the_real_count(text_model: TextModel, text: str) -> None:
    assert text_model.byte_bound is not None
    assert text_model.byte_bound.fewest(text.encode()) <= len(text_model.encode(text))
    assert text_model.fewest_tokens(text) <= len(text_model.encode(text))


def test_prose_of_a_megabyte_and_a_half_is_proven_beyond_a_131072_token_context(
    text_model: TextModel,
) -> None:
    words = " ".join(corpus()).split()
    text = " ".join(words[i % len(words)] for i in range(300_000))[:1_600_000]
    uniform = -(-len(text.encode()) // (text_model.max_bytes_per_token or 1))
    fewest = text_model.fewest_tokens(text)
    assert uniform < 131_072 <= fewest <= len(text_model.encode(text))


def test_pairs_no_entry_holds_are_boundaries() -> None:
    bound = ByteLevelBound.of([b"a", b"b", b" ", b"ab", b" ab", b"abababab"])
    assert bound is not None
    # weights prove 1 token (3/8 + 3/8 + 2/3); (b, space) is in no entry, twice: 3 tokens,
    # as many as there are ("ab", " ab", " ab")
    assert bound.fewest(b"ab ab ab") == 3
    assert bound.fewest(b"") == 0


def test_weights_count_each_byte_at_its_longest_entry() -> None:
    bound = ByteLevelBound.of([b"a", b"b", b"ab", b"bbbb"])
    assert bound is not None
    # "a" is in entries of 2 bytes at most (weight 1/2), "b" of 4 (1/4): exact sums
    assert (bound.fewest(b"aaaaaa"), bound.fewest(b"bbbbbbbb"), bound.fewest(b"aabbbb")) == (
        3, 2, 2)


@settings(max_examples=100, deadline=None)
@given(st.lists(PIECES, max_size=60).map("".join))
def test_counting_in_chunks_stays_a_lower_bound(text_model: TextModel, text: str) -> None:
    """Pairs split between two chunks go uncounted: fewer, never more."""
    import direct_frontend.text.token_bound as token_bound

    assert text_model.byte_bound is not None
    whole = text_model.byte_bound.fewest(text.encode())
    saved = token_bound.CHUNK
    token_bound.CHUNK = 7
    try:
        chunked = text_model.byte_bound.fewest(text.encode())
    finally:
        token_bound.CHUNK = saved
    assert chunked <= len(text_model.encode(text))
    assert whole - len(text.encode()) // 7 <= chunked <= whole


@settings(max_examples=100, deadline=None)
@given(text=st.lists(PIECES, max_size=60).map("".join), enough=st.integers(1, 80),
       chunk=st.sampled_from([3, 7, 1 << 18]))
def test_counting_stops_at_enough_and_says_so(text_model: TextModel, text: str, enough: int,
                                              chunk: int) -> None:
    """Below ``enough`` the bound is the whole count's; at or past it, at least ``enough``."""
    import direct_frontend.text.token_bound as token_bound

    assert text_model.byte_bound is not None
    saved = token_bound.CHUNK
    token_bound.CHUNK = chunk
    try:
        whole = text_model.byte_bound.fewest(text.encode())
        early = text_model.byte_bound.fewest(text.encode(), enough)
    finally:
        token_bound.CHUNK = saved
    if whole < enough:
        assert early == whole
    else:
        assert enough <= early <= whole


def test_counting_stops_at_the_chunk_that_reaches_enough() -> None:
    import direct_frontend.text.token_bound as token_bound

    bound = ByteLevelBound.of([b"a", b"b", b" ", b"ab", b" ab", b"abababab"])
    assert bound is not None
    saved = token_bound.CHUNK
    token_bound.CHUNK = 6  # "ab ab " per chunk: two pairs each
    try:
        assert bound.fewest(b"ab " * 100) == 101  # "ab", 99 " ab", " "
        assert bound.fewest(b"ab " * 100, 5) == 5  # two chunks, not fifty
    finally:
        token_bound.CHUNK = saved
