"""prepare(): repeated prompts come from the cache, identical to a fresh render and tokenize."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.parse import parse_chat_request, parse_completion_request
from direct_frontend.pipeline.preprocess import (
    PreparedRequest,
    Tokenizing,
    chat_prompt_ids,
    droppable_turns,
    prepare,
    prompt_ids,
    refuse_beyond_every_engine,
)
from direct_frontend.routing.catalog import Catalog
from direct_frontend.text.model_dir import TextModel


def _tokenizing(text_model: TextModel) -> Tokenizing:
    return Tokenizing(text_model, lambda: Catalog())


def _chat(content: str, **extra: object) -> bytes:
    return json.dumps({
        "model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": content}], **extra,
    }).encode()


async def _prepare_chat(tokenizing: Tokenizing, body: bytes) -> PreparedRequest:
    return await prepare("chat", parse_chat_request(body), "id", tokenizing)


async def test_a_repeated_chat_is_rendered_once_and_equals_a_fresh_render(
    text_model: TextModel,
) -> None:
    cached = _tokenizing(text_model)
    first = await _prepare_chat(cached, _chat("Hello there"))
    again = await _prepare_chat(cached, _chat("Hello there"))
    fresh = await _prepare_chat(_tokenizing(text_model), _chat("Hello there"))
    assert (cached.prompts.hits, cached.prompts.misses) == (1, 1)
    assert again.input_ids == first.input_ids == fresh.input_ids
    assert again.prompt_text == fresh.prompt_text
    assert again.input_ids == tuple(text_model.encode(fresh.prompt_text))


async def test_what_changes_the_prompt_changes_the_key(text_model: TextModel) -> None:
    tokenizing = _tokenizing(text_model)
    base = await _prepare_chat(tokenizing, _chat("Hello"))
    other = await _prepare_chat(tokenizing, _chat("Hello!"))
    kwargs = await _prepare_chat(tokenizing, _chat("Hello", chat_template_kwargs={"x": 1}))
    sampling = await _prepare_chat(tokenizing, _chat("Hello", temperature=0.5))
    assert other.input_ids != base.input_ids
    assert tokenizing.prompts.misses == 3 and tokenizing.prompts.hits == 1  # only sampling hit
    assert kwargs.input_ids == base.input_ids  # the demo template ignores x, but it was a miss
    assert sampling.input_ids == base.input_ids


async def test_completion_prompts_are_cached_by_their_text(text_model: TextModel) -> None:
    tokenizing = _tokenizing(text_model)
    body = json.dumps({"model": "m", "prompt": "Once upon a time"}).encode()
    first = await prepare("completion", parse_completion_request(body), "a", tokenizing)
    again = await prepare("completion", parse_completion_request(body), "b", tokenizing)
    assert again.input_ids == first.input_ids
    assert again.input_ids == tuple(text_model.encode("Once upon a time", add_special_tokens=True))
    assert tokenizing.prompts.hits == 1


async def test_embeddings_inputs_leave_the_prompt_cache_alone(text_model: TextModel) -> None:
    tokenizing = _tokenizing(text_model)
    text, ids = await prompt_ids("Once upon a time", "input", tokenizing, cached=False)
    assert (text, ids) == ("Once upon a time",
                           tuple(text_model.encode("Once upon a time", add_special_tokens=True)))
    cache = tokenizing.prompts
    assert (len(cache), cache.hits, cache.misses) == (0, 0, 0)
    await prompt_ids("Once upon a time", "prompt", tokenizing)  # a completion's: cached
    assert len(tokenizing.prompts) == 1


async def test_a_chat_tokenized_for_counting_without_the_generation_prompt(
    text_model: TextModel,
) -> None:
    tokenizing = _tokenizing(text_model)
    chat = parse_chat_request(_chat("Hello"))
    _, bare = await chat_prompt_ids(chat, tokenizing, add_generation_prompt=False)
    _, full = await chat_prompt_ids(chat, tokenizing)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    rendered = text_model.render_chat(messages, add_generation_prompt=False)  # type: ignore[arg-type]
    assert bare == tuple(text_model.encode(rendered)) and len(bare) < len(full)
    assert len(tokenizing.prompts) == 1  # only the generation prompt is kept


async def test_a_template_reading_the_clock_is_never_cached(
    model_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "chat_template.jinja").write_text(
        "{{ strftime_now('%H:%M:%S') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    model = TextModel.load(copy)
    assert model.templates_read_clock
    tokenizing = _tokenizing(model)
    await _prepare_chat(tokenizing, _chat("Hi"))
    await _prepare_chat(tokenizing, _chat("Hi"))
    assert len(tokenizing.prompts) == 0 and tokenizing.prompts.hits == 0


async def test_errors_and_long_prompts_leave_nothing_behind(text_model: TextModel) -> None:
    tokenizing = _tokenizing(text_model)
    empty = json.dumps({"model": "m", "prompt": ""}).encode()
    with pytest.raises(OpenAIHTTPError):
        await prepare("completion", parse_completion_request(empty), "a", tokenizing)
    long = json.dumps({"model": "m", "prompt": "x " * 20_000}).encode()
    prepared = await prepare("completion", parse_completion_request(long), "b", tokenizing)
    assert len(prepared.input_ids) > 1000
    assert len(tokenizing.prompts) == 0


async def test_an_assistant_turns_reasoning_reaches_the_template_from_every_api(
    model_dir: Path, tmp_path: Path
) -> None:
    """Chat's ``reasoning_content``/``reasoning``, a Responses reasoning item, a thinking block."""
    from direct_frontend.openai.messages_api import parse_messages_request
    from direct_frontend.openai.responses_api import parse_responses_request

    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
        "{% if m.reasoning_content %}[r:{{ m.reasoning_content }}|t:{{ m.thinking }}]"
        "{% endif %}{% for c in m.tool_calls or [] %}<{{ c.function.name }}>{% endfor %}"
        ";{% endfor %}"
    )
    tokenizing = _tokenizing(TextModel.load(copy))
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

    def chat(**reasoning: str) -> bytes:
        return json.dumps({"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call], **reasoning},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).encode()

    want = "user:hi;assistant:[r:hmm|t:hmm]<f>;tool:ok;"
    for body in (chat(reasoning_content="hmm"), chat(reasoning="hmm")):
        prompt, _ = await chat_prompt_ids(parse_chat_request(body), tokenizing)
        assert prompt == want
    responses = parse_responses_request(json.dumps({"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}).encode())
    assert (await chat_prompt_ids(responses.chat, tokenizing))[0] == want
    messages = parse_messages_request(json.dumps({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "tool_use", "id": "c1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": "ok"}]}]}).encode())
    assert (await chat_prompt_ids(messages, tokenizing))[0] == want
    plain, _ = await chat_prompt_ids(parse_chat_request(chat()), tokenizing)
    assert plain == "user:hi;assistant:<f>;tool:ok;"  # and the cache told them apart


def test_a_truncation_drops_whole_turns_and_keeps_the_question() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    request = parse_chat_request(json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "rules"},                       # 0: stays
        {"role": "user", "content": "one"},                           # 1
        {"role": "assistant", "content": None, "tool_calls": calls},  # 2: with its results
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},      # 3
        {"role": "tool", "tool_call_id": "c1", "content": "r2"},      # 4
        {"role": "assistant", "content": "done"},                     # 5
        {"role": "developer", "content": "more rules"},               # 6: stays
        {"role": "user", "content": "two"},                           # 7: the question
        {"role": "assistant", "content": "partial"},                  # 8: after it
    ]}).encode())
    assert droppable_turns(request.messages) == [(1, 2), (2, 5), (5, 6)]
    alone = parse_chat_request(b'{"model":"m","messages":[{"role":"user","content":"q"}]}')
    assert droppable_turns(alone.messages) == []


async def test_a_truncated_chat_keeps_the_images_it_keeps_in_place() -> None:
    """Dropping an old turn with an image drops the image: the payload is the shorter chat's."""
    from direct_frontend.multimodal.processors import load_processor
    from direct_frontend.pipeline.media import MediaProfile
    from direct_frontend.pipeline.preprocess import prepare, truncated_to_fit
    from direct_frontend.text.demo_vision import BUNDLED_DIR
    from tests.support.images import data_url, encoded, picture

    text_model = TextModel.load(BUNDLED_DIR)
    processor = load_processor(BUNDLED_DIR, text_model.token_to_id)
    tokenizing = Tokenizing(text_model, lambda: Catalog(0, ()),
                            media=MediaProfile(processor))

    def turn(seed: int, text: str) -> dict[str, object]:
        return {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(encoded(picture(
                224, 224, seed=seed)))}}, {"type": "text", "text": text}]}

    request = parse_chat_request(json.dumps({"model": "m", "messages": [
        turn(1, "an old picture"), {"role": "assistant", "content": "seen"},
        turn(2, "the new one?")]}).encode())
    prepared = await prepare("chat", request, "r", tokenizing)
    assert prepared.media is not None and prepared.media.count == 2
    shorter = await truncated_to_fit(prepared, tokenizing, len(prepared.input_ids) - 10, 0)
    media = shorter.media
    assert media is not None and media.count == 1
    assert media.hashes == prepared.media.hashes[1:]
    (offset, length), = media.placeholders
    assert set(shorter.input_ids[offset:offset + length]) == {processor.image_token_id}
    assert shorter.input_ids.count(processor.image_token_id) == length == 64


async def test_a_large_chat_is_prepared_in_a_worker_thread_a_small_one_inline(
    text_model: TextModel,
) -> None:
    """With the limiter's only slot held, a large chat waits for a thread; a small one is
    prepared on the loop meanwhile."""
    import trio.testing

    tokenizing = Tokenizing(text_model, lambda: Catalog(), trio.CapacityLimiter(1))
    content = "A sentence of words for the model to read. " * 7000  # ≈ 300,000 characters
    assert len(content) > tokenizing.inline_chars
    done: list[PreparedRequest] = []

    async def large() -> None:
        done.append(await _prepare_chat(tokenizing, _chat(content)))

    async with trio.open_nursery() as nursery, tokenizing.limiter:
        nursery.start_soon(large)
        await trio.testing.wait_all_tasks_blocked()
        assert not done  # waiting for the thread slot
        small = await _prepare_chat(tokenizing, _chat("Hello"))
        assert small.input_ids
    rendered = text_model.render_chat([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": content}])
    assert done[0].input_ids == tuple(text_model._tokenizer.encode(rendered).ids)


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_prompt_its_bytes_prove_too_long_is_refused_untokenized(
    text_model: TextModel, kind: str
) -> None:
    from tests.support.fleet import engine

    catalog = Catalog(1, (engine("a", context_length=131_072),))
    tokenizing = Tokenizing(text_model, lambda: catalog)
    words = "the router reads a request and renders the chat template " * 28_000  # 1.6 MB
    body = _chat(words) if kind == "chat" else json.dumps(
        {"model": "m", "prompt": words}).encode()
    request = parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
    with pytest.raises(OpenAIHTTPError) as refused:
        await prepare(kind, request, "id", tokenizing)  # type: ignore[arg-type]
    assert refused.value.code == "context_length_exceeded"
    assert "at least" in refused.value.message  # the bound's figure: nothing was tokenized


def test_a_prompt_no_engine_can_hold_is_refused_before_admission() -> None:
    """At the largest context of the fleet or beyond: every engine's budget would refuse it."""
    from tests.support.fleet import engine

    catalog = Catalog(1, (engine("a", context_length=4096), engine("b", context_length=8192)))
    refuse_beyond_every_engine((100, 8191), catalog, "chat")  # engine b holds it
    with pytest.raises(OpenAIHTTPError) as refused:
        refuse_beyond_every_engine((100, 8192), catalog, "completion")
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "prompt")
    assert "maximum context length is 8192 tokens, but the prompt has 8192" in (
        refused.value.message)
    unknown = Catalog(1, (engine("a", context_length=4096), engine("c", context_length=None)))
    refuse_beyond_every_engine((100_000,), unknown, "chat")  # c's limit is unknown: c decides


async def test_a_chat_no_engine_can_hold_is_kept_for_its_prefix(
    text_model: TextModel,
) -> None:
    """A Responses chat with truncation "auto" is cut to fit, not refused: its next turn
    shares the whole prefix, so it is kept however long it is."""
    from tests.support.fleet import engine

    words = "the router reads a request and renders the chat template " * 400
    for limit in (131_072, 1024):
        catalog = Catalog(1, (engine("a", context_length=limit),))
        tokenizing = Tokenizing(text_model, lambda c=catalog: c, prefix_min_chars=0)
        prepared = await _prepare_chat(tokenizing, _chat(words))
        assert len(prepared.input_ids) > 1024
        assert len(tokenizing.prefixes) == 1
