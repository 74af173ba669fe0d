"""The two OpenAI logprobs shapes, built from per-token logprobs (sans-IO)."""

from __future__ import annotations

from direct_frontend.engines.neutral import TokenLogprob
from direct_frontend.http.logprobs import ChoiceLogprobs, chat_logprobs
from direct_frontend.pipeline.output_track import prompt_offsets
from direct_frontend.text.model_dir import TextModel


def test_chat_entries_carry_token_bytes_and_sorted_alternatives(text_model: TextModel) -> None:
    ids = text_model.encode(" sea")
    other = text_model.encode(" sky")[0]
    lps = [TokenLogprob(t, -0.5, ((t, -0.5), (other, -1.25))) for t in ids]
    body = chat_logprobs(text_model.token_bytes, lps)
    assert body["refusal"] is None
    first = body["content"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(first["bytes"]).decode() == first["token"]
    assert [a["logprob"] for a in first["top_logprobs"]] == [-0.5, -1.25]
    assert b"".join(bytes(e["bytes"]) for e in body["content"]) == b" sea"


def test_completion_parts_run_their_offsets_on_and_merge(text_model: TextModel) -> None:
    ids = text_model.encode(" the blue sea")
    starts = [len(text_model.decode(ids[:i])) for i in range(len(ids))]
    prompt = text_model.encode("hi")
    echo = text_model.decode(prompt)
    builder = ChoiceLogprobs(False, text_model.token_bytes, len(echo))
    lps = [TokenLogprob(t, -float(i + 1), ((t, -float(i + 1)),)) for i, t in enumerate(ids)]
    first, second = builder.batch(lps[:2], starts[:2]), builder.batch(lps[2:], starts[2:])
    assert first["text_offset"] + second["text_offset"] == [len(echo) + s for s in starts]
    push = text_model.new_detokenizer().push
    builder.prompt(prompt, (None,) * len(prompt), prompt_offsets(push, prompt))
    whole = builder.whole()
    assert whole["token_logprobs"][: len(prompt)] == [None] * len(prompt)
    assert whole["tokens"][len(prompt):] == [text_model.token_bytes.completion_token(t)
                                             for t in ids]
    assert whole["top_logprobs"][len(prompt)] == {whole["tokens"][len(prompt)]: -1.0}
    assert whole["text_offset"][0] == 0
