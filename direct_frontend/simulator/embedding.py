"""The simulated embedding model: a deterministic unit vector per token-id sequence.

An embedding engine (a vLLM with ``--runner pooling``, an SGLang with
``--is-embedding``) answers Embed with one vector per input. Tests need the
vector to be a stable function of the ids (the same input gives the same
vector on every engine of the model, so a retry elsewhere answers alike) and
different inputs to give different vectors; its values mean nothing. vLLM's
embed pooling L2-normalises by default, so the vector has length one.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

_WORD = struct.Struct("<I")


def embedding_of(token_ids: Sequence[int], dim: int) -> list[float]:
    """A length-one vector of ``dim`` floats drawn from a hash of ``token_ids``.

    SHAKE-256 of the ids stretches to any length cheaply; each 32-bit word
    becomes an odd multiple of 2**-32 in (-1, 1), so no component is zero and
    the norm never is.
    """
    if dim < 1:
        raise ValueError("an embedding has at least one dimension")
    digest = hashlib.shake_256(struct.pack(f"<{len(token_ids)}q", *token_ids))
    words = digest.digest(4 * dim)
    raw = [(2 * word + 1) / 2**32 - 1 for (word,) in _WORD.iter_unpack(words)]
    norm = math.sqrt(math.fsum(value * value for value in raw))
    return [value / norm for value in raw]
