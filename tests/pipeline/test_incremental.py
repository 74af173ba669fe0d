"""A conversation's next turn tokenizes only what is new, and its ids are a whole
tokenization's: checked over real chat templates' shapes, one of which renders earlier turns
differently once the conversation moves on (their reasoning dropped), and one whose first
line changes every turn."""

from __future__ import annotations

import array
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from direct_frontend.kv.prefix import prefix_hashes
from direct_frontend.openai.parse import parse_chat_request
from direct_frontend.pipeline.preprocess import chat_prompt_ids
from direct_frontend.pipeline.tokenizing import RAW_MIN_CHARS, Tokenizing, joined
from direct_frontend.routing.catalog import Catalog
from direct_frontend.text.model_dir import TextModel
from direct_frontend.text.prompt_ids import PromptIds

# ChatML with Qwen3's habit: an assistant turn's reasoning is rendered only after the
# last user message, so a new user turn re-renders the earlier answers without it.
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + c.function.name + ' ' + c.function.arguments + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's shape: a BOS, header tokens around the role, trimmed content, end-of-turn.
LLAMA3_LIKE = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{{- (m.content or '') | trim }}"
    "{%- for c in m.tool_calls or [] %}{{- c.function.arguments }}{%- endfor %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
# A first line that counts the messages: no two turns share a prefix.
COUNTING = (
    "{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
EXTRA_SPECIALS = ["<think>", "</think>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
TEMPLATES = {"chatml": None, "qwen3": QWEN3_LIKE, "llama3": LLAMA3_LIKE, "counting": COUNTING}


@pytest.fixture(scope="module")
def models(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TextModel]:
    out = {}
    for name, template in TEMPLATES.items():
        target = tmp_path_factory.mktemp(name) / "model"
        shutil.copytree(model_dir, target)
        tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
        tokenizer.add_special_tokens(EXTRA_SPECIALS)
        (target / "tokenizer.json").write_text(tokenizer.to_str())
        if template is not None:
            (target / "chat_template.jinja").write_text(template)
        out[name] = TextModel.load(target)
    return out


WORDS = st.sampled_from(["hello", "the", "file", "is", "empty", "  ", "\n", "é", "中文", "42",
                         "<think>", "x=1;", "<|im_end|>", "done."])
TEXT = st.lists(WORDS, min_size=0, max_size=12).map(" ".join)


@st.composite
def turns(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A conversation: a system prompt, then users, assistants (reasoning, a tool call) and
    tool results in any order."""
    out: list[dict[str, Any]] = [{"role": "system", "content": draw(TEXT)}]
    for i in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["user", "assistant", "tool"]))
        if kind == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": draw(TEXT)}
            if draw(st.booleans()):
                message["reasoning_content"] = draw(TEXT) or "hmm"
            if draw(st.booleans()):
                message["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {
                    "name": "read", "arguments": json.dumps({"path": draw(TEXT)})}}]
            out.append(message)
        elif kind == "tool":
            out.append({"role": "tool", "tool_call_id": f"c{i}", "content": draw(TEXT)})
        else:
            out.append({"role": "user", "content": draw(TEXT)})
    return out


def _whole(model: TextModel, messages: list[dict[str, Any]]) -> list[int]:
    """The reference: the rendered prompt through tokenizers, in one piece."""
    chat = parse_chat_request(json.dumps({"model": "m", "messages": messages}).encode())
    from direct_frontend.pipeline.tokenizing import render

    prompt, _ = render(model, chat, True)
    return model._tokenizer.encode(prompt, add_special_tokens=False).ids


async def _ids(tokenizing: Tokenizing, messages: list[dict[str, Any]]) -> tuple[int, ...]:
    chat = parse_chat_request(json.dumps({"model": "m", "messages": messages}).encode())
    return (await chat_prompt_ids(chat, tokenizing))[1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=turns(), branch=turns())
def test_every_turn_has_the_ids_of_a_whole_tokenization(
    models: dict[str, TextModel], conversation: list[dict[str, Any]],
    branch: list[dict[str, Any]],
) -> None:
    """Turn after turn, and a branch off the middle: the ids are the whole prompt's; the
    prefix was reused; the block hashes are those of the ids hashed afresh."""

    async def check(model: TextModel) -> int:
        tokenizing = Tokenizing(model, lambda: Catalog(), prefix_min_chars=0,
                                turns_min_messages=2)
        middle = len(conversation) // 2 + 1
        steps = [conversation[:k] for k in range(1, len(conversation) + 1)]
        steps.append(conversation[:middle] + branch[1:])  # a branch shares the early turns
        for messages in steps:
            ids = await _ids(tokenizing, messages)
            assert list(ids) == _whole(model, messages)
            assert isinstance(ids, PromptIds)
            assert prefix_hashes(ids, 4) == prefix_hashes(tuple(ids), 4)
            assert prefix_hashes(ids, 4, cache_salt="s") == prefix_hashes(tuple(ids), 4,
                                                                          cache_salt="s")
            for kept in tokenizing.prefixes.kept():  # cuts taken from a prefix's too
                assert kept.cuts == model.encoder.boundaries(kept.text)
        return tokenizing.prefixes.hits

    for name, model in models.items():
        hits = trio.run(check, model)
        if name != "counting" and len(conversation) > 1:
            assert hits > 0, name  # the next turn found the last one's prefix


async def test_a_known_prefix_is_not_tokenized_again(models: dict[str, TextModel]) -> None:
    model = models["qwen3"]
    tokenizing = Tokenizing(model, lambda: Catalog(), prefix_min_chars=0)
    base = [{"role": "system", "content": "Be brief. " * 50},
            {"role": "user", "content": "Read the file."}]
    await _ids(tokenizing, base)
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    grown = [*base, {"role": "assistant", "content": "", "tool_calls": [call],
                     "reasoning_content": "I should read it."},
             {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]
    ids = await _ids(tokenizing, grown)
    assert isinstance(ids, PromptIds)
    first = await _ids(tokenizing, base)  # (from the exact cache)
    assert ids.known == len(first)  # all of it: the answer begins with <think>, a cut
    assert list(ids) == _whole(model, grown)
    # a new user turn: the answer above is rendered without its reasoning now
    later = [*grown, {"role": "user", "content": "Thanks."}]
    again = await _ids(tokenizing, later)
    assert isinstance(again, PromptIds)
    assert 0 < again.known < len(ids) and list(again) == _whole(model, later)


async def test_short_chats_are_tokenized_whole_and_not_kept(models: dict[str, TextModel]
                                                            ) -> None:
    model = models["chatml"]
    tokenizing = Tokenizing(model, lambda: Catalog())
    short = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    ids = await _ids(tokenizing, short)
    assert list(ids) == _whole(model, short)
    assert len(tokenizing.prefixes) == 0  # below prefix_min_chars: a lookup costs more
    long = [{"role": "system", "content": "Be brief. " * 1000}, *short[1:]]
    await _ids(tokenizing, long)
    assert len(tokenizing.prefixes) == 1


@settings(max_examples=300, deadline=None)
@given(earlier=st.lists(st.integers(0, 5), max_size=12), data=st.data())
def test_joined_ids_are_the_shared_prefix_and_the_rest(earlier: list[int],
                                                       data: st.DataObject) -> None:
    """Whatever the rest, the ids are the earlier ones' first ``known`` and then it; all of
    the earlier ones are shared only where the rest goes on with them."""
    known = data.draw(st.integers(0, len(earlier)))
    rest = data.draw(st.one_of(
        st.lists(st.integers(0, 5), max_size=8),
        st.lists(st.integers(0, 5), max_size=4).map(lambda more: earlier[known:] + more)))
    prior = PromptIds(earlier)
    raw, shared = joined(prior, known, array.array("I", rest).tobytes())
    whole = PromptIds(raw)
    assert list(whole) == earlier[:known] + rest
    assert whole[:shared] == tuple(earlier[:shared]) and shared >= known
    assert (shared == len(earlier)) is (rest[:len(earlier) - known] == earlier[known:])


@pytest.mark.parametrize("chars", [10, RAW_MIN_CHARS - 1, RAW_MIN_CHARS, 3 * RAW_MIN_CHARS])
async def test_a_texts_ids_are_its_list_of_ids_however_made(models: dict[str, TextModel],
                                                            chars: int) -> None:
    """Short texts' ids come as a list of ints, longer ones' as the tokenizer's u32 bytes:
    the same ids, special tokens added or not."""
    model = models["chatml"]
    tokenizing = Tokenizing(model, lambda: Catalog())
    text = ("Read the file, then <|im_start|>say what it holds. " * chars)[:chars]
    for special in (False, True):
        ids = await tokenizing.encode_ids(text, "prompt", add_special_tokens=special)
        assert list(ids) == model.encode(text, add_special_tokens=special)


async def test_a_next_turn_that_goes_on_from_the_last_shares_all_of_it(
        models: dict[str, TextModel]) -> None:
    """The last prompt's generation prompt is where the answer goes on: its every id is
    shared (so its block hashes and engine ids are taken whole)."""
    model = models["chatml"]
    tokenizing = Tokenizing(model, lambda: Catalog(), prefix_min_chars=0)
    base = [{"role": "system", "content": "Be brief. " * 50},
            {"role": "user", "content": "Read the file."}]
    first = await _ids(tokenizing, base)
    grown = [*base, {"role": "assistant", "content": "It is empty."},
             {"role": "user", "content": "Thanks."}]
    ids = await _ids(tokenizing, grown)
    assert isinstance(ids, PromptIds) and ids.known == len(first)
    assert list(ids) == _whole(model, grown)
