"""Index keys: one per engine incarnation and data-parallel rank (sans-IO).

Keying by incarnation (the supervisor's number for one life of an engine), not by engine name, means
a replaced engine's late events or clean-up never touch its successor.
"""

from __future__ import annotations


def index_key(incarnation: int, rank: int) -> str:
    return f"g{incarnation}r{rank}"


def incarnation_of(key: str) -> int:
    """The incarnation an index key belongs to (inverse of :func:`index_key`)."""
    return int(key[1 : key.index("r")])
