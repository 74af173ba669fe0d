"""Request validation and OpenAI error bodies (direct_frontend.openai)."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from direct_frontend.engines.neutral import SamplingOptions
from direct_frontend.errors import EngineError, ErrorKind
from direct_frontend.openai.body import MAX_JSON_DEPTH, few_brackets, nested_deeper_than
from direct_frontend.openai.errors import (
    OpenAIHTTPError,
    context_length_exceeded,
    engine_failed,
    engine_timeout,
    error_body,
    from_engine_error,
    internal_error,
    method_not_allowed,
    model_not_found,
    no_engine_available,
    rate_limited,
    request_too_large,
    unknown_route,
)
from direct_frontend.openai.parse import (
    FLOAT32_MAX,
    MAX_STOP_CHARS,
    UINT32_MAX,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
)
from direct_frontend.openai.types import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ToolCall,
    ToolCallFunction,
)

USER = {"role": "user", "content": "hi"}


WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}


def chat(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": [USER]}
    body.update(fields)
    return json.dumps(body).encode()


def completion(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "prompt": "Once upon"}
    body.update(fields)
    return json.dumps(body).encode()


def chat_error(body: bytes) -> OpenAIHTTPError:
    with pytest.raises(OpenAIHTTPError) as info:
        parse_chat_request(body)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.code is None
    return err


def completion_error(body: bytes) -> OpenAIHTTPError:
    with pytest.raises(OpenAIHTTPError) as info:
        parse_completion_request(body)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- valid chat requests


def test_minimal_chat_request_has_defaults() -> None:
    req = parse_chat_request(chat())
    assert req == ChatRequest(
        model="m", messages=(ChatMessage(role="user", content="hi"),), max_tokens=None
    )
    assert req.stream is False
    assert req.include_usage is False
    assert req.skip_special_tokens is True
    assert req.ignore_eos is False
    assert req.stop == ()
    assert req.stop_token_ids == ()
    assert req.temperature is None
    assert req.tools == ()
    assert req.tool_choice == "auto"


def test_full_chat_request_parses_every_field() -> None:
    req = parse_chat_request(
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "hi", "name": "bob"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
            max_tokens=7,
            temperature=0,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            frequency_penalty=-2,
            presence_penalty=2,
            repetition_penalty=1.1,
            seed=-5,
            stop=["\n\n", "END"],
            stop_token_ids=[2, 3],
            ignore_eos=True,
            n=1,
            stream=True,
            stream_options={"include_usage": True},
            user="u1",
            logprobs=False,
            response_format={"type": "text"},
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
            tool_choice="auto",
            skip_special_tokens=False,
            min_tokens=2,
            chat_template_kwargs={"enable_thinking": False},
            some_future_openai_field={"x": 1},
        )
    )
    assert [m.role for m in req.messages] == ["developer", "system", "user", "assistant", "tool"]
    assert req.messages[1].content == "a\nb"
    assert req.messages[1].content_parts == ("a", "b")
    assert req.messages[2].name == "bob"
    assert req.messages[3].content is None
    assert req.messages[3].tool_calls == (
        ToolCall(id="c1", function=ToolCallFunction(name="f", arguments="{}")),
    )
    assert req.messages[4].tool_call_id == "c1"
    assert req.max_tokens == 7
    assert req.temperature == 0.0
    assert isinstance(req.temperature, float)
    assert (req.top_p, req.top_k, req.min_p) == (0.9, 40, 0.05)
    assert (req.frequency_penalty, req.presence_penalty, req.repetition_penalty) == (-2, 2, 1.1)
    assert req.seed == -5
    assert req.stop == ("\n\n", "END")
    assert req.stop_token_ids == (2, 3)
    assert req.ignore_eos is True
    assert req.stream is True
    assert req.include_usage is True
    assert req.user == "u1"
    assert req.tools[0].function.name == "f"
    assert req.tool_choice == "auto"
    assert req.skip_special_tokens is False
    assert req.min_tokens == 2
    assert req.chat_template_kwargs == {"enable_thinking": False}


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_chat_request(chat(max_tokens=5, max_completion_tokens=9)).max_tokens == 9
    assert parse_chat_request(chat(max_completion_tokens=3)).max_tokens == 3


def test_nulls_mean_unset() -> None:
    """Some clients send every optional field as null."""
    req = parse_chat_request(
        chat(
            temperature=None, top_p=None, max_tokens=None, stop=None, n=None, stream=None,
            stream_options=None, logprobs=None, tools=None, tool_choice=None, seed=None,
            response_format=None, user=None, skip_special_tokens=None,
        )
    )  # fmt: skip
    assert req.temperature is None
    assert req.stop == ()
    assert req.stream is False
    assert req.skip_special_tokens is True


def test_single_stop_string_and_assistant_without_content() -> None:
    req = parse_chat_request(chat(stop="###", messages=[USER, {"role": "assistant"}]))
    assert req.stop == ("###",)
    assert req.messages[1].content == ""


def test_stream_options_without_include_usage() -> None:
    assert parse_chat_request(chat(stream=True, stream_options={})).include_usage is False


def test_sampling_options_apply_openai_defaults() -> None:
    req = parse_chat_request(chat())
    assert req.sampling_options(max_tokens=100) == SamplingOptions(max_tokens=100)
    req = parse_chat_request(
        chat(temperature=0.5, top_k=-1, seed=3, stop_token_ids=[7], ignore_eos=True, min_tokens=4)
    )
    opts = req.sampling_options(max_tokens=10)
    assert opts.temperature == 0.5
    assert opts.top_k == 0  # vLLM-style -1 means disabled, as does the neutral 0
    assert opts.seed == 3
    assert opts.stop_token_ids == (7,)
    assert opts.ignore_eos is True
    assert opts.min_tokens == 4
    assert parse_chat_request(chat(top_k=20)).sampling_options(1).top_k == 20


# ---------------------------------------------------------------- chat validation errors


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"{", "not valid JSON"),
        (b'{"model": "m", }', "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b'"hello"', "must be a JSON object"),
    ],
)
def test_malformed_body(body: bytes, fragment: str) -> None:
    err = chat_error(body)
    assert fragment in err.message
    assert err.param is None


def test_a_detail_starting_with_an_acronym_keeps_its_capitals() -> None:
    message = chat_error(b"x").message
    assert "not valid JSON: JSON is malformed" in message and "jSON" not in message
    assert "must be a JSON object: expected `object`" in chat_error(b"[]").message


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model", "Missing required"),
        (b'{"model": "m"}', "messages", "Missing required"),
        (chat(messages=[{"content": "x"}]), "messages[0].role", "Missing required"),
        (chat(messages=[{"role": "user"}]), "messages[0].content", "required for role 'user'"),
        (chat(messages=[{"role": "system", "content": None}]), "messages[0].content", "Missing"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            "messages[0].content[0].text",
            "Missing required",
        ),
        (
            chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
            "messages[0].content[0].type",
            "Missing required",
        ),
        (b'{"model": "m", "prompt": "x"}', "messages", "Missing required"),
    ],
)
def test_missing_required(body: bytes, param: str, fragment: str) -> None:
    err = chat_error(body)
    assert err.param == param
    assert fragment in err.message
    assert param in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": 5}, "model"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [5]}, "messages[0]"),
        ({"messages": [USER, {"role": "user", "content": 5}]}, "messages[1].content"),
        ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x", "name": 1}]}, "messages[0].name"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "true"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 5]}, "stop[1]"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids[0]"),
        (
            {"stream_options": {"include_usage": "yes"}, "stream": True},
            "stream_options.include_usage",
        ),
        ({"seed": 1.5}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 1}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ],
)
def test_wrong_type_names_the_field_path(fields: dict[str, Any], param: str) -> None:
    err = chat_error(chat(**fields))
    assert err.param == param
    assert f"'{param}'" in err.message


def test_wrong_type_message_says_type() -> None:
    err = chat_error(chat(messages=[{"role": "user", "content": 5}]))
    assert err.message.startswith("Invalid type for 'messages[0].content'")
    assert "got `int`" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_out_of_range(fields: dict[str, Any], param: str) -> None:
    err = chat_error(chat(**fields))
    assert err.param == param
    assert err.message.startswith(f"Invalid value for '{param}'")


def test_bad_role_lists_the_roles() -> None:
    err = chat_error(chat(messages=[{"role": "wizard", "content": "x"}]))
    assert "'wizard'" in err.message
    assert "developer" in err.message


def test_sixteen_stop_strings_are_fine() -> None:
    assert len(parse_chat_request(chat(stop=[str(i) for i in range(16)])).stop) == 16


@pytest.mark.parametrize(
    "stop",
    [
        "x" * (MAX_STOP_CHARS + 1),
        ["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)],
        ["🦜" * 100_000],
    ],
)
def test_stop_strings_longer_than_the_bound_in_total_are_refused(stop: str | list[str]) -> None:
    for err in (chat_error(chat(stop=stop)), completion_error(completion(stop=stop))):
        assert err.param == "stop"
        assert err.message.startswith("Invalid value for 'stop'")
        assert f"at most {MAX_STOP_CHARS} characters in total" in err.message


def test_stop_strings_up_to_the_bound_are_fine() -> None:
    # Characters, not bytes: 8,192 four-byte characters are within the bound.
    stop = ["🦜" * (MAX_STOP_CHARS - 10), "0123456789"]
    assert parse_chat_request(chat(stop=stop)).stop == tuple(stop)
    assert parse_completion_request(completion(stop=stop[0])).stop == (stop[0],)


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"top_logprobs": 3}, "top_logprobs", "requires 'logprobs'"),
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", "requires 'logprobs'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "Missing required parameter",
        ),
        ({"tool_choice": "required"}, "tool_choice", "no 'tools' are given"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
         "no 'tools' are given"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [WEATHER]},
         "tool_choice", "no tool named 'f'"),
        ({"tool_choice": "required", "tools": [WEATHER], "guided_regex": "[a-z]+"},
         "tool_choice", "cannot be combined with 'guided_regex'"),
        ({"tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
        ({"stop": ["ok", ""]}, "stop[1]", "must not be empty"),
        ({"stop": ""}, "stop", "must not be empty"),
        ({"max_tokens": 3, "min_tokens": 5}, "min_tokens", "must not exceed"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
            "'input_audio' is not supported",
        ),
    ],
)
def test_unsupported_or_inconsistent(fields: dict[str, Any], param: str, fragment: str) -> None:
    err = chat_error(chat(**fields))
    assert err.param == param
    assert fragment in err.message


# ---------------------------------------------------------------- completions


def test_n_choices_parse_on_both_endpoints() -> None:
    assert parse_chat_request(chat()).n == 1
    assert parse_chat_request(chat(n=3)).n == 3
    assert parse_completion_request(completion(n=128)).n == 128
    assert parse_completion_request(completion(n=4, best_of=4)).n == 4


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Once upon", "Once upon"),
        ("", ""),
        (["Once upon"], "Once upon"),
        ([1, 2, 3], (1, 2, 3)),
        ([[4, 5]], (4, 5)),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: str | tuple[int, ...]) -> None:
    req = parse_completion_request(completion(prompt=prompt))
    assert req.prompt == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (["Once", "upon"], ("Once", "upon")),
        ([[4, 5], [6]], ((4, 5), (6,))),
        (["a"] * 2048, ("a",) * 2048),
    ],
)
def test_a_batch_of_prompts_is_one_request_per_prompt(
    prompt: Any, expected: tuple[str | tuple[int, ...], ...]
) -> None:
    req = parse_completion_request(completion(prompt=prompt, n=1, seed=3, echo=True))
    assert (req.prompt, *req.more_prompts) == expected
    each = req.each_prompt()
    assert tuple(r.prompt for r in each) == expected
    assert all(r.more_prompts == () and r.seed == 3 and r.echo for r in each)


def test_an_echo_may_ask_for_no_tokens() -> None:
    """The prompt alone, scored: OpenAI's legacy max_tokens 0 with echo."""
    req = parse_completion_request(completion(max_tokens=0, echo=True, logprobs=1))
    assert (req.max_tokens, req.echo, req.prompt_logprobs) == (0, True, 1)
    assert chat_error(chat(max_tokens=0)).param == "max_tokens"  # chat has no echo


def test_one_prompt_is_its_own_batch() -> None:
    req = parse_completion_request(completion(prompt=["Once upon"]))
    assert req.more_prompts == () and req.each_prompt() == (req,)


def test_completion_defaults_and_fields() -> None:
    req = parse_completion_request(completion())
    assert req == CompletionRequest(model="m", prompt="Once upon")
    req = parse_completion_request(
        completion(max_tokens=16, stream=True, stream_options={"include_usage": True}, echo=False,
                   logprobs=None, suffix=None, best_of=1, stop="\n", top_k=-1)
    )  # fmt: skip
    assert (req.max_tokens, req.stream, req.include_usage, req.stop, req.top_k) == (
        16, True, True, ("\n",), -1,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens", "0 is allowed only with 'echo'"),
        ({"max_tokens": -1}, "max_tokens", "expected `int` >= 0"),
        ({"prompt": ["a", 1]}, "prompt[1]", "all strings or all lists of token ids"),
        ({"prompt": [[1], "a"]}, "prompt[1]", "expected a list of token ids"),
        ({"prompt": ["a", ""]}, "prompt[1]", "must not be empty"),
        ({"prompt": [[1], []]}, "prompt[1]", "must not be empty"),
        ({"prompt": [[1], [2, -1]]}, "prompt[1][1]", "Invalid type"),
        ({"prompt": [[1], [2**32]]}, "prompt[1][0]", "a token id is an integer"),
        ({"prompt": ["a"] * 1025, "n": 2}, "prompt", "2050 engine calls; at most 2048"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [[]]}, "prompt[0]", "must not be empty"),
        ({"prompt": [1, -2]}, "prompt[1]", "Invalid type"),
        ({"prompt": [1, "a"]}, "prompt[1]", "Invalid type"),
        ({"prompt": [1.5]}, "prompt[0]", "Invalid type"),
        ({"prompt": [True]}, "prompt[0]", "Invalid type"),
        ({"prompt": [[1, None]]}, "prompt[0][1]", "Invalid type"),
        ({"prompt": 5}, "prompt", "Invalid type"),
        ({"prompt": None}, "prompt", "Invalid type"),
        ({"logprobs": True}, "logprobs", "expected an integer from 0 to 5"),
        ({"suffix": "end"}, "suffix", "not supported yet"),
        ({"best_of": 2}, "best_of", "not supported"),
        ({"n": 3, "best_of": 2}, "best_of", "must not be less than n (3)"),
        ({"n": 2, "best_of": 3}, "best_of", "only best_of equal to n (2)"),
        ({"temperature": 9}, "temperature", "Invalid value"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ],
)
def test_completion_errors(fields: dict[str, Any], param: str, fragment: str) -> None:
    err = completion_error(completion(**fields))
    assert err.param == param
    assert fragment in err.message


def test_completion_missing_prompt() -> None:
    err = completion_error(b'{"model": "m"}')
    assert err.param == "prompt"
    assert "Missing required" in err.message


# ---------------------------------------------------------------- error bodies and helpers


def test_error_body_is_the_openai_shape() -> None:
    err = chat_error(chat(temperature=3))
    body = json.loads(error_body(err))
    assert body == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


@pytest.mark.parametrize(
    ("err", "status", "type_", "code"),
    [
        (model_not_found("gpt-x"), 404, "invalid_request_error", "model_not_found"),
        (request_too_large(1024), 413, "invalid_request_error", "request_too_large"),
        (rate_limited(), 429, "rate_limit_exceeded", "rate_limit_exceeded"),
        (no_engine_available("m"), 503, "server_error", "no_engine_available"),
        (internal_error(), 500, "server_error", "internal_error"),
        (engine_failed("boom"), 502, "server_error", "engine_error"),
        (engine_timeout(), 504, "server_error", "engine_timeout"),
        (method_not_allowed("GET", "/v1/completions", ("POST",)), 405, "invalid_request_error",
         "method_not_allowed"),
        (unknown_route("GET", "/v2/x"), 404, "invalid_request_error", "unknown_url"),
        (context_length_exceeded(9000, 8192, "messages"), 400, "invalid_request_error",
         "context_length_exceeded"),
    ],
)  # fmt: skip
def test_helper_constructors(err: OpenAIHTTPError, status: int, type_: str, code: str) -> None:
    assert (err.status, err.type, err.code) == (status, type_, code)
    body = json.loads(error_body(err))["error"]
    assert body["message"] == err.message
    assert body["code"] == code


def test_helper_details() -> None:
    err = model_not_found("gpt-x")
    assert err.param == "model"
    assert "'gpt-x'" in err.message
    assert "1024" in request_too_large(1024).message
    assert method_not_allowed("GET", "/v1/completions", ("POST",)).headers == ((b"allow", b"POST"),)
    assert unknown_route("GET", "/v2/x").message == "Invalid URL (GET /v2/x)"
    assert rate_limited(retry_after=3).headers == ((b"retry-after", b"3"),)
    assert rate_limited().headers == ()
    assert no_engine_available("m").headers == ((b"retry-after", b"1"),)
    assert str(engine_failed("boom")) == "boom"


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        (ErrorKind.BAD_REQUEST, 400),
        (ErrorKind.UNAVAILABLE, 502),
        (ErrorKind.PROTOCOL, 502),
        (ErrorKind.TIMEOUT, 504),
        (ErrorKind.OVERLOADED, 503),
        (ErrorKind.INTERNAL, 500),
        (ErrorKind.CANCELLED, 503),
    ],
)
def test_from_engine_error(kind: ErrorKind, status: int) -> None:
    err = from_engine_error(EngineError(kind, "details here", engine="e1"))
    assert err.status == status
    assert "details here" in err.message


# ---------------------------------------------------------------- numeric ranges


@pytest.mark.parametrize(
    ("field", "highest"),
    [
        ("max_tokens", UINT32_MAX),
        ("max_completion_tokens", UINT32_MAX),
        ("min_tokens", UINT32_MAX),
        ("top_k", UINT32_MAX),
        ("seed", 2**63 - 1),
        ("temperature", 2.0),
        ("top_p", 1.0),
        ("min_p", 1.0),
        ("frequency_penalty", 2.0),
        ("presence_penalty", 2.0),
        ("repetition_penalty", FLOAT32_MAX),
    ],
)
def test_each_numeric_field_takes_its_highest_value_and_nothing_beyond(
    field: str, highest: float
) -> None:
    parse_chat_request(chat(**{field: highest}))
    beyond = highest + 1 if isinstance(highest, int) else highest * 1.0001
    err = chat_error(chat(**{field: beyond}))
    assert err.param == field
    assert "Invalid value" in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop_token_ids": [1, UINT32_MAX + 1]}, "stop_token_ids[1]"),
        ({"n": 129}, "n"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_chat_values_outside_their_range_are_refused(fields: dict[str, Any], param: str) -> None:
    assert chat_error(chat(**fields)).param == param


def test_a_number_beyond_a_double_is_refused() -> None:
    body = chat().replace(b'"model"', b'"temperature": 1e999, "model"')
    err = chat_error(body)
    assert err.param == "temperature"


def test_nan_and_infinity_literals_are_not_json() -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        err = chat_error(chat().replace(b'"model"', b'"top_p": ' + literal + b', "model"'))
        assert "not valid JSON" in err.message


def test_completion_token_ids_and_counts_are_bounded() -> None:
    assert parse_completion_request(completion(prompt=[0, UINT32_MAX])).prompt == (0, UINT32_MAX)
    err = completion_error(completion(prompt=[[1, UINT32_MAX + 1]]))
    assert err.param == "prompt[0][1]"
    assert "Invalid value" in err.message
    assert completion_error(completion(best_of=21)).param == "best_of"
    assert completion_error(completion(logprobs=6)).param == "logprobs"


# ---------------------------------------------------------------- nesting depth


def nest(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"k":' * depth + inner + b"}" * depth


def test_a_body_nested_beyond_the_limit_is_refused() -> None:
    inside = nest(MAX_JSON_DEPTH - 1)  # the body's own object makes the limit exactly
    parse_chat_request(chat().replace(b'"model"', b'"x": ' + inside + b', "model"'))
    for depth in (MAX_JSON_DEPTH, 1000, 100_000):  # 1000 once overflowed the decoder's stack
        body = chat().replace(b'"model"', b'"x": ' + nest(depth) + b', "model"')
        err = chat_error(body)
        assert err.param is None
        assert f"more than {MAX_JSON_DEPTH} levels" in err.message


@settings(max_examples=200, deadline=None)
@given(brackets=st.integers(0, 3 * MAX_JSON_DEPTH), size=st.sampled_from([0, 3000, 5000, 70_000]),
       seed=st.integers(0, 2**32))
@example(brackets=MAX_JSON_DEPTH, size=5000, seed=0)
@example(brackets=MAX_JSON_DEPTH + 1, size=5000, seed=0)
def test_few_brackets_counts_them_at_every_size(brackets: int, size: int, seed: int) -> None:
    """Counted or found one by one (from 4 KiB), brackets in any order and place."""
    rng = random.Random(seed)
    body = bytearray(b"x" * size)
    for _ in range(brackets):
        body.insert(rng.randrange(len(body) + 1), rng.choice(b"[{"))
    whole = bytes(body)
    assert few_brackets(whole) == (whole.count(b"[") + whole.count(b"{") <= MAX_JSON_DEPTH)


def test_a_large_body_is_read_and_checked_the_same() -> None:
    """A large body of many brackets: read as plain JSON, depth checked."""
    text = "word [ " * 20_000
    large = chat(messages=[{"role": "user", "content": text}])
    assert len(large) > 64 << 10
    assert parse_chat_request(large).messages[0].content == text
    deep = large.replace(b'"model"', b'"x": ' + nest(MAX_JSON_DEPTH) + b', "model"')
    assert f"more than {MAX_JSON_DEPTH} levels" in chat_error(deep).message
    assert "not valid JSON" in chat_error(large[:-1]).message


@pytest.mark.parametrize("where", ["response_format", "tools", "messages"])
def test_a_nest_too_deep_in_a_kept_field_is_refused(where: str) -> None:
    deep = json.loads(nest(MAX_JSON_DEPTH))
    fields: dict[str, Any] = {
        "response_format": {"response_format": {"type": "json_schema", "json_schema": deep}},
        "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]},
        "messages": {"messages": [{"role": "user", "content": "hi", "x": deep}]},
    }[where]
    err = chat_error(chat(**fields))
    assert f"more than {MAX_JSON_DEPTH} levels" in err.message
    assert err.param is None


def test_a_body_of_many_brackets_reads_as_one_of_few() -> None:
    text = "[{" * 100 + '\\"'
    body = chat(messages=[{"role": "user", "content": text}], tools=[WEATHER] * 30,
                temperature=0.5, stop=["]", "}"])
    assert body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH  # not the one typed pass
    request = parse_chat_request(body)
    assert request.messages[0].content == text
    assert len(request.tools) == 30
    assert request.tools[0] == parse_chat_request(chat(tools=[WEATHER])).tools[0]
    assert (request.temperature, request.stop) == (0.5, ("]", "}"))


def test_wrong_values_in_a_body_of_many_brackets_are_named() -> None:
    many = {"tools": [WEATHER] * 30}
    assert chat_error(chat(**many, max_tokens="x")).param == "max_tokens"
    assert chat_error(chat(**many, messages=[])).param == "messages"
    beyond = chat(**many).replace(b'"model"', b'"temperature": 1e999, "model"')
    assert chat_error(beyond).param == "temperature"  # refused where it is
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"maximum": 1.5}}}
    kept = chat(**many, response_format=schema).replace(b"1.5", b"1e999")
    assert (chat_error(kept).param or "").startswith("response_format")  # as a typed decode says
    ignored = chat(**many).replace(b'"model"', b'"x": [1e999], "model"')
    assert len(parse_chat_request(ignored).tools) == 30  # an unknown field's, as ever
    assert "not valid JSON" in chat_error(chat(**many)[:-1]).message


@pytest.mark.parametrize(
    ("value", "deep"),
    [
        ([[[[[]]]]], False),
        ([[[[[[]]]]]], True),
        ([[], [], [], [], [], [], [], [], [], []], False),  # many, shallow
        ([[[[[1]]]], [[[[[1]]]]]], True),  # deep after a shallow start
        ({"a": "[[[[[[[[[[{{{{{{"}, False),  # brackets in a string
        ({"a": {"b": {"c": {"d": {"e": 1}}}}}, False),
        ({"a": {"b": {"c": {"d": {"e": {}}}}}}, True),
        ("[[[[[[[[", False),
        (1, False),
    ],
)
def test_nested_deeper_than(value: Any, deep: bool) -> None:
    assert nested_deeper_than(value, 5) is deep


def depth_by_walking(body: bytes) -> int:
    """The deepest nest in ``body``, by a plain walk over its characters (the reference)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in body.decode():
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


json_texts = st.text(alphabet='[]{}"\\ab', max_size=6)
json_values = st.recursive(
    st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
              st.booleans(), st.none(), json_texts),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_texts, inner, max_size=3),
    max_leaves=40,
)


def decoded(body: bytes) -> Any:
    """``body`` as the depth check sees it: msgspec's plain decoding (numbers beyond a double
    read as ±inf)."""
    try:
        return msgspec.json.decode(body)
    except msgspec.ValidationError:
        return msgspec.json.decode(body, float_hook=float)


@settings(max_examples=300, derandomize=True, database=None)
@given(value=json_values, limit=st.integers(0, 8))
def test_the_depth_check_agrees_with_a_plain_walk(value: Any, limit: int) -> None:
    body = json.dumps(value).encode()
    assert nested_deeper_than(decoded(body), limit) is (depth_by_walking(body) > limit)


@pytest.mark.parametrize(
    ("fields", "logprobs"),
    [({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
     ({"logprobs": True, "top_logprobs": 0}, 0), ({"logprobs": True, "top_logprobs": 20}, 20)],
)
def test_chat_logprobs_reach_the_sampling_options(
    fields: dict[str, Any], logprobs: int | None
) -> None:
    request = parse_chat_request(chat(**fields))
    sampling = request.sampling_options(16)
    assert (sampling.logprobs, sampling.prompt_logprobs) == (logprobs, None)


@pytest.mark.parametrize(
    ("fields", "logprobs", "prompt_logprobs", "echo"),
    [({}, None, None, False), ({"logprobs": 0}, 0, None, False), ({"logprobs": 5}, 5, None, False),
     ({"echo": True}, None, None, True), ({"echo": True, "logprobs": 2}, 2, 2, True),
     ({"logprobs": False, "echo": False}, None, None, False)],
)
def test_completion_logprobs_and_echo(
    fields: dict[str, Any], logprobs: int | None, prompt_logprobs: int | None, echo: bool
) -> None:
    request = parse_completion_request(completion(**fields))
    sampling = request.sampling_options(16)
    assert (sampling.logprobs, sampling.prompt_logprobs, request.echo) == (
        logprobs, prompt_logprobs, echo
    )


def test_forced_tool_choices_carry_the_constraint_that_forces_them() -> None:
    required = parse_chat_request(chat(tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False))
    assert (required.tool_choice, required.tool_function) == ("required", None)
    assert required.constraint is not None and required.constraint.param == "tool_choice"
    schema = json.loads(required.constraint.text)
    assert schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string",
                                                                 "enum": ["get_weather"]}
    named = parse_chat_request(chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert named.tool_function == "get_weather" and named.constraint is not None
    assert json.loads(named.constraint.text) == WEATHER["function"]["parameters"]
    none = parse_chat_request(chat(tools=[WEATHER], tool_choice="none"))
    assert not none.offers_tools and none.constraint is None


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}},
])
def test_a_forced_call_wins_over_a_response_format(response_format: dict[str, Any]) -> None:
    """An agent sends its output format on every turn: a forced turn answers with the call."""
    forced = parse_chat_request(chat(tools=[WEATHER], tool_choice="required",
                                     response_format=response_format))
    alone = parse_chat_request(chat(tools=[WEATHER], tool_choice="required"))
    assert forced.constraint == alone.constraint and forced.constraint is not None
    assert forced.constraint.param == "tool_choice"


# ---------------------------------------------------------------- embeddings


def embedding(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "input": "Once upon"}
    body.update(fields)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Once upon", ("Once upon",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[4, 5], [6]], ((4, 5), (6,))),
    ],
)
def test_embedding_inputs(raw: Any, expected: tuple[Any, ...]) -> None:
    request = parse_embedding_request(embedding(input=raw))
    assert request.inputs == expected
    assert (request.encoding_format, request.dimensions) == ("float", None)


def test_embedding_fields() -> None:
    request = parse_embedding_request(
        embedding(encoding_format="base64", dimensions=64, user="u"))
    assert (request.encoding_format, request.dimensions, request.user) == ("base64", 64, "u")


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input[1]", "must not be empty"),
        ({"input": [[1], []]}, "input[1]", "must not be empty"),
        ({"input": ["a", [1]]}, "input[1]", "all strings or all lists of token ids"),
        ({"input": [1, -1]}, "input[1]", "Invalid type"),
        ({"input": ["a"] * 2049}, "input", "2049 inputs; at most 2048"),
        ({"input": 5}, "input", "Invalid type"),
        ({"encoding_format": "int8"}, "encoding_format", "Invalid value"),
        ({"dimensions": 0}, "dimensions", "Invalid value"),
    ],
)
def test_embedding_errors(fields: dict[str, Any], param: str, fragment: str) -> None:
    with pytest.raises(OpenAIHTTPError) as info:
        parse_embedding_request(embedding(**fields))
    assert info.value.status == 400 and info.value.param == param
    assert fragment in info.value.message


def test_embedding_needs_an_input() -> None:
    with pytest.raises(OpenAIHTTPError) as info:
        parse_embedding_request(b'{"model": "m"}')
    assert info.value.param == "input" and "Missing required" in info.value.message


def test_service_tier_and_safety_identifier() -> None:
    chat = parse_chat_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "service_tier": "flex", "safety_identifier": "user-7"}).encode())
    assert (chat.service_tier, chat.safety_identifier) == ("flex", "user-7")
    legacy = parse_completion_request(b'{"model": "m", "prompt": "x", "service_tier": "auto"}')
    assert legacy.service_tier == "auto"
    embedding = parse_embedding_request(b'{"model": "m", "input": "x", "service_tier": "flex"}')
    assert embedding.service_tier == "flex"  # a batch line's
    assert parse_chat_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}').service_tier is None
    with pytest.raises(OpenAIHTTPError) as bad:
        parse_completion_request(b'{"model": "m", "prompt": "x", "service_tier": "gold"}')
    assert bad.value.status == 400 and bad.value.param == "service_tier"
    assert "expected one of auto, default, flex, priority" in bad.value.message
