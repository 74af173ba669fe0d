"""Structured outputs in the simulator: text that satisfies a request's constraint (no I/O).

A real engine masks logits with a grammar; the simulator instead writes one
text that satisfies the constraint, drawn from a seed (the prompt's hash, so
a retried request gets the same text on any simulated engine), and the
servicer emits its tokens, then EOS. That is enough to prove that a
constraint reaches the engine and that the frontend neither breaks nor
truncates the text on the way back.

What it can write: a choice; any JSON object (``json_object``); a regex, from
the syntax Python's ``re`` parses (character classes, alternation, groups,
bounded and unbounded repeats, which take at most three more than their
minimum); a JSON schema of the common subset: ``type`` (or a list of them),
``properties`` (all written, ``required`` or not), ``items``, ``minItems`` /
``maxItems``, ``enum``, ``const``, ``anyOf`` / ``oneOf`` (the first
branch), ``minimum`` / ``maximum``, ``minLength`` / ``maxLength``,
``pattern`` and local ``$ref``\\s (``#/$defs/…``, ``#/definitions/…``). An
EBNF grammar, or a schema using ``allOf``, ``not``, ``if``,
``patternProperties`` and the like is refused with :class:`Unsupported`
(the servicer answers UNIMPLEMENTED), so a test never passes on text the
constraint did not shape. Structural tags are :mod:`.structural`'s.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Sequence
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

#: what the simulator writes where a pattern allows any character (plain ASCII: every
#: tokenizer round-trips it)
_ANY = string.ascii_letters + string.digits + " _-"
_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud")
_MAX_EXTRA_REPEATS = 3
_UNSUPPORTED_SCHEMA = (
    "allOf", "not", "if", "then", "else", "patternProperties", "dependentSchemas",
    "dependentRequired", "propertyNames", "contains", "uniqueItems", "multipleOf",
)


class Unsupported(ValueError):
    """A constraint the simulator cannot write text for."""


class InvalidConstraint(ValueError):
    """A constraint no engine could compile (a broken regex, a schema that is no object)."""


def constrained_text(
    kind: str, value: str | Sequence[str], seed: int, words: Sequence[str] = ()
) -> str:
    """Text satisfying the constraint of ``kind`` (the contracts' names) and ``value``.

    ``words`` (the prompt's, say) name the keys and string values of a free-form object
    (``json_object``, or a schema's object without ``properties``); without them the
    simulator's own words do.
    """
    rng = random.Random(seed)
    if kind == "choice":
        choices = list(value)
        if not choices:
            raise InvalidConstraint("a choice constraint needs at least one choice")
        return rng.choice(choices)
    if not isinstance(value, str):
        raise InvalidConstraint(f"a {kind} constraint is a string")
    if kind == "json_object":
        return json.dumps(any_object(rng, words))
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise InvalidConstraint(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidConstraint("a JSON schema is an object")
        return json.dumps(schema_value(schema, rng, words))
    if kind == "regex":
        return regex_text(value, rng)
    raise Unsupported(f"the simulator cannot write text for a {kind} constraint")


def schema_value(schema: Any, rng: random.Random, words: Sequence[str] = ()) -> Any:
    """One value of a JSON schema (the subset in the module docstring); ``words`` as in
    :func:`constrained_text`."""
    return _SchemaWriter(schema, rng, words).value(schema, 0)


def any_object(rng: random.Random, words: Sequence[str] = ()) -> dict[str, Any]:
    """A small object a JSON-mode client can use: two to four keys, words and numbers.

    Keys and string values come from ``words`` when there are enough of them, else from the
    simulator's own; an empty object would satisfy the constraint but says nothing, and
    some clients take it for a failed answer.
    """
    pool = list(dict.fromkeys(words)) if len(set(words)) >= 2 else list(_WORDS)
    keys = rng.sample(pool, min(len(pool), rng.randint(2, 4)))
    out: dict[str, Any] = {}
    for index, key in enumerate(keys):
        out[key] = rng.choice(pool) if index % 2 == 0 else rng.randint(0, 99)
    return out


def prompt_words(text: str) -> list[str]:
    """The plain words of a prompt's text, in order, without its chat roles."""
    found = (word.lower() for word in re.findall(r"[A-Za-z]{3,}", text))
    return [word for word in dict.fromkeys(found) if word not in _ROLES]


_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


# -- regular expressions ------------------------------------------------------------------


def regex_text(pattern: str, rng: random.Random) -> str:
    """A string that ``re.fullmatch(pattern, ...)`` accepts."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise InvalidConstraint(f"the regex does not compile: {exc}") from None
    groups: dict[int, str] = {}
    return _nodes(parsed, rng, groups)


def _nodes(nodes: Any, rng: random.Random, groups: dict[int, str]) -> str:
    return "".join(_node(op, arg, rng, groups) for op, arg in nodes)


def _node(op: Any, arg: Any, rng: random.Random, groups: dict[int, str]) -> str:
    write = _WRITERS.get(op)
    if write is None:
        raise Unsupported(f"the simulator cannot write text for the regex construct {op}")
    return write(arg, rng, groups)


def _subpattern(arg: Any, rng: random.Random, groups: dict[int, str]) -> str:
    """A group's text, remembered under its number for a later back-reference."""
    group, _, _, body = arg
    text = _nodes(body, rng, groups)
    if group is not None:
        groups[group] = text
    return text


def _repeat(arg: Any, rng: random.Random, groups: dict[int, str]) -> str:
    """A few repetitions: up to a few more than the least, an unbounded one included."""
    low, high, body = arg
    top = low + _MAX_EXTRA_REPEATS if high is sre.MAXREPEAT else min(high, low + 3)
    return "".join(_nodes(body, rng, groups) for _ in range(rng.randint(low, top)))


_Writer = Callable[[Any, random.Random, dict[int, str]], str]
#: each parsed regex construct's writer (anchors write nothing: the whole text is the match)
_WRITERS: dict[Any, _Writer] = {
    sre.LITERAL: lambda arg, rng, groups: chr(arg),
    sre.NOT_LITERAL: lambda arg, rng, groups: next(c for c in _ANY if ord(c) != arg),
    sre.ANY: lambda arg, rng, groups: rng.choice(_ANY),
    sre.IN: lambda arg, rng, groups: _in_class(arg, rng),
    sre.BRANCH: lambda arg, rng, groups: _nodes(rng.choice(arg[1]), rng, groups),
    sre.SUBPATTERN: _subpattern,
    sre.MAX_REPEAT: _repeat,
    sre.MIN_REPEAT: _repeat,
    getattr(sre, "POSSESSIVE_REPEAT", sre.MAX_REPEAT): _repeat,
    sre.AT: lambda arg, rng, groups: "",
    sre.GROUPREF: lambda arg, rng, groups: groups.get(arg, ""),
    sre.CATEGORY: lambda arg, rng, groups: _category(arg, rng),
}


def _category(category: Any, rng: random.Random) -> str:
    if category is sre.CATEGORY_DIGIT:
        return rng.choice(string.digits)
    if category is sre.CATEGORY_SPACE:
        return " "
    if category is sre.CATEGORY_WORD:
        return rng.choice(string.ascii_letters + string.digits + "_")
    if category is sre.CATEGORY_NOT_DIGIT:
        return rng.choice(string.ascii_letters)
    if category is sre.CATEGORY_NOT_SPACE or category is sre.CATEGORY_NOT_WORD:
        return rng.choice(string.ascii_letters) if category is sre.CATEGORY_NOT_SPACE else "-"
    raise Unsupported(f"the simulator cannot write text for the regex class {category}")


def _in_class(items: Any, rng: random.Random) -> str:
    """One character of a ``[...]`` class (a negated one: a plain character outside it)."""
    if items and items[0][0] is sre.NEGATE:
        excluded = re.compile(f"[{''.join(_class_source(items[1:]))}]")
        for c in _ANY:
            if not excluded.fullmatch(c):
                return c
        raise Unsupported("the negated class excludes every character the simulator writes")
    op, arg = rng.choice(items)
    if op is sre.LITERAL:
        return chr(arg)
    if op is sre.RANGE:
        return chr(rng.randint(arg[0], arg[1]))
    if op is sre.CATEGORY:
        return _category(arg, rng)
    raise Unsupported(f"the simulator cannot write text for the class item {op}")


def _class_source(items: Any) -> list[str]:
    """A parsed class's items as class source again (to test candidates against it)."""
    parts = []
    for op, arg in items:
        if op is sre.LITERAL:
            parts.append(re.escape(chr(arg)))
        elif op is sre.RANGE:
            parts.append(f"{re.escape(chr(arg[0]))}-{re.escape(chr(arg[1]))}")
        elif op is sre.CATEGORY:
            parts.append({sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_SPACE: r"\s",
                          sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_DIGIT: r"\D",
                          sre.CATEGORY_NOT_SPACE: r"\S", sre.CATEGORY_NOT_WORD: r"\W"}[arg])
        else:
            raise Unsupported(f"the simulator cannot write text for the class item {op}")
    return parts


# -- JSON schemas ---------------------------------------------------------------------------


def _check_writable(schema: Any, depth: int) -> None:
    """Refuse a subschema that is no object, nests too deeply, or uses a keyword not written."""
    if not isinstance(schema, dict):
        raise InvalidConstraint(f"a subschema is an object, not {json.dumps(schema)}")
    if depth > 16:
        raise Unsupported("the schema nests (or refers to itself) too deeply to write")
    for keyword in _UNSUPPORTED_SCHEMA:
        if keyword in schema:
            raise Unsupported(f"the simulator cannot write JSON for the keyword '{keyword}'")


class _SchemaWriter:
    """Writes one value of a schema (the subset in the module docstring)."""

    def __init__(self, root: dict[str, Any], rng: random.Random, words: Sequence[str]) -> None:
        self.root = root
        self.rng = rng
        self.words = words

    def value(self, schema: Any, depth: int) -> Any:
        if schema is True or schema == {}:
            return self.rng.choice(_WORDS)
        _check_writable(schema, depth)
        if "$ref" in schema:
            return self.value(self._resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self.rng.choice(schema["enum"])
        for branches in ("anyOf", "oneOf"):
            if branches in schema:
                return self.value(schema[branches][0], depth + 1)
        kind = schema.get("type", "object" if "properties" in schema else "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null")
        return self._typed(kind, schema, depth)

    def _typed(self, kind: str, schema: dict[str, Any], depth: int) -> Any:
        rng = self.rng
        if kind == "object":
            if "properties" not in schema and schema.get("additionalProperties") is not False:
                return any_object(rng, self.words)  # free-form: {"type": "object"} and the like
            properties = schema.get("properties", {})
            return {name: self.value(sub, depth + 1) for name, sub in properties.items()}
        if kind == "array":
            low = int(schema.get("minItems", 1))
            high = int(schema.get("maxItems", low + 2))
            items = schema.get("items", {})
            return [self.value(items, depth + 1) for _ in range(rng.randint(low, max(low, high)))]
        if kind == "string":
            if "pattern" in schema:
                return regex_text(schema["pattern"], rng)
            low = int(schema.get("minLength", 1))
            high = int(schema.get("maxLength", max(low, 12)))
            word = rng.choice(_WORDS)
            while len(word) < low:
                word += rng.choice(_WORDS)
            return word[: max(low, min(high, len(word)))]
        if kind in ("integer", "number"):
            low = schema.get("minimum", schema.get("exclusiveMinimum", -1000))
            high = schema.get("maximum", schema.get("exclusiveMaximum", 1000))
            value = rng.randint(int(low) + 1, int(high) - 1) if high - low > 2 else int(low)
            return value if kind == "integer" else value + 0.5 if value + 0.5 < high else value
        if kind == "boolean":
            return rng.choice((True, False))
        if kind == "null":
            return None
        raise InvalidConstraint(f"'{kind}' is not a JSON schema type")

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise Unsupported(f"the simulator resolves local references only, not {ref!r}")
        node: Any = self.root
        for part in ref[2:].split("/"):
            if not isinstance(node, dict) or part not in node:
                raise InvalidConstraint(f"the reference {ref!r} names nothing in the schema")
            node = node[part]
        return node
