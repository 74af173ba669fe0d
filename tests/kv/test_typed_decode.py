"""The typed decode of KV-event batches gives exactly what the general path gives.

:func:`decode_payload` reads the engines' usual layout typed and leaves every
other payload to the general path (``_decode_general``, read field by field);
for any payload, both must give the same batch, or both the same error.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from direct_frontend.kv import events as kv_events
from direct_frontend.kv.events import KvDecodeError, KvEventBatch, decode_payload
from direct_frontend.kv.index import KvIndex

_general = kv_events._decode_general
_typed = kv_events._decode_typed

good_hash = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=1, max_size=33))
any_hash = st.one_of(good_hash, st.just(b""), st.just("7"), st.booleans(), st.floats(0, 1))
opt_str = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "cpu_tier", "x"]))
opt_int = st.one_of(st.none(), st.integers(-3, 2**40))
bad = st.one_of(st.booleans(), st.floats(0, 1), st.lists(st.integers(0, 3), max_size=1))


def _fields(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], odd: bool
            ) -> dict[str, Any]:
    """Each field present or not; with ``odd``, some of a wrong type."""
    out = {}
    for name, values in fields.items():
        if draw(st.booleans()):
            out[name] = draw(st.one_of(values, bad) if odd else values)
    return out


@st.composite
def stored(draw: st.DrawFn, odd: bool) -> dict[str, Any]:
    hashes = st.lists(any_hash if odd else good_hash, max_size=4)
    tokens = st.lists(st.integers(-1 if odd else 0, 2**32 if odd else 2**32 - 1), max_size=6)
    if odd:
        tokens = st.one_of(tokens, st.lists(st.lists(st.integers(0, 9), min_size=2,
                                                     max_size=2), min_size=1, max_size=3))
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": draw(hashes),
                             "token_ids": draw(tokens),
                             "block_size": draw(st.integers(-1 if odd else 0, 32))}
    event |= _fields(draw, {
        "parent_block_hash": st.one_of(st.none(), any_hash if odd else good_hash),
        "lora_id": opt_int, "medium": opt_str, "lora_name": opt_str,
        "extra_keys": st.one_of(st.none(), st.lists(st.one_of(
            st.none(), st.lists(st.tuples(st.text(max_size=3), st.integers(0, 9)), max_size=2)),
            max_size=4)),
        "group_idx": opt_int, "kv_cache_spec_kind": opt_str,
        "kv_cache_spec_sliding_window": opt_int, "locality": opt_str, "ownership": opt_str,
        "session_id": opt_str, "cache_salt": opt_str, "future_field": st.integers(0, 3),
    }, odd)
    if odd and draw(st.booleans()):
        del event[draw(st.sampled_from(["block_hashes", "token_ids", "block_size"]))]
    return event


@st.composite
def removed(draw: st.DrawFn, odd: bool) -> dict[str, Any]:
    event = {"type": "BlockRemoved",
             "block_hashes": draw(st.lists(any_hash if odd else good_hash, max_size=4))}
    return event | _fields(draw, {"medium": opt_str, "group_idx": opt_int,
                                  "locality": opt_str, "ownership": opt_str}, odd)


def events(odd: bool) -> st.SearchStrategy[Any]:
    usual = st.one_of(stored(odd), removed(odd), st.just({"type": "AllBlocksCleared"}))
    if not odd:
        return usual
    return st.one_of(
        usual,
        st.just({"type": "SomethingNew", "block_hashes": [1]}),
        st.just({"block_hashes": [1]}),
        stored(False).map(lambda e: ["BlockStored", *list(e.values())[1:7]]),
        removed(False).map(lambda e: ["BlockRemoved", e["block_hashes"], e.get("medium")]),
        st.just(["AllBlocksCleared"]),
        st.integers(0, 3),
        st.text(max_size=3),
    )


@st.composite
def payloads(draw: st.DrawFn, odd: bool) -> bytes:
    ts = draw(st.floats(0, 2e9) | st.integers(0, 2**40) if not odd
              else st.one_of(st.floats(0, 2e9), st.integers(0, 9), st.booleans(), st.none()))
    items = draw(st.lists(events(odd), max_size=6))
    rank = draw(st.one_of(st.none(), st.integers(0, 7), *([st.booleans()] if odd else [])))
    forms: list[Any] = [[ts, items, rank], [ts, items]]
    if odd:
        forms += [{"ts": ts, "events": items, "attn_dp_rank": rank}, {"ts": ts, "events": items},
                  [ts, items, rank, 0], [ts], {"events": items}, ts]
    return msgspec.msgpack.encode(draw(st.sampled_from(forms)))


def _both(payload: bytes) -> KvEventBatch | str:
    """Both paths' result (the error's text where they raise), checked equal."""
    try:
        typed = decode_payload(payload, seq=5, topic=b"t")
    except KvDecodeError as exc:
        try:
            _general(payload, 5, b"t")
        except KvDecodeError as again:
            assert (str(exc), exc.seq) == (str(again), again.seq)
            return str(exc)
        raise AssertionError("only the typed path raised") from None
    assert typed == _general(payload, 5, b"t")
    return typed


@settings(max_examples=400, deadline=None)
@given(payload=payloads(odd=False))
def test_the_engines_layout_is_decoded_typed_as_the_general_path_decodes_it(
        payload: bytes) -> None:
    """Array batches of well-formed tagged-map events, bytes or signed hashes, every
    optional field: the typed path takes them, and the batch is the general path's."""
    assert _typed(payload) is not None
    batch = _both(payload)
    assert isinstance(batch, KvEventBatch) and batch.malformed_events == 0


@settings(max_examples=600, deadline=None)
@given(payload=payloads(odd=True))
def test_any_batch_decodes_as_the_general_path_decodes_it(payload: bytes) -> None:
    """Map batches, tag-first arrays, unknown and malformed events, extra elements,
    fields of wrong types: the same batch (counts included) or the same error."""
    _both(payload)


def test_payloads_outside_the_typed_layout_fall_back() -> None:
    """Each of these is the general path's to read (or to refuse) and reads as before."""
    cases = [
        {"ts": 1.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2},
        [1.0, [["BlockRemoved", [1, 2], "GPU"]], 0],
        [1.0, [{"type": "Unknown"}], 0],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [[1, 2]],
                "block_size": 1}], 0],
        [1.0, [], 0, "trailing"],
    ]
    for case in cases:
        payload = msgspec.msgpack.encode(case)
        assert _typed(payload) is None
    assert decode_payload(msgspec.msgpack.encode(cases[0])).dp_rank == 2
    assert decode_payload(msgspec.msgpack.encode(cases[2])).unknown_events == 1
    assert decode_payload(msgspec.msgpack.encode(cases[3])).events[0].bigram  # type: ignore[union-attr]


def test_damage_the_types_cannot_see_is_one_malformed_event() -> None:
    """A token beyond u32, a negative block size, empty hash bytes: decoded typed, each
    costs only its own event, as on the general path."""
    store = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}
    damaged = [store | {"token_ids": [2**32]}, store | {"block_size": -1},
               store | {"block_hashes": [b"", 1]}, {"type": "BlockRemoved", "block_hashes": [b""]}]
    payload = msgspec.msgpack.encode([1.0, [*damaged, store], 0])
    assert _typed(payload) is not None
    batch = _both(payload)
    assert isinstance(batch, KvEventBatch)
    assert batch.malformed_events == 4 and len(batch.events) == 1


@settings(max_examples=100, deadline=None)
@given(batches=st.lists(payloads(odd=False), min_size=1, max_size=4))
def test_the_index_ends_the_same_from_either_path(batches: list[bytes]) -> None:
    """The index fed the typed batches holds what it holds fed the general ones."""
    typed, general = KvIndex(1), KvIndex(1)
    for payload in batches:
        typed.apply("e", decode_payload(payload))
        general.apply("e", _general(payload, 0, b""))
    assert typed.export_engine("e") == general.export_engine("e")
    assert typed.stats() == general.stats()
