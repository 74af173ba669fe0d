"""Prompt ids held as u32 bytes go into the engine request as their packed varints, and a
conversation's next turn takes the last turn's encoding of the ids it shares (sans-IO)."""

from __future__ import annotations

import array

from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import Rpc
from direct_frontend.engines.dialects.ids import (
    PACKED_MIN_IDS,
    RUNS_MAX_PIECES,
    encode_request,
    packed_varints,
    varint,
)
from direct_frontend.engines.grpclib_reader import EncodedCodec
from direct_frontend.engines.neutral import GenerateCall, SamplingOptions
from direct_frontend.text.prompt_ids import PromptIds

#: engine kind → its contract's field for the prompt's ids
FIELDS = {"sglang": "input_ids", "vllm": "input_ids", "trtllm": "input_token_ids"}


def built(ids: tuple[int, ...] | PromptIds, text: str, kind: str = "sglang") -> Rpc:
    return dialect_for(kind).generate(GenerateCall(
        "r", ids, SamplingOptions(max_tokens=4), original_text=text))


def sent(ids: tuple[int, ...] | PromptIds, text: str, kind: str = "sglang"
         ) -> tuple[list[int], str]:
    """The ids and text of the request the engine parses (what the transport sends)."""
    rpc = built(ids, text, kind)
    request = type(rpc.request).FromString(encode_request(rpc.request, rpc.runs))
    return list(getattr(request.tokenized, FIELDS[kind])), request.tokenized.original_text


def next_turn(earlier: PromptIds, known: int, new: list[int]) -> PromptIds:
    """As the prompt cache makes them: ``earlier``'s first ``known`` ids, then ``new``."""
    raw = earlier.raw[:4 * known] + array.array("I", new).tobytes()
    return PromptIds(raw, earlier.chains, known, encoded_source=earlier.encoded,
                     keep_encoded=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**21 - 1), st.integers(0, 2**32 - 1)),
                max_size=300))
def test_packed_varints_are_protobufs(ids: list[int]) -> None:
    """Narrow ids and wide ones (the general path), each the varint protobuf writes."""
    raw = array.array("I", ids).tobytes()
    assert packed_varints(raw) == b"".join(map(varint, ids))


def test_every_width_of_id_round_trips() -> None:
    """Through the packed path (narrow ids, and wide ones) and, for few ids, the list."""
    edges = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**32 - 1]
    for ids in (edges * 100, edges[:7] * 200, edges, edges[:7]):
        rpc = built(PromptIds(ids), "e")
        assert (rpc.runs is not None) == (len(ids) >= PACKED_MIN_IDS)
        assert sent(PromptIds(ids), "e")[0] == ids


@settings(max_examples=40, deadline=None)
@given(first=st.integers(0, 3000), cut=st.integers(0, 3000),
       new=st.lists(st.integers(0, 2**32 - 1), max_size=50), turns=st.integers(1, 3),
       kinds=st.lists(st.sampled_from(sorted(FIELDS)), min_size=4, max_size=4))
def test_each_turns_ids_equal_its_own(first: int, cut: int, new: list[int], turns: int,
                                      kinds: list[str]) -> None:
    """Shared prefixes long and short, cut inside the earlier prompt (a template that
    renders earlier turns anew) or at its end, turns sent to engines of any kind: each
    contract carries exactly the ids, and the text."""
    ids = PromptIds(range(first), keep_encoded=True)
    assert sent(ids, "t0", kinds[0]) == (list(ids), "t0")
    for turn in range(1, turns + 1):
        ids = next_turn(ids, min(cut, len(ids)), [*new, turn])
        assert sent(ids, f"t{turn}", kinds[turn]) == (list(ids), f"t{turn}")


def test_plain_ids_and_few_fill_the_requests_list() -> None:
    """Ids that are no PromptIds (a client's token ids), and few PromptIds, go in the
    message's own list."""
    for ids in ((5, 6, 7), PromptIds([5, 6, 7]), PromptIds(range(PACKED_MIN_IDS - 1))):
        rpc = built(ids, "p")
        assert rpc.runs is None and list(rpc.request.tokenized.input_ids) == list(ids)
        assert encode_request(rpc.request, rpc.runs) == rpc.request.SerializeToString()


def test_a_request_of_held_ids_leaves_its_list_empty_and_its_text_in_place() -> None:
    rpc = built(PromptIds([9, 300, 70000] * PACKED_MIN_IDS), "q", "trtllm")
    assert rpc.runs is not None and not rpc.request.tokenized.input_token_ids
    assert rpc.request.tokenized.original_text == "q"
    assert sent(PromptIds([]), "", "vllm") == ([], "")


def test_the_shared_part_is_the_last_turns_encoding() -> None:
    """What the next turn sends within the shared prefix is the last turn's kept encoding
    (not encoded again); beyond it, its own ids."""
    earlier = PromptIds(range(1000), keep_encoded=True)
    built(earlier, "a")
    assert earlier.encoded is not None and earlier.encoded[-1][0] == 1000
    end, piece = earlier.encoded[0]
    earlier.encoded = ((end, varint(424242) + piece[1:]),)  # marks the kept encoding
    later = next_turn(earlier, 1000, [7, 8])
    ids, _ = sent(later, "b")
    assert ids[0] == 424242 and ids[1:] == list(later)[1:]
    assert later.encoded_source is None  # let go of once used


def test_each_next_turn_encodes_only_its_new_ids() -> None:
    for kind in sorted(FIELDS):
        ids = PromptIds(range(2000), keep_encoded=True)
        first = built(ids, "a", kind).runs
        assert first is not None and len(first.pieces) == 1
        for turn in range(3):
            ids = next_turn(ids, len(ids), [turn] * 5)
            rpc = built(ids, "b", kind)
            assert rpc.runs is not None and rpc.runs.pieces[0] is first.pieces[0]
            assert rpc.runs.pieces[-1] == bytes([turn] * 5)
            assert sent(ids, "b", kind)[0] == list(ids)


def test_a_turn_that_renders_the_last_one_anew_encodes_only_from_there() -> None:
    """Sharing all but the last turn's last ids, a turn encodes those of the last turn's
    piece that it shares and its own, not the turns before."""
    ids = PromptIds(range(2000), keep_encoded=True)
    built(ids, "a")
    ids = next_turn(ids, len(ids), list(range(300)))
    first = built(ids, "b").runs
    assert first is not None and len(first.pieces) == 2
    ids = next_turn(ids, len(ids) - 7, [1, 2, 3])
    rpc = built(ids, "c")
    assert rpc.runs is not None and rpc.runs.pieces[0] is first.pieces[0]
    assert len(rpc.runs.pieces) == 3 and len(rpc.runs.pieces[1]) < 3 * 300
    assert sent(ids, "c")[0] == list(ids)


def test_another_attempt_takes_the_encoding_made_for_the_first() -> None:
    earlier = PromptIds(range(1000), keep_encoded=True)
    built(earlier, "a")
    later = next_turn(earlier, 1000, [1, 2])
    once = built(later, "b").runs
    again = built(later, "b", "vllm").runs
    assert once is not None and again is not None and len(again.pieces) == len(once.pieces)
    assert all(a is b for a, b in zip(again.pieces, once.pieces, strict=True))  # (not again)


def test_a_long_conversations_kept_encoding_stays_in_few_pieces() -> None:
    ids = PromptIds(range(2000), keep_encoded=True)
    built(ids, "a")
    for turn in range(RUNS_MAX_PIECES + 5):
        ids = next_turn(ids, len(ids), [turn] * 3)
        rpc = built(ids, "b")
        assert rpc.runs is not None and len(rpc.runs.pieces) <= RUNS_MAX_PIECES
        assert ids.encoded is not None and len(ids.encoded) <= RUNS_MAX_PIECES
        assert sent(ids, "b")[0] == list(ids)


def test_the_codec_sends_an_encoded_request_as_it_is() -> None:
    codec = EncodedCodec()
    request = built(PromptIds(range(5)), "x").request
    assert codec.encode(b"\x01\x02", type(request)) == b"\x01\x02"
    assert codec.encode(request, type(request)) == request.SerializeToString()
