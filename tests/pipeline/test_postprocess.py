"""OutputProcessor: text, stop strings, max_tokens, finish reasons and usage, on the demo model."""

from __future__ import annotations

import pytest

from direct_frontend.engines.neutral import FinishReason
from direct_frontend.pipeline.postprocess import OutputProcessor, OutputStep
from direct_frontend.text.model_dir import TextModel

RARE_CHARS = "🦜🧬🪐😀漢鬱東∑"


def _processor(
    model: TextModel,
    stop: list[str] | None = None,
    max_tokens: int = 1000,
    stop_token_ids: tuple[int, ...] = (),
) -> OutputProcessor:
    return OutputProcessor(
        model.new_detokenizer(), stop or [], max_tokens, stop_token_ids=stop_token_ids
    )


def _eos(model: TextModel) -> int:
    eos = model.token_to_id("<|im_end|>")
    assert eos is not None
    return eos


def _completing_index(model: TextModel, ids: list[int], stop: str) -> int:
    """How many tokens it takes for the decoded text to contain ``stop``."""
    for k in range(1, len(ids) + 1):
        if stop in model.decode(ids[:k]):
            return k
    raise AssertionError(f"{stop!r} never appears")


def _split_char(model: TextModel) -> tuple[str, list[int]]:
    for char in RARE_CHARS:
        ids = model.encode(char)
        if len(ids) >= 3:
            return char, ids
    raise AssertionError("the demo tokenizer merged every rare character")


def test_plain_stream_ends_on_engine_eos(text_model: TextModel) -> None:
    eos = _eos(text_model)
    ids = [*text_model.encode("Hello world, how are you today?"), eos]
    proc = _processor(text_model)
    text = ""
    for pos in range(0, len(ids), 3):
        step = proc.on_tokens(ids[pos : pos + 3])
        assert not step.finished
        assert step.completion_tokens == min(pos + 3, len(ids))
        text += step.text
    final = proc.on_finish(FinishReason.STOP, matched_token_id=eos)
    assert text + final.text == "Hello world, how are you today?"
    assert final == OutputStep(final.text, True, len(ids), None, "stop", eos)
    assert proc.generated_ids == tuple(ids)


def test_stop_string_finishes_at_the_completing_token(text_model: TextModel) -> None:
    ids = text_model.encode("Hello world END and then some more")
    k = _completing_index(text_model, ids, "END")
    proc = _processor(text_model, stop=["END"])
    text = ""
    finished_at = None
    for n, token_id in enumerate(ids, start=1):
        step = proc.on_tokens([token_id])
        text += step.text
        if step.finished and finished_at is None:
            finished_at = n
            assert step.matched_stop == "END"
            assert step.finish_reason == "stop"
            assert step.stop_reason == "END"
        assert step.completion_tokens == min(n, k)
    assert finished_at == k
    assert text == "Hello world "
    assert proc.generated_ids == tuple(ids[:k])
    # The engine's late terminal event does not change the outcome.
    final = proc.on_finish(FinishReason.ABORT)
    assert final == OutputStep("", True, k, "END", "stop", "END")


def test_stop_string_inside_one_delta(text_model: TextModel) -> None:
    ids = text_model.encode("Hello world END and then some more")
    k = _completing_index(text_model, ids, "END")
    step = _processor(text_model, stop=["END"]).on_tokens(ids)
    assert step == OutputStep("Hello world ", True, k, "END", "stop", "END")


def test_stop_string_split_across_deltas(text_model: TextModel) -> None:
    en = text_model.encode(" EN")
    d = text_model.encode("D tail")
    proc = _processor(text_model, stop=["END"])
    first = proc.on_tokens(en)
    assert first.text == " "
    assert not first.finished
    second = proc.on_tokens(d)
    assert (second.text, second.finished, second.matched_stop) == ("", True, "END")
    assert second.completion_tokens == len(en) + 1


def test_stop_string_at_the_very_start(text_model: TextModel) -> None:
    ids = text_model.encode("Hello world")
    step = _processor(text_model, stop=["Hello"]).on_tokens(ids)
    assert step.text == ""
    assert step.finished
    assert step.completion_tokens == _completing_index(text_model, ids, "Hello")


def test_earliest_of_several_stops_wins(text_model: TextModel) -> None:
    ids = text_model.encode("one two three four")
    step = _processor(text_model, stop=["four", "two"]).on_tokens(ids)
    assert (step.text, step.matched_stop) == ("one ", "two")


def test_tokens_after_finish_are_ignored(text_model: TextModel) -> None:
    proc = _processor(text_model, stop=["world"])
    proc.on_tokens(text_model.encode("Hello world"))
    count = proc.completion_tokens
    step = proc.on_tokens(text_model.encode(" more tokens"))
    assert (step.text, step.finished, step.completion_tokens) == ("", True, count)
    assert len(proc.generated_ids) == count


def test_held_stop_prefix_released_on_finish(text_model: TextModel) -> None:
    proc = _processor(text_model, stop=["END!"])
    step = proc.on_tokens(text_model.encode("Hello END"))
    assert step.text == "Hello "
    final = proc.on_finish(FinishReason.STOP, matched_token_id=_eos(text_model))
    assert final.text == "END"
    assert final.finish_reason == "stop"
    assert final.matched_stop is None


def test_max_tokens_truncates_and_reports_length(text_model: TextModel) -> None:
    ids = text_model.encode("one two three four five six seven eight")
    proc = _processor(text_model, max_tokens=4)
    step = proc.on_tokens(ids)
    assert step == OutputStep(text_model.decode(ids[:4]), True, 4, None, "length", None)
    assert proc.remaining_tokens == 0
    assert proc.on_finish(FinishReason.LENGTH) == OutputStep("", True, 4, None, "length", None)


def test_max_tokens_reached_over_several_deltas_releases_held_text(
    text_model: TextModel,
) -> None:
    ids = text_model.encode("say EN")
    proc = _processor(text_model, stop=["END"], max_tokens=len(ids))
    first = proc.on_tokens(ids[:-1])
    assert not first.finished
    last = proc.on_tokens(ids[-1:])
    assert last.finished
    assert first.text + last.text == "say EN"
    assert last.finish_reason == "length"


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (FinishReason.LENGTH, "length"),
        (FinishReason.ABORT, "abort"),
        (FinishReason.ERROR, "error"),
    ],
)
def test_engine_finish_reasons(text_model: TextModel, reason: FinishReason, expected: str) -> None:
    proc = _processor(text_model)
    proc.on_tokens(text_model.encode("partial answer"))
    final = proc.on_finish(reason, matched_token_id=None)
    assert (final.finished, final.finish_reason, final.stop_reason) == (True, expected, None)


def test_engine_reported_stop_string_is_kept(text_model: TextModel) -> None:
    proc = _processor(text_model)
    proc.on_tokens(text_model.encode("abc"))
    final = proc.on_finish(FinishReason.STOP, matched_token_id=None, matched_stop_str="###")
    assert (final.finish_reason, final.stop_reason, final.matched_stop) == ("stop", "###", "###")


def test_stop_token_id_hides_its_text_and_stops(text_model: TextModel) -> None:
    ids = text_model.encode("Hello world again")
    world = text_model.encode(" world")
    assert len(world) == 1
    proc = _processor(text_model, stop_token_ids=(world[0],))
    step = proc.on_tokens(ids)
    assert step == OutputStep("Hello", True, ids.index(world[0]) + 1, None, "stop", world[0])


def test_eos_as_last_allowed_token_is_stop_not_length(text_model: TextModel) -> None:
    eos = _eos(text_model)
    ids = [*text_model.encode("Hi"), eos]
    proc = _processor(text_model, max_tokens=len(ids), stop_token_ids=(eos,))
    step = proc.on_tokens(ids)
    assert (step.text, step.finish_reason, step.stop_reason) == ("Hi", "stop", eos)


def test_multibyte_char_never_broken(text_model: TextModel) -> None:
    char, char_ids = _split_char(text_model)
    ids = [*text_model.encode("a "), *char_ids, *text_model.encode(" b")]
    proc = _processor(text_model, stop=["zzz"])
    steps = [proc.on_tokens([i]) for i in ids]
    assert all("\ufffd" not in s.text for s in steps)
    assert [s.text for s in steps if char in s.text] == [char]
    final = proc.on_finish(FinishReason.STOP)
    assert "".join(s.text for s in steps) + final.text == f"a {char} b"


def test_incomplete_char_at_the_end_flushes(text_model: TextModel) -> None:
    _, char_ids = _split_char(text_model)
    proc = _processor(text_model)
    assert proc.on_tokens([*text_model.encode("ok"), *char_ids[:-1]]).text == "ok"
    final = proc.on_finish(FinishReason.LENGTH)
    assert final.text.startswith("\ufffd")
    assert final.finish_reason == "length"


def test_stop_string_completed_by_the_final_flush(text_model: TextModel) -> None:
    _, char_ids = _split_char(text_model)
    proc = _processor(text_model, stop=["\ufffd"])
    assert proc.on_tokens([*text_model.encode("ok"), *char_ids[:1]]).text == "ok"
    final = proc.on_finish(FinishReason.LENGTH)
    assert (final.text, final.finish_reason, final.matched_stop) == ("", "stop", "\ufffd")


def test_resume_after_migration_matches_a_single_run(text_model: TextModel) -> None:
    ids = text_model.encode("The router resumes 漢字 🦜 streams elsewhere, then stops here. END")
    one_shot = _processor(text_model, stop=["END"], max_tokens=100)
    expected = one_shot.on_tokens(ids)

    migrated = _processor(text_model, stop=["END"], max_tokens=100)
    half = len(ids) // 2
    first = migrated.on_tokens(ids[:half])
    # What a new engine gets: prompt + generated ids, with the remaining budget.
    assert migrated.generated_ids == tuple(ids[:half])
    assert migrated.remaining_tokens == 100 - half
    rest = migrated.on_tokens(ids[half:])
    assert first.text + rest.text == expected.text
    assert rest.completion_tokens == expected.completion_tokens
    assert rest.finish_reason == expected.finish_reason == "stop"


def test_empty_delta_is_a_no_op(text_model: TextModel) -> None:
    proc = _processor(text_model)
    assert proc.on_tokens([]) == OutputStep("", False, 0)
    assert not proc.finished


def test_max_tokens_must_not_be_negative(text_model: TextModel) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        _processor(text_model, max_tokens=-1)


@pytest.mark.parametrize("track", [False, True])
def test_no_max_tokens_keeps_nothing_the_engine_sends(text_model: TextModel, track: bool) -> None:
    """An echo of the prompt alone: the one token the engine must generate is not output."""
    ids = text_model.encode("Once upon a time", add_special_tokens=False)
    proc = OutputProcessor(text_model.new_detokenizer(), ["x"] if track else [], 0,
                           track_tokens=track)
    step = proc.on_tokens(ids[:1])
    assert (step.text, step.finished, step.completion_tokens) == ("", True, 0)
    assert step.finish_reason == "length"
    after = proc.on_finish(FinishReason.LENGTH)  # the engine's own end: nothing more
    assert (after.text, after.completion_tokens, after.finish_reason) == ("", 0, "length")
    assert proc.generated_ids == () and proc.completion_tokens == 0
    if track:
        assert proc.tokens_out() == 0


# -- which tokens' text is out (logprobs go with it) ------------------------------------


def _tracked(model: TextModel, stop: list[str] | None = None) -> OutputProcessor:
    return OutputProcessor(model.new_detokenizer(), stop or [], 1000, track_tokens=True)


def test_tokens_count_as_out_once_their_whole_text_is(text_model: TextModel) -> None:
    char, ids = _split_char(text_model)
    proc = _tracked(text_model)
    head = list(text_model.encode(" sea"))
    proc.on_tokens(head)
    assert proc.tokens_out() == len(head)
    proc.on_tokens(ids[:-1])  # the character is not complete: its tokens wait
    assert proc.tokens_out() == len(head)
    step = proc.on_tokens(ids[-1:])
    assert step.text == char and proc.tokens_out() == len(head) + len(ids)
    assert proc.token_start(len(head)) == len(text_model.decode(head))  # where the char starts


def test_a_stop_string_keeps_the_tokens_it_cut_out(text_model: TextModel) -> None:
    ids = list(text_model.encode("the blue whale sings at night"))
    text = text_model.decode(ids)
    stop = "whale"
    proc = _tracked(text_model, [stop])
    out = "".join(proc.on_tokens([t]).text for t in ids)
    assert out == text[: text.index(stop)]
    out_tokens = proc.tokens_out()
    # every token that starts before the cut is out, none that starts after it
    starts = [len(text_model.decode(ids[:i])) for i in range(len(ids))]
    assert out_tokens == sum(1 for s in starts[: proc.completion_tokens] if s < len(out))


def test_held_text_counts_only_once_it_is_released(text_model: TextModel) -> None:
    ids = list(text_model.encode("a whale"))
    proc = _tracked(text_model, ["whales"])  # "whale" may still become the stop: held back
    steps = [proc.on_tokens([t]) for t in ids]
    held = len(text_model.decode(ids)) - sum(len(s.text) for s in steps)
    assert held > 0 and proc.tokens_out() < len(ids)
    final = proc.on_finish(FinishReason.LENGTH)
    assert final.text and proc.tokens_out() == len(ids)
