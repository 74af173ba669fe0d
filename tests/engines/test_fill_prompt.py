"""A conversation's next turn starts its engine id list from the last turn's (sans-IO)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import COPY_MIN_IDS
from direct_frontend.engines.neutral import GenerateCall, SamplingOptions
from direct_frontend.kv.prefix import PromptIds

#: engine kind → its contract's field for the prompt's ids
FIELDS = {"sglang": "input_ids", "vllm": "input_ids", "trtllm": "input_token_ids"}


def sent(ids: tuple[int, ...], text: str, kind: str = "sglang") -> tuple[list[int], str]:
    request = dialect_for(kind).generate(GenerateCall(
        "r", ids, SamplingOptions(max_tokens=4), original_text=text)).request
    return list(getattr(request.tokenized, FIELDS[kind])), request.tokenized.original_text


def next_turn(earlier: PromptIds, known: int, new: list[int]) -> PromptIds:
    """As the prompt cache makes them: ``earlier``'s first ``known`` ids, then ``new``."""
    return PromptIds((*earlier[:known], *new), earlier.chains, known,
                     built_source=earlier.built, keep_built=True)


@settings(max_examples=40, deadline=None)
@given(first=st.integers(0, 3000), cut=st.integers(0, 3000),
       new=st.lists(st.integers(0, 2**31 - 1), max_size=50), turns=st.integers(1, 3),
       kinds=st.lists(st.sampled_from(sorted(FIELDS)), min_size=4, max_size=4))
def test_each_turns_ids_equal_its_own(first: int, cut: int, new: list[int], turns: int,
                                      kinds: list[str]) -> None:
    """Shared prefixes long and short, cut inside the earlier prompt (a template that
    renders earlier turns anew) or at its end, turns sent to engines of any kind: each
    contract carries exactly the ids."""
    ids = PromptIds(range(first), keep_built=True)
    assert sent(ids, "t0", kinds[0]) == (list(ids), "t0")
    for turn in range(1, turns + 1):
        ids = next_turn(ids, min(cut, len(ids)), [*new, turn])
        assert sent(ids, f"t{turn}", kinds[turn]) == (list(ids), f"t{turn}")


def test_the_shared_part_is_copied_from_the_last_turns_message() -> None:
    """What the next turn sends within the shared prefix is what the last turn's message
    held (copied, not converted again); beyond it, its own ids."""
    earlier = PromptIds(range(COPY_MIN_IDS + 10), keep_built=True)
    sent(earlier, "a")
    assert earlier.built is not None
    earlier.built["sglang"].input_ids[0] = 424242  # marks the kept message
    later = next_turn(earlier, COPY_MIN_IDS + 5, [7, 8])
    ids, _ = sent(later, "b")
    assert ids[0] == 424242 and ids[1:] == list(later)[1:]
    short = next_turn(earlier, COPY_MIN_IDS - 1, [7])  # too short to copy: converted
    assert sent(short, "c")[0] == list(short)
