"""A request's output with data only: batches parsed once, logprobs with their text, the
finish, usage, and the echoed prompt."""

from __future__ import annotations

from direct_frontend.engines.neutral import (
    Finished,
    FinishReason,
    TokenDelta,
    TokenLogprob,
)
from direct_frontend.openai.parsers.registry import ChoiceParser
from direct_frontend.openai.types import ChatRequest, CompletionRequest
from direct_frontend.pipeline.output_track import OutputTrack, prompt_offsets
from direct_frontend.pipeline.postprocess import OutputProcessor
from direct_frontend.pipeline.relay_events import Usage
from direct_frontend.text.model_dir import TextModel
from tests.support.fleet import engine

PROMPT = (11, 12, 13, 14)


def track(
    text_model: TextModel, request: ChatRequest | CompletionRequest | None = None, *,
    parser: ChoiceParser | None = None, stop: tuple[str, ...] = (), max_tokens: int = 16,
) -> OutputTrack:
    request = request or CompletionRequest(model="demo", prompt=PROMPT, max_tokens=max_tokens)
    asked = request.logprobs is not None
    processor = OutputProcessor(text_model.new_detokenizer(), stop, max_tokens,
                                stop_token_ids=request.stop_token_ids, track_tokens=asked)
    return OutputTrack(request, PROMPT, processor, parser, logprobs=asked)


def word_ids(text_model: TextModel, text: str) -> tuple[int, ...]:
    return tuple(text_model.encode(text, add_special_tokens=False))


def feed(output: OutputTrack, ids: tuple[int, ...]) -> str:
    pieces: list[str] = []
    output.feed(list(ids), pieces)
    return "".join(pieces)


def test_a_batch_without_a_parser_is_its_text_with_the_usage_so_far(
    text_model: TextModel,
) -> None:
    output = track(text_model)
    ids = word_ids(text_model, "hello there")
    output.note(TokenDelta(ids, cached_tokens=3), continued=False)
    batch = output.batch(feed(output, ids), len(ids))
    assert (batch.text, batch.tokens, batch.parsed) == ("hello there", len(ids), None)
    assert (batch.prompt_tokens, batch.completion_tokens, batch.cached_tokens) == (
        len(PROMPT), len(ids), 3) and output.usage() == Usage(len(PROMPT), len(ids), 3)
    assert batch.logprobs == () and batch.offsets == ()


def test_a_continuations_cache_hits_are_not_the_clients(text_model: TextModel) -> None:
    output = track(text_model)
    output.note(TokenDelta((1,), cached_tokens=3), continued=False)
    output.note(TokenDelta((2,), cached_tokens=9), continued=True)
    assert output.cached_tokens == 3
    output.note(TokenDelta((3,), cached_tokens=4), continued=False)  # a retry: the same prompt
    assert output.cached_tokens == 4


def test_the_parser_reads_each_batch_once_and_a_stop_after_calls_is_tool_calls(
    text_model: TextModel,
) -> None:
    request = ChatRequest(model="demo", messages=[{"role": "user", "content": "hi"}])
    output = track(text_model, request, parser=ChoiceParser(tool_parser="hermes"), max_tokens=64)
    first = '<tool_call>{"name": "f", '
    rest = '"arguments": {"x": 1}}</tool_call>'
    head = output.batch(feed(output, word_ids(text_model, first)), 0)
    assert head.parsed is not None and not head.parsed.content
    feed(output, word_ids(text_model, rest))
    pieces: list[str] = []
    output.finish(Finished(FinishReason.STOP, 4, 20), pieces)
    last = output.batch(rest + "".join(pieces), 0)
    assert last.parsed is not None and last.parsed.tool_calls
    end = output.finished(last)
    assert end.finish_reason == "tool_calls" and end.last is last
    assert end.usage == output.usage()


def test_a_length_stop_stays_length_and_says_no_engine_abort_is_needed(
    text_model: TextModel,
) -> None:
    ids = word_ids(text_model, "hello there")
    output = track(text_model, max_tokens=len(ids))
    assert output.batch(feed(output, ids), len(ids)).text == "hello there"
    end = output.finished(output.batch("", 0))
    assert (end.finish_reason, end.stop_reason, end.matched_stop) == ("length", None, None)
    assert output.ends_by_itself(engine("a"))


def test_a_stop_string_is_told_and_the_engine_must_be_aborted(text_model: TextModel) -> None:
    output = track(text_model, stop=("there",))
    text = feed(output, word_ids(text_model, "hello there world"))
    end = output.finished(output.batch(text, 3))
    assert end.last.text == "hello " and end.finish_reason == "stop"
    assert end.stop_reason == end.matched_stop == "there"
    assert not output.ends_by_itself(engine("a"))  # the engine would go on
    eos = 7
    on_eos = track(text_model)
    on_eos.finish(Finished(FinishReason.STOP, 4, 1, matched_token_id=eos), [])
    assert on_eos.ends_by_itself(engine("a", eos_token_ids=(eos,)))
    assert not track(text_model).ends_by_itself(engine("a"))  # not finished


def logprobs_of(ids: tuple[int, ...], first: int) -> tuple[TokenLogprob, ...]:
    """Distinct logprobs per position (``first`` is the position of ``ids[0]``)."""
    return tuple(TokenLogprob(t, -(first + i + 1) / 8) for i, t in enumerate(ids))


def test_logprobs_go_out_with_their_text_and_where_it_starts(text_model: TextModel) -> None:
    request = CompletionRequest(model="demo", prompt=PROMPT, max_tokens=16, logprobs=1)
    output = track(text_model, request)
    ids = word_ids(text_model, "hello there world")
    head, tail = ids[:2], ids[2:]
    output.note(TokenDelta(head, logprobs=logprobs_of(head, 0)), continued=False)
    first = output.batch(feed(output, head), len(head))
    output.note(TokenDelta(tail, logprobs=logprobs_of(tail, 2)), continued=False)
    second = output.batch(feed(output, tail), len(tail))
    sent = [*first.logprobs, *second.logprobs]
    assert [lp.token_id for lp in sent] == list(ids)  # each once, in order
    starts = [len(text_model.decode(ids[:i])) for i in range(len(ids))]
    assert [*first.offsets, *second.offsets] == starts


def test_logprobs_past_a_stop_string_are_not_sent(text_model: TextModel) -> None:
    request = CompletionRequest(model="demo", prompt=PROMPT, max_tokens=16, logprobs=0)
    output = track(text_model, request, stop=(" world",))
    ids = word_ids(text_model, "hello there world at sea")
    output.note(TokenDelta(ids, logprobs=logprobs_of(ids, 0)), continued=False)
    batch = output.batch(feed(output, ids), len(ids))
    assert output.final is not None and batch.text == "hello there"
    starts = [len(text_model.decode(ids[:i])) for i in range(len(ids))]
    assert len(batch.logprobs) == sum(1 for start in starts if start < len(batch.text))
    assert [lp.token_id for lp in batch.logprobs] == list(ids[: len(batch.logprobs)])
    assert len(batch.logprobs) < len(ids)


def test_the_head_says_the_prompt_and_an_echo_leads_with_it(text_model: TextModel) -> None:
    prompt_text = "hello there"
    ids = word_ids(text_model, prompt_text)
    plain = track(text_model)
    plain.note(TokenDelta((1,), cached_tokens=2), continued=False)
    opened = plain.opened("a", text_model)
    assert opened.usage == Usage(len(PROMPT), 0, 2) and opened.engine == "a"
    assert opened.echo is None
    request = CompletionRequest(model="demo", prompt=list(ids), max_tokens=4, echo=True,
                                logprobs=1)
    processor = OutputProcessor(text_model.new_detokenizer(), (), 4, track_tokens=True)
    echoing = OutputTrack(request, ids, processor, logprobs=True)
    prompt_logprobs = (None, *logprobs_of(ids[1:], 1))
    echoing.note(TokenDelta((1,), prompt_logprobs=prompt_logprobs), continued=False)
    echo = echoing.opened("a", text_model).echo
    assert echo is not None and echo.text == prompt_text and echo.token_ids == ids
    assert echo.logprobs == prompt_logprobs
    assert echo.offsets == prompt_offsets(text_model.new_detokenizer().push, ids)
    assert echo.offsets[0] == 0 and list(echo.offsets) == sorted(echo.offsets)
