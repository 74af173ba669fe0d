"""Tokenizer, chat template and incremental detokenizer, on the demo model."""

from __future__ import annotations

import json
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from direct_frontend.text.demo_model import build_model_dir
from direct_frontend.text.model_dir import ChatTemplateError, ModelDirError, TextModel, _tojson

# Characters rare in the demo corpus, so their bytes are split over several tokens.
RARE_CHARS = "🦜🧬🪐😀漢鬱東∑"


def _copy_model(model_dir: Path, dest: Path) -> Path:
    target = dest / "model"
    shutil.copytree(model_dir, target)
    return target


def _with_template(model_dir: Path, dest: Path, template: object) -> TextModel:
    target = _copy_model(model_dir, dest)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if template is None:
        del config["chat_template"]
    else:
        config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return TextModel.load(target)


def _split_char(model: TextModel) -> tuple[str, list[int]]:
    """A character whose UTF-8 bytes span at least three tokens, and its ids."""
    for char in RARE_CHARS:
        ids = model.encode(char)
        if len(ids) >= 3:
            return char, ids
    raise AssertionError("the demo tokenizer merged every rare character")


# --- model directory ----------------------------------------------------------------


def test_load_exposes_special_tokens_and_sizes(text_model: TextModel) -> None:
    im_end = text_model.token_to_id("<|im_end|>")
    assert im_end is not None
    assert text_model.bos_token is None
    assert text_model.eos_token == "<|im_end|>"
    assert text_model.eos_token_ids == (im_end,)
    assert text_model.vocab_size == 2003
    assert text_model.special_token_ids == {
        text_model.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    }
    assert text_model.max_position_embeddings == 4096
    assert text_model.has_chat_template
    assert text_model.token_to_id("no such token") is None


def test_eos_ids_merge_generation_config_and_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    target = _copy_model(model_dir, tmp_path)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2002, 9]}))
    assert TextModel.load(target).eos_token_ids == (7, 2002, 9)
    (target / "generation_config.json").unlink()
    (target / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 5}}))
    assert TextModel.load(target).eos_token_ids == (5, 2002)


@pytest.mark.parametrize(
    ("file", "content", "needle"),
    [
        ("tokenizer.json", None, "tokenizer.json: file missing"),
        ("tokenizer.json", "{not json", "tokenizer.json: cannot load tokenizer"),
        ("tokenizer_config.json", None, "tokenizer_config.json: file missing"),
        ("tokenizer_config.json", "{broken", "tokenizer_config.json: cannot read JSON"),
        ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: expected a JSON object"),
        ("generation_config.json", "{", "generation_config.json: cannot read JSON"),
        ("config.json", "nope", "config.json: cannot read JSON"),
    ],
)
def test_missing_or_broken_files_name_the_file(
    model_dir: Path, tmp_path: Path, file: str, content: str | None, needle: str
) -> None:
    target = _copy_model(model_dir, tmp_path)
    if content is None:
        (target / file).unlink()
    else:
        (target / file).write_text(content)
    with pytest.raises(ModelDirError, match=needle):
        TextModel.load(target)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="not a model directory"):
        TextModel.load(tmp_path / "absent")


def test_template_syntax_error_fails_the_load(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"tokenizer_config.json: chat template .* compile"):
        _with_template(model_dir, tmp_path, "{% for m in messages %}{{ m.content }")


def test_optional_configs_may_be_absent(model_dir: Path, tmp_path: Path) -> None:
    target = _copy_model(model_dir, tmp_path)
    (target / "generation_config.json").unlink()
    (target / "config.json").unlink()
    model = TextModel.load(target)
    assert model.eos_token_ids == (model.token_to_id("<|im_end|>"),)
    assert model.max_position_embeddings is None


def test_truncation_in_tokenizer_file_is_ignored(
    model_dir: Path, text_model: TextModel, tmp_path: Path
) -> None:
    target = _copy_model(model_dir, tmp_path)
    data = json.loads((target / "tokenizer.json").read_text())
    data["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    (target / "tokenizer.json").write_text(json.dumps(data))
    text = "one two three four five six seven"
    assert len(text_model.encode(text)) > 4
    assert TextModel.load(target).encode(text) == text_model.encode(text)


# --- chat templates -----------------------------------------------------------------


def test_render_chatml(text_model: TextModel) -> None:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    assert text_model.render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text_model.render_chat(messages, add_generation_prompt=False).endswith(
        "<|im_start|>user\nHi!<|im_end|>\n"
    )


def test_render_content_parts_and_tools(text_model: TextModel) -> None:
    tools: list[dict[str, object]] = [
        {"type": "function", "function": {"name": "get_weather", "description": "<city> é"}}
    ]
    rendered = text_model.render_chat(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        tools=tools,
    )
    # tojson as transformers does it: no HTML escaping, no ASCII escaping.
    assert '"description": "<city> é"' in rendered
    assert "<|im_start|>user\nab<|im_end|>\n" in rendered


def test_rendered_chat_encodes_special_tokens_once(text_model: TextModel) -> None:
    rendered = text_model.render_chat([{"role": "user", "content": "Hello"}])
    ids = text_model.encode(rendered)
    assert ids[0] == text_model.token_to_id("<|im_start|>")
    assert ids.count(text_model.eos_token_ids[0]) == 1
    assert text_model.decode(ids, skip_special_tokens=False) == rendered
    assert text_model.decode(ids) == "user\nHello\nassistant\n"


def test_template_globals_filters_and_variables(model_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "|{{ eos_token }}|{{ bos_token is defined }}|{{ enable_thinking }}"
        "|{{ strftime_now('%Y') | length }}|{{ {'k': '<&>'} | tojson }}"
        "|{{ add_generation_prompt }}"
    )
    model = _with_template(model_dir, tmp_path, template)
    rendered = model.render_chat(
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
        extra={"enable_thinking": False, "add_generation_prompt": "ignored"},
    )
    assert rendered == '[one]|<|im_end|>|False|False|4|{"k": "<&>"}|True'


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(value=_JSON, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 2, "\t"]),
       separators=st.sampled_from([None, (",", ":"), [", ", ": "]]), sort_keys=st.booleans())
def test_tojson_is_json_dumps(value: object, ensure_ascii: bool, indent: int | str | None,
                              separators: tuple[str, str] | None, sort_keys: bool) -> None:
    """The template filter's text is json.dumps' for every argument set, each encoder made
    once being used again (twice in a row, and across argument sets)."""
    want = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
    for _ in range(2):
        assert _tojson(value, ensure_ascii, indent, separators, sort_keys) == want


def test_named_templates_pick_tool_use_when_tools_given(model_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    model = _with_template(model_dir, tmp_path, templates)
    assert model.render_chat([]) == "plain"
    assert model.render_chat([], tools=[{"type": "function"}]) == "tools:1"


def test_chat_template_jinja_file_takes_precedence(model_dir: Path, tmp_path: Path) -> None:
    target = _copy_model(model_dir, tmp_path)
    (target / "chat_template.jinja").write_text("from the jinja file")
    assert TextModel.load(target).render_chat([]) == "from the jinja file"


def test_template_raise_exception_becomes_chat_template_error(
    model_dir: Path, tmp_path: Path
) -> None:
    alternating = (
        "{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
        "{% endif %}{{ message['role'] }}: {{ message['content'] }}\n"
        "{% endfor %}"
    )
    model = _with_template(model_dir, tmp_path, alternating)
    good: list[dict[str, object]] = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    assert model.render_chat(good) == "user: a\nassistant: b\n"
    with pytest.raises(ChatTemplateError, match=r"^Conversation roles must alternate"):
        model.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_demo_template_rejects_unknown_role(text_model: TextModel) -> None:
    with pytest.raises(ChatTemplateError, match="Unknown message role: robot"):
        text_model.render_chat([{"role": "robot", "content": "beep"}])


def test_template_runtime_errors_are_chat_template_errors(model_dir: Path, tmp_path: Path) -> None:
    model = _with_template(model_dir, tmp_path, "{{ messages[0]['content'] + '!' }}")
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        model.render_chat([{"role": "user", "content": None}])


def test_sandbox_forbids_mutating_messages(model_dir: Path, tmp_path: Path) -> None:
    model = _with_template(model_dir, tmp_path, "{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        model.render_chat([])


def test_missing_chat_template_fails_at_render_time(model_dir: Path, tmp_path: Path) -> None:
    model = _with_template(model_dir, tmp_path, None)
    assert not model.has_chat_template
    assert model.encode("still tokenizes")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        model.render_chat([{"role": "user", "content": "hi"}])


# --- encode -------------------------------------------------------------------------


def test_encode_is_thread_safe(text_model: TextModel) -> None:
    texts = [f"Prompt {i}: the quick brown fox, 日本語 and 🦜 " * (1 + i % 50) for i in range(64)]
    expected = [text_model.encode(t) for t in texts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(text_model.encode, texts)) == expected
    assert all(text_model.decode(ids) == t for ids, t in zip(expected, texts, strict=True))


def test_encode_special_tokens_flag(text_model: TextModel) -> None:
    # The demo tokenizer has no post-processor template, so the flag changes nothing;
    # the default must still be False, as for rendered chats.
    assert text_model.encode("hello") == text_model.encode("hello", add_special_tokens=True)


# --- incremental detokenizer ----------------------------------------------------------


def test_multibyte_char_split_over_tokens_is_emitted_once_complete(
    text_model: TextModel,
) -> None:
    char, char_ids = _split_char(text_model)
    ids = text_model.encode("a") + char_ids + text_model.encode("b")
    detok = text_model.new_detokenizer()
    pieces = [detok.push([i]) for i in ids]
    assert pieces[0] == "a"
    assert pieces[1 : len(char_ids)] == [""] * (len(char_ids) - 1)
    assert pieces[len(char_ids)] == char
    assert pieces[-1] == "b"
    assert detok.flush() == ""


def test_valid_text_never_yields_replacement_chars(text_model: TextModel) -> None:
    text = "Café 🦜 and 漢字, Dvořák ∑ 🧬🪐 — 한국어 ❤️ done."
    ids = text_model.encode(text)
    detok = text_model.new_detokenizer()
    pieces = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text


def test_flush_releases_truly_incomplete_bytes(text_model: TextModel) -> None:
    _, char_ids = _split_char(text_model)
    ids = text_model.encode("x") + char_ids[:-1]
    detok = text_model.new_detokenizer()
    assert detok.push(ids) == "x"
    tail = detok.flush()
    assert tail.startswith("\ufffd")
    assert "x" + tail == text_model.decode(ids)
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(text_model: TextModel) -> None:
    ids = text_model.encode("<|im_start|>hi<|im_end|>")
    assert text_model.new_detokenizer().push(ids) == "hi"
    keep = text_model.new_detokenizer(skip_special_tokens=False)
    assert keep.push(ids) + keep.flush() == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_concat_equals_decode_on_random_ids(
    text_model: TextModel, skip_special_tokens: bool
) -> None:
    rng = random.Random(20240517)
    byte_ids = [text_model.token_to_id(c) for c in pre_tokenizers.ByteLevel.alphabet()]
    single_bytes = [i for i in byte_ids if i is not None]
    specials = sorted(text_model.special_token_ids)
    _, split_ids = _split_char(text_model)
    for _ in range(1500):
        ids: list[int] = []
        for _ in range(rng.randrange(0, 40)):
            roll = rng.random()
            if roll < 0.4:
                ids.append(rng.choice(single_bytes))  # mostly invalid UTF-8 on its own
            elif roll < 0.5:
                ids.append(rng.choice(specials))
            elif roll < 0.6:
                ids.extend(split_ids[: rng.randrange(1, len(split_ids) + 1)])
            else:
                ids.append(rng.randrange(text_model.vocab_size))
        detok = text_model.new_detokenizer(skip_special_tokens=skip_special_tokens)
        expected = text_model.decode(ids, skip_special_tokens=skip_special_tokens)
        out = ""
        pos = 0
        while pos < len(ids):
            size = rng.choice((1, 1, 1, 2, 3, 7))
            out += detok.push(ids[pos : pos + size])
            pos += size
            assert expected.startswith(out), ids
        assert out + detok.flush() == expected, ids


def test_detokenizer_speed(text_model: TextModel) -> None:
    """Not a benchmark, a guard: per-token cost must stay in the microseconds."""
    ids = text_model.encode(Path(__file__).read_text(encoding="utf-8"))
    detok = text_model.new_detokenizer()
    start = time.perf_counter()
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    per_token = (time.perf_counter() - start) / len(ids)
    assert text == text_model.decode(ids)
    assert per_token < 50e-6


# --- demo model -----------------------------------------------------------------------


def test_demo_model_is_deterministic_small_and_fast(tmp_path: Path) -> None:
    start = time.perf_counter()
    first = build_model_dir(tmp_path / "a")
    assert time.perf_counter() - start < 2.0
    second = build_model_dir(tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert sum((first / n).stat().st_size for n in names) < 300_000
    config = json.loads((first / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096
    assert config["vocab_size"] == TextModel.load(first).vocab_size


def test_demo_model_vocab_size_parameter(tmp_path: Path) -> None:
    model = TextModel.load(build_model_dir(tmp_path, vocab_size=600))
    assert model.vocab_size == 603
    assert model.decode(model.encode("Grüße 🦜")) == "Grüße 🦜"


# -- a lower bound on the token count, without tokenizing ---------------------------------

PIECES = st.sampled_from([*"ab c\n.-", *RARE_CHARS, "<|im_start|>", "  ", "interactions"])


@settings(max_examples=200, deadline=None)
@given(st.lists(PIECES).map("".join))
def test_fewest_tokens_never_exceeds_the_real_count(text_model: TextModel, text: str) -> None:
    assert text_model.max_bytes_per_token is not None
    assert text_model.fewest_tokens(text) <= len(text_model.encode(text))


def _tokenizer_edited(model_dir: Path, dest: Path, edit: dict[str, object]) -> TextModel:
    target = _copy_model(model_dir, dest)
    spec_file = target / "tokenizer.json"
    spec = json.loads(spec_file.read_text())
    for key, value in edit.items():
        section, _, field = key.partition(".")
        if field:
            spec[section][field] = value
        else:
            spec[section] = value
    spec_file.write_text(json.dumps(spec))
    return TextModel.load(target)


@pytest.mark.parametrize(
    "edit",
    [
        {"pre_tokenizer": {"type": "WhitespaceSplit"}},  # drops whitespace
        {"normalizer": {"type": "NFKC"}},  # may shrink
        {"normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}},
        {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed",
                           "invert": False}},
        {"model.unk_token": "<|endoftext|>", "model.fuse_unk": True},  # one token, any run
    ],
)  # fmt: skip
def test_no_bound_when_a_token_can_stand_for_any_length(
    model_dir: Path, tmp_path: Path, edit: dict[str, object]
) -> None:
    text_model = _tokenizer_edited(model_dir, tmp_path, edit)
    assert text_model.max_bytes_per_token is None
    assert text_model.fewest_tokens("word " * 1000) == 0


def test_bound_kept_behind_steps_that_only_grow_the_text(model_dir: Path, tmp_path: Path) -> None:
    grow = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ]}  # fmt: skip
    text_model = _tokenizer_edited(model_dir, tmp_path, {"normalizer": grow})
    assert text_model.max_bytes_per_token is not None
    text = "word " * 1000
    assert 0 < text_model.fewest_tokens(text) <= len(text_model.encode(text))
