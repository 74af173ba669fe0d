"""Structured outputs and the sampling fields beyond the basics, as the parser normalises them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from direct_frontend.engines.neutral import Constraint, ConstraintKind
from direct_frontend.openai.errors import OpenAIHTTPError
from direct_frontend.openai.parse import parse_chat_request, parse_completion_request

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def chat(**fields: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def refused(body: bytes) -> OpenAIHTTPError:
    with pytest.raises(OpenAIHTTPError) as info:
        parse_chat_request(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            Constraint(ConstraintKind.JSON_OBJECT, param="response_format"),
        ),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
            Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":")),
                       param="response_format"),
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":")),
                       param="guided_json"),
        ),
        (
            {"guided_regex": "[0-9]+"},
            Constraint(ConstraintKind.REGEX, "[0-9]+", param="guided_regex"),
        ),
        ({"regex": "a|b"}, Constraint(ConstraintKind.REGEX, "a|b", param="regex")),
        (
            {"ebnf": 'root ::= "x"'},
            Constraint(ConstraintKind.GRAMMAR, 'root ::= "x"', param="ebnf"),
        ),
        (
            {"guided_grammar": 'root ::= "x"'},
            Constraint(ConstraintKind.GRAMMAR, 'root ::= "x"', param="guided_grammar"),
        ),
        (
            {"guided_choice": ["yes", "no"]},
            Constraint(ConstraintKind.CHOICE, choices=("yes", "no"), param="guided_choice"),
        ),
        (
            {"structured_outputs": {"choice": ["a"]}},
            Constraint(ConstraintKind.CHOICE, choices=("a",), param="structured_outputs.choice"),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            Constraint(ConstraintKind.JSON_OBJECT, param="structured_outputs.json_object"),
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}},
            Constraint(
                ConstraintKind.STRUCTURAL_TAG,
                '{"type":"structural_tag","format":{"type":"any_text"}}',
                param="response_format",
            ),
        ),
    ],
)
def test_every_way_to_ask_for_a_constraint_is_one_constraint(
    fields: dict[str, Any], expected: Constraint | None
) -> None:
    assert parse_chat_request(chat(**fields)).constraint == expected
    assert parse_completion_request(completion(**fields)).constraint == expected
    sampling = parse_chat_request(chat(**fields)).sampling_options(8)
    assert sampling.constraint == expected


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "Missing"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "an object",
        ),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict",
            "boolean",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": ""}, "guided_regex", "must not be empty"),
        ({"guided_choice": []}, "guided_choice", "at least one"),
        ({"structured_outputs": {"choice": [1]}}, "structured_outputs.choice", "list of strings"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "Only one",
        ),
        ({"logit_bias": {"x": 1}}, "logit_bias.x", "not a token id"),
        ({"logit_bias": {"-3": 1}}, "logit_bias.-3", "not a token id"),
        ({"logit_bias": {"2147483648": 1}}, "logit_bias.2147483648", "not a token id"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "-100 to 100"),
    ],
)
def test_a_bad_constraint_or_bias_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, fragment: str
) -> None:
    err = refused(chat(**fields))
    assert err.param == param
    assert fragment in err.message


def test_the_sampling_fields_reach_the_neutral_options() -> None:
    request = parse_chat_request(chat(
        logit_bias={"42": -100, "7": 2.5}, skip_special_tokens=False, seed=3,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        user="someone", metadata={"team": "a"},  # accepted, not used
    ))
    sampling = request.sampling_options(8)
    assert sampling.logit_bias == ((7, 2.5), (42, -100.0))
    assert sampling.skip_special_tokens is False and sampling.seed == 3
    assert request.include_usage and request.continuous_usage_stats
