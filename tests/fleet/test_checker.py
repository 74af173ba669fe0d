"""The schema-driven checker: a dataclass's fields and their Rules are the checks (sans-IO)."""

from __future__ import annotations

import dataclasses
import enum
import re
import tomllib
import typing
from pathlib import Path
from typing import Literal

import pytest

from direct_frontend.fleet.checker import Checker, keys_of, required_keys, specs
from direct_frontend.fleet.locate import Locator
from direct_frontend.fleet.schema import (
    FleetConfig,
    FrontendConfig,
    KvAwareKnobs,
    Rules,
    setting,
)

ROOT = Path(__file__).resolve().parents[2]


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Pump:
    """A made-up table with one field of each kind the checker reads by itself."""

    name: str
    count: int = setting(3, Rules(at_least=1))
    port: int | None = setting(None, Rules(at_least=1, at_most=65535))
    rate: float = setting(2.0, Rules(above=0))
    share: float = setting(0.5, Rules(at_least=0, at_most=1))
    on: bool = True
    mode: Literal["fast", "slow"] = setting("fast", Rules(noun="pump mode"))
    colour: Colour = setting(Colour.RED, Rules(noun="colour"))
    token: str | None = setting(None, Rules(secret=True))
    keys: tuple[str, ...] = setting((), Rules(secret=True))
    host: str = setting("h", Rules(key="address"))
    port_too: int = setting(1, Rules(key="address"))
    nick: str = dataclasses.field(metadata={"rules": Rules(derived=True)})
    origin: Path = dataclasses.field(metadata={"rules": Rules(in_file=False)})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Knobs:
    size: int = setting(16, Rules(at_least=1))
    weight: float = setting(1.0, Rules(at_least=0))


def check(text: str) -> tuple[dict[str, object], list[str]]:
    """Read ``[pump]`` from ``text`` by Pump's fields: the values and the problems."""
    checker = Checker("f.toml", Locator(text))
    table = tomllib.loads(text)["pump"]
    values = checker.fields(Pump, table, ("pump",), {"host": "h", "port_too": 1, "origin": Path()})
    return values, [str(problem) for problem in checker.problems]


def problems(text: str) -> list[str]:
    return check(text)[1]


def test_keys_come_from_the_fields_in_order() -> None:
    assert keys_of(Pump) == (
        "name", "count", "port", "rate", "share", "on", "mode", "colour", "token", "keys",
        "address",  # two fields read from one key: listed once
        "nick",  # origin is not in the file
    )
    assert required_keys(Pump) == ("name",)  # nick has no default but is derived


def test_unknown_keys_are_still_errors() -> None:
    text = '[pump]\nname = "p"\ncolor = "red"\n'
    checker = Checker("f.toml", Locator(text))
    checker.table(tomllib.loads(text)["pump"], ("pump",), keys_of(Pump))
    assert [str(p) for p in checker.problems] == [
        "f.toml:3: pump.color: unknown key (expected one of: name, count, port, rate, share, on, "
        "mode, colour, token, keys, address, nick)"
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # the same words the hand-written checks used (see test_load's range tests)
        ("count = 0", "must be at least 1, got 0"),
        ("port = 70000", "must be between 1 and 65535, got 70000"),
        ("rate = 0", "must be greater than 0, got 0"),
        ("share = 1.5", "must be between 0 and 1, got 1.5"),
        ("share = -0.5", "must be between 0 and 1, got -0.5"),
        ("rate = inf", "must be a finite number, got inf"),
        ("count = 1.5", "expected an integer, got float 1.5"),
        ("rate = true", "expected a number, got boolean true"),
        ('on = "yes"', 'expected a boolean, got string "yes"'),
        ('mode = "warp"', "'warp' is not a valid pump mode (expected one of: fast, slow)"),
        ('colour = "green"', "'green' is not a valid colour (expected one of: red, blue)"),
        ('name = " "', "must not be empty"),
        ("token = 5", "expected a string, got integer"),
        ('token = "two words"', "must be non-empty, without spaces or control characters"),
        ('keys = "k"', "expected an array of strings, got string"),
        ('token = "clé"', "must be ASCII (an Authorization header cannot carry it otherwise)"),
    ],
)
def test_a_rule_in_the_metadata_reads_like_the_hand_written_check(line: str, message: str) -> None:
    key = line.split(" ")[0]
    name = "" if key == "name" else 'name = "p"\n'
    assert problems(f"[pump]\n{line}\n{name}") == [f"f.toml:2: pump.{key}: {message}"]


def test_secrets_are_never_quoted() -> None:
    found = problems('[pump]\nname = "p"\nkeys = ["good", "bad key", 7]\ntoken = "x y"\n')
    assert found == [  # in field order
        "f.toml:4: pump.token: must be non-empty, without spaces or control characters",
        "f.toml:3: pump.keys[2]: must be non-empty, without spaces or control characters",
        "f.toml:3: pump.keys[3]: expected a string, got integer",
    ]
    assert not any("bad key" in p or "x y" in p for p in found)


def test_every_problem_is_reported_and_defaults_stand_in() -> None:
    values, found = check('[pump]\nname = 1\ncount = 0\nrate = "fast"\nmode = "warp"\n')
    fields = [p.split(": ")[1] for p in found]
    assert fields == ["pump.name", "pump.count", "pump.rate", "pump.mode"]
    assert values["count"] == 3 and values["rate"] == 2.0 and values["mode"] == "fast"
    assert values["name"] == ""  # a placeholder: the file is refused anyway
    assert values["nick"] == ""


def test_good_values_are_typed() -> None:
    values, found = check(
        '[pump]\nname = "p"\ncount = 5\nrate = 3\ncolour = "blue"\nkeys = ["k1", "k2"]\n'
    )
    assert found == []
    assert values["rate"] == 3.0 and isinstance(values["rate"], float)
    assert values["colour"] is Colour.BLUE
    assert values["keys"] == ("k1", "k2")
    assert values["port"] is None and values["on"] is True


def test_values_read_by_hand_are_not_read_again() -> None:
    text = '[pump]\nname = "p"\ncount = "x"\n'
    checker = Checker("f.toml", Locator(text))
    by_hand = {"count": 9, "host": "h", "port_too": 1, "origin": Path()}
    values = checker.fields(Pump, tomllib.loads(text)["pump"], ("pump",), by_hand)
    assert values["count"] == 9 and checker.problems == []


def test_a_field_with_no_generic_read_must_be_read_by_hand() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Odd:
        where: Path = Path("x")

    checker = Checker("f.toml", Locator(""))
    with pytest.raises(TypeError, match=r"Odd\.where: no generic read"):
        checker.fields(Odd, {}, ())
    with pytest.raises(TypeError, match=r"Pump\.host shares the key 'address'"):
        checker.fields(Pump, {"name": "p"}, ("pump",))
    with pytest.raises(TypeError, match=r"Pump\.origin is not read from the file"):
        checker.fields(Pump, {"name": "p"}, ("pump",), {"host": "h", "port_too": 1})


def test_a_nested_table_is_read_by_its_own_fields() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Outer:
        knobs: Knobs = Knobs()

    text = "[outer.knobs]\nsize = 0\nweight = 2\n"
    checker = Checker("f.toml", Locator(text))
    outer = checker.section(Outer, tomllib.loads(text)["outer"], ("outer",))
    assert outer == Outer(knobs=Knobs(weight=2.0))
    assert [str(p) for p in checker.problems] == [
        "f.toml:2: outer.knobs.size: must be at least 1, got 0"
    ]


def test_knob_tables_keep_their_own_wording() -> None:
    text = "[k]\nsize = 0\nweight = -1\ncolour = 1\n"
    checker = Checker("f.toml", Locator(text))
    knobs = checker.knobs(Knobs, {"size": 0, "weight": -1, "colour": 1}, ("k",))
    assert knobs == Knobs()
    assert [str(p) for p in checker.problems] == [
        "f.toml:2: k.size: must be at least 1",
        "f.toml:3: k.weight: must not be negative",
        "f.toml:4: k.colour: unknown key (expected one of: size, weight)",  # sorted
    ]
    checker = Checker("f.toml", Locator(""))
    assert checker.knobs(Knobs, {"weight": 2}, ()) == Knobs(weight=2.0)
    checker.knobs(Knobs, {"size": 2.0, "weight": "x"}, ())
    assert [p.message for p in checker.problems] == [
        "expected an integer, got float 2.0",
        'expected a number, got string "x"',
    ]


def _schema_classes(cls: type, seen: dict[type, None]) -> dict[type, None]:
    seen[cls] = None
    for spec in specs(cls).values():
        inner = typing.get_args(spec.type) or (spec.type,)
        for kind in inner:
            if dataclasses.is_dataclass(kind) and isinstance(kind, type) and kind not in seen:
                _schema_classes(kind, seen)
    return seen


def test_every_number_in_the_fleet_schema_has_a_bound() -> None:
    unbounded = [
        f"{cls.__name__}.{spec.name}"
        for cls in _schema_classes(FleetConfig, {})
        for spec in specs(cls).values()
        if spec.type in (int, float)
        and spec.rules.at_least is None
        and spec.rules.above is None
    ]
    assert unbounded == ["FrontendConfig.listen_port"]  # read by hand, with the listen address
    assert specs(FrontendConfig)["listen_port"].key == "listen"


def test_the_readme_knob_table_shows_the_schema_defaults() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| `[frontend.routing.knobs]` | default | |", 1)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([\d.]+) \|", table.split("\n\n", 1)[0], re.M))
    defaults = KvAwareKnobs()
    assert set(rows) == {spec.name for spec in specs(KvAwareKnobs).values()}
    for name, shown in rows.items():
        assert float(shown) == getattr(defaults, name), name


def test_an_array_of_choices_names_each_bad_one_with_its_index() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Log:
        fields: tuple[Literal["method", "path", "status"], ...] = setting(
            ("method",), Rules(noun="field"))

    text = '[log]\nfields = ["path", "nope", "path", 3]\n'
    checker = Checker("f.toml", Locator(text))
    values = checker.fields(Log, tomllib.loads(text)["log"], ("log",), {})
    assert values["fields"] == ("path",)
    assert sorted(str(p) for p in checker.problems) == [
        "f.toml:2: log.fields[2]: 'nope' is not a valid field (expected one of: method, path, "
        "status)",
        "f.toml:2: log.fields[4]: expected a string, got integer 3",
    ]
