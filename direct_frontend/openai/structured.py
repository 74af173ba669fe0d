"""Structured outputs: ``response_format`` and the engines' own fields, as one constraint.

OpenAI clients ask for structured output with ``response_format``
(``json_object``, ``json_schema``; vLLM and SGLang also take
``structural_tag``). The engines' OpenAI servers accept extensions too:
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar`` /
``guided_choice`` and its newer ``structured_outputs`` object, SGLang's
``regex`` and ``ebnf``, and a top-level ``structural_tag``. Whichever field
the client used, the request carries one neutral
:class:`~direct_frontend.engines.neutral.Constraint` naming that field, and
each dialect maps it to its contract. More than one constraint is a 400: no
engine combines them.

What is checked here is what needs no grammar engine: the shapes (a schema
is a JSON object, choices are a non-empty list of strings, a regex or
grammar is a non-empty string). Whether the engine's grammar backend can
compile it is the engine's to say (its refusal is a 400 too).
"""

from __future__ import annotations

import json
from typing import Any, Final

from direct_frontend.engines.neutral import Constraint, ConstraintKind
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request

#: the top-level extension fields, in the order they are looked at, and what they hold
EXTENSIONS: Final = (
    ("guided_json", ConstraintKind.JSON_SCHEMA),
    ("guided_regex", ConstraintKind.REGEX),
    ("regex", ConstraintKind.REGEX),  # SGLang
    ("guided_grammar", ConstraintKind.GRAMMAR),
    ("ebnf", ConstraintKind.GRAMMAR),  # SGLang
    ("guided_choice", ConstraintKind.CHOICE),
    ("structural_tag", ConstraintKind.STRUCTURAL_TAG),
)

#: vLLM's ``structured_outputs`` keys
_STRUCTURED_OUTPUTS: Final = {
    "json": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "grammar": ConstraintKind.GRAMMAR,
    "choice": ConstraintKind.CHOICE,
    "json_object": ConstraintKind.JSON_OBJECT,
    "structural_tag": ConstraintKind.STRUCTURAL_TAG,
}

_RESPONSE_FORMATS: Final = ("text", "json_object", "json_schema", "structural_tag")


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _type_error(param: str, expected: str) -> OpenAIHTTPError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}.", param)


def _schema(value: object, param: str) -> str:
    """A JSON schema given as an object or as a JSON string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid_request(
                f"Invalid value for '{param}': the schema is not valid JSON.", param
            ) from None
    if not isinstance(value, dict):
        raise _type_error(param, "a JSON schema (an object)")
    return _compact(value)


def _text(value: object, param: str, what: str) -> str:
    if not isinstance(value, str):
        raise _type_error(param, f"{what} (a string)")
    if not value:
        raise invalid_request(f"Invalid value for '{param}': the {what} must not be empty.", param)
    return value


def _choices(value: object, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise _type_error(param, "a list of strings")
    if not value:
        raise invalid_request(f"Invalid value for '{param}': give at least one choice.", param)
    return tuple(value)


def _tag(value: object, param: str) -> str:
    """A structural tag: the object itself (or its JSON), passed to the engine as JSON."""
    if isinstance(value, str):
        return _text(value, param, "structural tag")
    if not isinstance(value, dict):
        raise _type_error(param, "a structural tag (an object or its JSON)")
    return _compact(value)


def _of(kind: ConstraintKind, value: object, param: str) -> Constraint:
    """The constraint ``value`` of field ``param`` holds, checked for its kind's shape."""
    if kind is ConstraintKind.JSON_SCHEMA:
        return Constraint(kind, _schema(value, param), param=param)
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind, param=param)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, choices=_choices(value, param), param=param)
    if kind is ConstraintKind.STRUCTURAL_TAG:
        return Constraint(kind, _tag(value, param), param=param)
    what = "regular expression" if kind is ConstraintKind.REGEX else "grammar"
    return Constraint(kind, _text(value, param, what), param=param)


def _response_format(value: dict[str, Any]) -> Constraint | None:
    kind = value.get("type")
    if kind not in _RESPONSE_FORMATS:
        shown = kind if isinstance(kind, str) else json.dumps(kind)
        raise invalid_request(
            f"Invalid value for 'response_format.type': '{shown}'; expected one of "
            f"{', '.join(_RESPONSE_FORMATS)}.",
            "response_format.type",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT, param="response_format")
    if kind == "structural_tag":  # the whole object, as vLLM's and SGLang's servers pass it
        return Constraint(ConstraintKind.STRUCTURAL_TAG, _compact(value), param="response_format")
    spec = value.get("json_schema")
    if spec is None:
        raise invalid_request(
            "Missing required parameter: 'response_format.json_schema'.",
            "response_format.json_schema",
        )
    if not isinstance(spec, dict):
        raise _type_error("response_format.json_schema", "an object")
    for field, kinds, expected in (("name", str, "a string"), ("strict", bool, "a boolean")):
        if spec.get(field) is not None and not isinstance(spec[field], kinds):
            raise _type_error(f"response_format.json_schema.{field}", expected)
    schema = spec.get("schema")
    if schema is None:
        raise invalid_request(
            "Missing required parameter: 'response_format.json_schema.schema'.",
            "response_format.json_schema.schema",
        )
    # strict or not, an engine's grammar enforces the schema exactly
    return Constraint(
        ConstraintKind.JSON_SCHEMA,
        _schema(schema, "response_format.json_schema.schema"),
        param="response_format",
    )


def _structured_outputs(value: dict[str, Any]) -> list[Constraint]:
    found = []
    for key, kind in _STRUCTURED_OUTPUTS.items():
        given = value.get(key)
        if given is None or (kind is ConstraintKind.JSON_OBJECT and given is False):
            continue
        found.append(_of(kind, given, f"structured_outputs.{key}"))
    return found


def constraint_of(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    extensions: dict[str, object],
) -> Constraint | None:
    """The one constraint a request asks for, or None; a 400 naming the field when it is bad.

    ``extensions`` holds the top-level fields of :data:`EXTENSIONS` by name (None: unset).
    """
    found: list[Constraint] = []
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(constraint)
    if structured_outputs is not None:
        found.extend(_structured_outputs(structured_outputs))
    for name, kind in EXTENSIONS:
        value = extensions.get(name)
        if value is not None:
            found.append(_of(kind, value, name))
    if len(found) > 1:
        raise invalid_request(
            f"Only one structured-output constraint may be given; got '{found[0].param}' and "
            f"'{found[1].param}'.",
            found[1].param,
        )
    return found[0] if found else None
