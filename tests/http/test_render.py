"""Response rendering (checked with the official openai types), metrics and logging."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from openai.types import Completion, CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from direct_frontend.http.render import (
    ChoiceOutput,
    ChunkRenderer,
    render_anthropic_models,
    render_choices,
    render_embeddings,
    render_full,
    render_models,
)
from direct_frontend.openai.errors import (
    engine_failed,
    error_body,
)
from direct_frontend.openai.parsers.base import ParsedDelta, ToolCallDelta, collect
from direct_frontend.pipeline.models import ModelCard
from direct_frontend.pipeline.relay_events import Usage

MODEL = 'org/model "v2"'  # quotes prove the model name is JSON-escaped


def sse_data(event: bytes) -> str:
    """The payload of exactly one SSE ``data:`` event."""
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    assert event.count(b"\n\n") == 1
    return event[len(b"data: ") : -2].decode()


# ---------------------------------------------------------------- streamed chat chunks


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_parses_with_openai_types(include_usage: bool) -> None:
    r = ChunkRenderer("chat", "abc123", MODEL, 1_700_000_000, include_usage)
    texts = ["Hel", "lo, ", 'wörld "quoted"\n', "\u2028 \t\\ </s>", ""]
    chunks = [ChatCompletionChunk.model_validate_json(sse_data(r.role_chunk()))]
    chunks += [ChatCompletionChunk.model_validate_json(sse_data(r.text(t))) for t in texts]
    chunks.append(ChatCompletionChunk.model_validate_json(sse_data(r.finish("stop", "</s>"))))
    for c in chunks:
        assert c.id == "chatcmpl-abc123"
        assert c.object == "chat.completion.chunk"
        assert c.created == 1_700_000_000
        assert c.model == MODEL
        assert c.service_tier == "default"
        assert len(c.choices) == 1
        assert c.choices[0].index == 0
        assert c.usage is None
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert [c.choices[0].delta.content for c in chunks[1:-1]] == texts
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop"
    assert last.delta.content is None
    assert last.model_extra == {"stop_reason": "</s>"}

    usage_event = r.usage(10, 5, 4)
    if not include_usage:
        assert usage_event == b""
    else:
        u = ChatCompletionChunk.model_validate_json(sse_data(usage_event))
        assert u.choices == []
        assert u.usage is not None
        assert (u.usage.prompt_tokens, u.usage.completion_tokens, u.usage.total_tokens) == (
            10,
            5,
            15,
        )
        assert u.usage.prompt_tokens_details is not None
        assert u.usage.prompt_tokens_details.cached_tokens == 4
        # OpenAI sends "usage": null on every other chunk when usage was asked for.
        assert '"usage":null' in sse_data(r.text("x"))
    assert r.done() == b"data: [DONE]\n\n"


def test_finish_with_token_id_stop_reason_and_length() -> None:
    r = ChunkRenderer("chat", "x", "m", 1, False)
    c = ChatCompletionChunk.model_validate_json(sse_data(r.finish("stop", 128009)))
    assert c.choices[0].model_extra == {"stop_reason": 128009}
    c = ChatCompletionChunk.model_validate_json(sse_data(r.finish("length", None)))
    assert c.choices[0].finish_reason == "length"
    assert c.choices[0].model_extra == {"stop_reason": None}


def test_error_event_carries_the_openai_error() -> None:
    r = ChunkRenderer("chat", "x", "m", 1, True)
    err = engine_failed("engine went away")
    data = json.loads(sse_data(r.error(err)))
    assert data == json.loads(error_body(err))
    assert data["error"]["message"] == "engine went away"
    assert data["error"]["code"] == "engine_error"


def test_lone_surrogate_does_not_break_the_stream() -> None:
    r = ChunkRenderer("chat", "x", "m", 1, False)
    c = ChatCompletionChunk.model_validate_json(sse_data(r.text("a\ud800b")))
    assert c.choices[0].delta.content == "a?b"


# ---------------------------------------------------------------- streamed completion chunks


def test_completion_stream_parses_with_openai_types() -> None:
    r = ChunkRenderer("completion", "abc", MODEL, 42, True)
    assert r.role_chunk() == b""
    raw = json.loads(sse_data(r.text('one "two"\n')))
    # Streamed text chunks carry finish_reason null (as OpenAI and vLLM send), which the
    # client reads without validation; Completion's strict model demands a reason, so
    # validate the rest of the chunk with a reason filled in.
    assert raw["choices"][0]["finish_reason"] is None
    raw["choices"][0]["finish_reason"] = "stop"
    c = Completion.model_validate(raw)
    assert (c.id, c.object, c.created, c.model) == ("cmpl-abc", "text_completion", 42, MODEL)
    assert c.choices[0].text == 'one "two"\n'

    fin = Completion.model_validate_json(sse_data(r.finish("length", None)))
    assert fin.choices[0].finish_reason == "length"
    assert fin.choices[0].text == ""

    u = Completion.model_validate_json(sse_data(r.usage(3, 2, 0)))
    assert u.choices == []
    assert u.usage is not None
    assert u.usage.total_tokens == 5


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown response kind"):
        ChunkRenderer("embedding", "x", "m", 1, False)  # type: ignore[arg-type]


# ---------------------------------------------------------------- full responses and models


def test_render_full_chat() -> None:
    body = render_full("chat", "r1", MODEL, 7, "Hi there", "stop", "\n\n", Usage(12, 3, 8))
    c = ChatCompletion.model_validate_json(body)
    assert (c.id, c.object, c.created, c.model) == ("chatcmpl-r1", "chat.completion", 7, MODEL)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == "Hi there"
    assert c.choices[0].finish_reason == "stop"
    assert c.choices[0].model_extra == {"stop_reason": "\n\n"}
    assert c.usage is not None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (12, 3, 15)
    assert c.usage.prompt_tokens_details is not None
    assert c.usage.prompt_tokens_details.cached_tokens == 8


@pytest.mark.parametrize("tier", ["priority", "flex"])
def test_every_object_reports_the_tier_it_was_served_at(tier: str) -> None:
    chunk = ChunkRenderer("chat", "r", MODEL, 1, True, service_tier=tier)
    for event in (chunk.role_chunk(), chunk.text("x"), chunk.finish("stop", None),
                  chunk.usage(1, 1)):
        assert ChatCompletionChunk.model_validate_json(sse_data(event)).service_tier == tier
    text = ChunkRenderer("completion", "r", MODEL, 1, False, service_tier=tier)
    assert json.loads(sse_data(text.text("x")))["service_tier"] == tier
    full = render_full("chat", "r", MODEL, 1, "x", "stop", None, Usage(1, 1), service_tier=tier)
    assert ChatCompletion.model_validate_json(full).service_tier == tier
    legacy = render_choices("completion", "r", MODEL, 1, [ChoiceOutput("x", "stop")],
                            Usage(1, 1), tier)
    assert Completion.model_validate_json(legacy).model_extra == {"service_tier": tier}


def test_render_full_completion() -> None:
    body = render_full("completion", "r2", "m", 7, "text", "length", None, Usage(1, 16))
    c = Completion.model_validate_json(body)
    assert (c.id, c.object) == ("cmpl-r2", "text_completion")
    assert c.choices[0].text == "text"
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None
    assert c.usage.total_tokens == 17


def test_render_full_scrubs_surrogates() -> None:
    c = ChatCompletion.model_validate_json(
        render_full("chat", "r", "m", 1, "x\udcff", "stop", None, Usage(1, 1))
    )
    assert c.choices[0].message.content == "x?"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_each_choice_renders_with_its_index(kind: str) -> None:
    r = ChunkRenderer(kind, "abc", MODEL, 1, True, index=2)  # type: ignore[arg-type]
    events = [r.text("x"), r.finish("length", None)] + ([r.role_chunk()] if kind == "chat" else [])
    for event in events:
        chunk = json.loads(sse_data(event))
        assert [c["index"] for c in chunk["choices"]] == [2]
        if kind == "chat":
            ChatCompletionChunk.model_validate(chunk)


def test_render_choices_keeps_every_choice_in_order() -> None:
    outputs = [ChoiceOutput("one", "stop", "\n"), ChoiceOutput("two", "length"),
               ChoiceOutput("thr\udcffee", "stop", 2)]
    chat = ChatCompletion.model_validate_json(
        render_choices("chat", "r", "m", 1, outputs, Usage(5, 9, 4))
    )
    assert [(c.index, c.message.content, c.finish_reason) for c in chat.choices] == [
        (0, "one", "stop"), (1, "two", "length"), (2, "thr?ee", "stop"),
    ]
    assert chat.usage is not None and chat.usage.total_tokens == 14
    text = Completion.model_validate_json(
        render_choices("completion", "r", "m", 1, outputs[:2], Usage(5, 9))
    )
    assert [(c.index, c.text) for c in text.choices] == [(0, "one"), (1, "two")]


def test_render_models() -> None:
    cards = [ModelCard("a", "direct-frontend", 4096), ModelCard("b/c", "team", None, "a")]
    body = json.loads(render_models(cards, 99))
    assert body["object"] == "list"
    models = [Model.model_validate(m) for m in body["data"]]
    assert [(m.id, m.object, m.created, m.owned_by) for m in models] == [
        ("a", "model", 99, "direct-frontend"),
        ("b/c", "model", 99, "team"),
    ]
    assert body["data"][0]["max_model_len"] == 4096 and "parent" not in body["data"][0]
    assert body["data"][1]["parent"] == "a" and "max_model_len" not in body["data"][1]
    assert json.loads(render_models([], 1)) == {"object": "list", "data": []}


# ---------------------------------------------------------------- metrics





def test_parsed_chunks_carry_reasoning_content_and_tool_calls() -> None:
    renderer = ChunkRenderer("chat", "r1", MODEL, 7, False)
    assert renderer.parsed(ParsedDelta()) == b""
    delta = ParsedDelta(content="a", reasoning="b",
                        tool_calls=[ToolCallDelta(0, "", "call_1", "f"), ToolCallDelta(1, "{}")])
    chunk = ChatCompletionChunk.model_validate_json(sse_data(renderer.parsed(delta)))
    got = chunk.choices[0].delta
    assert (got.content, got.model_extra) == ("a", {"reasoning_content": "b"})
    assert got.tool_calls is not None
    assert [(c.index, c.id, c.type) for c in got.tool_calls] == [(0, "call_1", "function"),
                                                                  (1, None, None)]
    message = collect([delta])
    body = render_choices("chat", "r1", MODEL, 7,
                          [ChoiceOutput("", "tool_calls", None, None, message)], Usage(1, 1))
    full = ChatCompletion.model_validate_json(body).choices[0].message
    assert full.tool_calls is not None and full.tool_calls[0].function.name == "f"
    assert full.model_extra == {"reasoning_content": "b"} and full.content == "a"


def test_render_embeddings_as_floats_and_as_base64_float32() -> None:
    vectors = [[0.6, -0.8], [1.0, 0.0]]
    floats = json.loads(render_embeddings("emb", vectors, 7, base64_floats=False))
    parsed = CreateEmbeddingResponse.model_validate(floats)  # the openai SDK's own type
    assert [d.embedding for d in parsed.data] == vectors
    assert [d.index for d in parsed.data] == [0, 1]
    assert (parsed.model, parsed.usage.prompt_tokens, parsed.usage.total_tokens) == ("emb", 7, 7)
    packed = json.loads(render_embeddings("emb", vectors, 7, base64_floats=True))
    for entry, vector in zip(packed["data"], vectors, strict=True):
        raw = base64.b64decode(entry["embedding"])
        assert struct.unpack(f"<{len(vector)}f", raw) == pytest.approx(vector)


@pytest.mark.parametrize(("limit", "after", "before", "ids", "more"), [
    (20, None, None, ["a", "b", "c", "d"], False),
    (2, None, None, ["a", "b"], True),
    (2, "b", None, ["c", "d"], False),
    (1, "b", None, ["c"], True),
    (2, None, "d", ["b", "c"], True),
    (2, None, "b", ["a"], False),
    (2, "zz", None, [], False),
])
def test_anthropics_model_pages_follow_its_cursors(
    limit: int, after: str | None, before: str | None, ids: list[str], more: bool
) -> None:
    cards = [ModelCard(name, "direct-frontend", None) for name in "abcd"]
    page = json.loads(render_anthropic_models(cards, 0, limit, after, before))
    assert [m["id"] for m in page["data"]] == ids and page["has_more"] is more
    assert page["first_id"] == (ids[0] if ids else None)
    assert page["last_id"] == (ids[-1] if ids else None)
    if ids:
        assert page["data"][0] == {"id": ids[0], "display_name": ids[0],
                                   "created_at": "1970-01-01T00:00:00Z", "type": "model"}
