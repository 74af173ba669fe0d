"""The block tally's bulk steps against a Counter (sans-IO)."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.routing.tally import add_all, remove_all

holds = st.lists(st.lists(st.integers(0, 20), max_size=10), max_size=12)


@settings(max_examples=200, deadline=None)
@given(holds=holds, release=st.lists(st.booleans(), min_size=12, max_size=12))
def test_add_and_remove_equal_a_counter(holds: list[list[int]], release: list[bool]) -> None:
    """Distinct and repeated hashes, shared between holds: the same counts, zeros gone."""
    counts: dict[int, int] = {}
    reference: collections.Counter[int] = collections.Counter()
    for hashes in holds:
        add_all(counts, hashes)
        reference.update(hashes)
        assert counts == dict(reference)
    for hashes, gone in zip(holds, release, strict=False):
        if gone:
            remove_all(counts, hashes)
            reference.subtract(hashes)
            assert counts == {h: n for h, n in reference.items() if n}
