"""A conversation's next turn starts its engine id list from the last turn's, and its
encoding from the last turn's encoding of them (sans-IO)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import (
    COPY_MIN_IDS,
    RUNS_KEY,
    RUNS_MAX_PIECES,
    Rpc,
    encode_request,
)
from direct_frontend.engines.grpclib_reader import EncodedCodec
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


def built(ids: tuple[int, ...], text: str, kind: str = "sglang") -> Rpc:
    return dialect_for(kind).generate(GenerateCall(
        "r", ids, SamplingOptions(max_tokens=4), original_text=text))


@settings(max_examples=40, deadline=None)
@given(first=st.integers(COPY_MIN_IDS - 2, 2500),
       cuts=st.lists(st.integers(0, 40), min_size=1, max_size=RUNS_MAX_PIECES + 4),
       new=st.lists(st.integers(0, 2**32 - 1), max_size=40),
       kinds=st.lists(st.sampled_from(sorted(FIELDS)), min_size=RUNS_MAX_PIECES + 5,
                      max_size=RUNS_MAX_PIECES + 5))
def test_a_next_turns_encoding_is_its_request(first: int, cuts: list[int], new: list[int],
                                              kinds: list[str]) -> None:
    """Turn after turn (sharing all of the last one's ids, or all but its last ``cut``), on
    engines of one kind or several, in more turns than a kept encoding has pieces: what the
    transport sends parses to the request the dialect built, whose list is left as it was."""
    ids = PromptIds(range(first), keep_built=True)
    for turn, cut in enumerate([0, *cuts]):
        if turn:
            ids = next_turn(ids, max(len(ids) - cut, 0), [*new, turn])
        rpc = built(ids, f"t{turn}", kinds[turn])
        whole = rpc.request.SerializeToString()
        data = encode_request(rpc.request, rpc.runs)
        assert type(rpc.request).FromString(data) == rpc.request
        assert rpc.request.SerializeToString() == whole
        assert list(getattr(rpc.request.tokenized, FIELDS[kinds[turn]])) == list(ids)
        shared = turn and kinds[turn] == kinds[turn - 1] and ids.known >= COPY_MIN_IDS
        assert (rpc.runs is not None) == bool(shared)


def test_a_list_changed_after_building_is_encoded_whole() -> None:
    earlier = PromptIds(range(COPY_MIN_IDS + 10), keep_built=True)
    built(earlier, "a")
    rpc = built(next_turn(earlier, len(earlier), [5, 6]), "b")
    assert rpc.runs is not None and rpc.runs.known == len(earlier)
    rpc.request.tokenized.input_ids.append(9)
    assert encode_request(rpc.request, rpc.runs) == rpc.request.SerializeToString()


def test_the_codec_sends_an_encoded_request_as_it_is() -> None:
    codec = EncodedCodec()
    request = built(PromptIds(range(5)), "x").request
    assert codec.encode(b"\x01\x02", type(request)) == b"\x01\x02"
    assert codec.encode(request, type(request)) == request.SerializeToString()


def test_each_next_turn_encodes_only_its_new_ids() -> None:
    for kind in sorted(FIELDS):
        ids = PromptIds(range(COPY_MIN_IDS + 10), keep_built=True)
        assert built(ids, "a", kind).runs is None  # (a first turn: nothing ready)
        for turn in range(3):
            ids = next_turn(ids, len(ids), [turn] * 5)
            rpc = built(ids, "b", kind)
            assert rpc.runs is not None and rpc.runs.known == len(ids) - 5
            data = encode_request(rpc.request, rpc.runs)
            assert data != rpc.request.SerializeToString()
            assert type(rpc.request).FromString(data) == rpc.request


def test_a_turn_that_renders_the_last_one_anew_encodes_only_from_there() -> None:
    """Sharing all but the last turn's last ids, a turn encodes those of the last turn's
    piece that it shares and its own, not the turns before."""
    ids = PromptIds(range(COPY_MIN_IDS + 10), keep_built=True)
    built(ids, "a")
    ids = next_turn(ids, len(ids), list(range(300)))
    first = built(ids, "b").runs
    assert first is not None and len(first.pieces) == 1
    ids = next_turn(ids, len(ids) - 7, [1, 2, 3])
    rpc = built(ids, "c")
    assert rpc.runs is not None and rpc.runs.pieces[0] == first.pieces[0]
    assert len(rpc.runs.pieces) == 2 and len(rpc.runs.pieces[1]) < 3 * 300
    assert type(rpc.request).FromString(encode_request(rpc.request, rpc.runs)) == rpc.request


def test_a_long_conversations_kept_encoding_stays_in_few_pieces() -> None:
    ids = PromptIds(range(COPY_MIN_IDS + 10), keep_built=True)
    built(ids, "a")
    for turn in range(RUNS_MAX_PIECES + 5):
        ids = next_turn(ids, len(ids), [turn] * 3)
        rpc = built(ids, "b")
        assert rpc.runs is not None and len(rpc.runs.pieces) <= RUNS_MAX_PIECES
        assert ids.built is not None and len(ids.built["sglang" + RUNS_KEY]) <= RUNS_MAX_PIECES
        assert type(rpc.request).FromString(encode_request(rpc.request, rpc.runs)) == rpc.request
