"""The simulated embedding model: one stable unit vector per token-id sequence."""

from __future__ import annotations

import math

import pytest

from direct_frontend.simulator.embedding import embedding_of


def test_the_vector_has_the_asked_length_and_norm_one() -> None:
    for dim in (1, 2, 7, 384, 4096):
        vector = embedding_of((1, 2, 3), dim)
        assert len(vector) == dim
        assert math.fsum(x * x for x in vector) == pytest.approx(1.0, abs=1e-12)


def test_the_same_ids_give_the_same_vector_and_other_ids_another() -> None:
    base = embedding_of((10, 20, 30), 32)
    assert embedding_of([10, 20, 30], 32) == base  # any sequence type: only the ids count
    others = [(10, 20, 31), (10, 20), (10, 20, 30, 0), (30, 20, 10), (0,), (2**31,)]
    vectors = [embedding_of(ids, 32) for ids in others]
    assert all(vector != base for vector in vectors)
    assert len({tuple(vector) for vector in vectors}) == len(others)
    # not merely different: unrelated inputs are far from parallel, as distinct texts are
    assert all(abs(sum(a * b for a, b in zip(base, v, strict=True))) < 0.9 for v in vectors)


def test_the_vector_is_fixed_across_runs() -> None:
    # a hash, not Python's randomised hash(): a restarted engine answers alike
    assert embedding_of((1,), 2) == pytest.approx([0.7637, 0.6455], abs=1e-4)


def test_no_dimensions_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one dimension"):
        embedding_of((1,), 0)
