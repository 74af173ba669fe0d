"""The simulator writes text that satisfies each constraint it takes, and refuses the rest."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from direct_frontend.simulator.constraints import (
    InvalidConstraint,
    Unsupported,
    constrained_text,
    prompt_words,
)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 5},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {
        "kind": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}, "none": {"type": "null"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "tag": {"const": "x"}, "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "maybe": {"type": ["null", "string"], "minLength": 3, "maxLength": 5},
        "child": {"$ref": "#/$defs/child"},
    }, "$defs": {"child": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
]
REGEXES = [
    r"[0-9]{3}-[a-z]+", r"(yes|no|maybe)", r"\d+\.\d{2}", r"[^abc]x?", r"(ab)+\1", r"\w+@\w+\.com",
    r"^a.b$",
]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("seed", range(5))
def test_json_schema_text_validates(schema: dict[str, object], seed: int) -> None:
    text = constrained_text("json_schema", json.dumps(schema), seed)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("pattern", REGEXES)
@pytest.mark.parametrize("seed", range(5))
def test_regex_text_matches(pattern: str, seed: int) -> None:
    assert re.fullmatch(pattern, constrained_text("regex", pattern, seed))


def test_choice_and_json_object() -> None:
    assert constrained_text("choice", ["left", "right"], 3) in ("left", "right")
    assert isinstance(json.loads(constrained_text("json_object", "", 3)), dict)
    assert constrained_text("regex", "[a-z]+", 7) == constrained_text("regex", "[a-z]+", 7)


ANY_OBJECT = json.dumps({"type": "object"})  # json_object, as SGLang and TRT-LLM receive it


@pytest.mark.parametrize(("kind", "value"), [("json_object", ""), ("json_schema", ANY_OBJECT)])
@pytest.mark.parametrize("seed", range(20))
def test_a_free_form_object_says_something(kind: str, value: str, seed: int) -> None:
    """Two to four keys, not {}: JSON-mode clients take an empty object for no answer."""
    written = json.loads(constrained_text(kind, value, seed))
    assert isinstance(written, dict) and 2 <= len(written) <= 4
    assert all(isinstance(v, str | int) for v in written.values())


def test_a_free_form_object_takes_up_the_prompts_words() -> None:
    words = prompt_words("system\nYou answer in JSON.\nuser\nDescribe a cat named Tom, please")
    assert words == ["you", "answer", "json", "describe", "cat", "named", "tom", "please"]
    for seed in range(10):
        written = json.loads(constrained_text("json_object", "", seed, words))
        assert set(written) <= set(words)
        assert all(v in words for v in written.values() if isinstance(v, str))
    # too few words of its own: the simulator's
    assert json.loads(constrained_text("json_object", "", 1, ["hi"]))


def test_a_closed_object_without_properties_stays_empty() -> None:
    schema = json.dumps({"type": "object", "additionalProperties": False})
    assert constrained_text("json_schema", schema, 4) == "{}"


@pytest.mark.parametrize(
    ("kind", "value", "error"),
    [
        ("ebnf_grammar", 'root ::= "x"', Unsupported),
        ("structural_tag", "{}", Unsupported),
        ("json_schema", json.dumps({"allOf": [{"type": "string"}]}), Unsupported),
        ("json_schema", "[1]", InvalidConstraint),
        ("json_schema", "{nope", InvalidConstraint),
        ("json_schema", json.dumps({"type": "strange"}), InvalidConstraint),
        ("regex", "(unclosed", InvalidConstraint),
        ("choice", [], InvalidConstraint),
    ],
)
def test_what_it_cannot_write_is_refused(
    kind: str, value: str | list[str], error: type[Exception]
) -> None:
    with pytest.raises(error):
        constrained_text(kind, value, 0)
