"""``[frontend.auth]`` keys from the environment and a keys file: resolved at load, never shown."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from direct_frontend.fleet.describe import describe_fleet, to_jsonable
from direct_frontend.fleet.keys import KeySources, env_keys, file_keys, process_sources
from direct_frontend.fleet.load import FleetError, load_fleet, parse_fleet
from direct_frontend.fleet.schema import FleetConfig

WRITTEN, FROM_ENV, FROM_FILE = "sk-written-0001", "sk-from-env-0002", "sk-from-file-0003"


def text(auth: str) -> str:
    return textwrap.dedent("""\
        [frontend]
        served_model_name = "demo"
        tokenizer = "m"

        [frontend.auth]
        {auth}

        [[engine]]
        url = "grpc://10.0.0.1:50051"
        kind = "sglang"
        """).format(auth=auth)


def parse(auth: str, source: Path, environ: dict[str, str] | None = None) -> FleetConfig:
    sources = KeySources(environ or {}, process_sources().read_text)
    return parse_fleet(text(auth), source, sources=sources)


def problems(auth: str, source: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(FleetError) as caught:
        parse(auth, source, environ)
    return str(caught.value)


def test_the_values_split_on_commas_whitespace_lines_and_comments() -> None:
    assert env_keys(" a,b  c,\n,d ") == ["a", "b", "c", "d"]
    assert file_keys("# keys of team a\n\nk1\n  k2   # alice\nk#3\n") == [
        (3, "k1"), (4, "k2"), (5, "k#3")]


def test_the_keys_are_the_union_of_the_file_the_variable_and_the_keys_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "keys").write_text(f"# rotated monthly\n{FROM_FILE}\n{WRITTEN}\n")
    fleet = parse(f'api_keys = ["{WRITTEN}"]\napi_keys_env = "DF_KEYS"\napi_keys_file = "keys"',
                  tmp_path / "fleet.toml", {"DF_KEYS": f"{FROM_ENV}, {WRITTEN}"})
    auth = fleet.frontend.auth
    assert auth.api_keys == (WRITTEN, FROM_ENV, FROM_FILE)  # once each
    assert auth.api_keys_file == tmp_path / "keys"  # beside the fleet file
    shown = repr(fleet) + describe_fleet(fleet) + json.dumps(to_jsonable(fleet))
    assert not any(key in shown for key in (WRITTEN, FROM_ENV, FROM_FILE))
    assert f"3 (redacted; read from $DF_KEYS and {tmp_path / 'keys'})" in describe_fleet(fleet)
    frontend = to_jsonable(fleet)["frontend"]
    assert isinstance(frontend, dict)
    assert frontend["auth"] == {"api_keys": ["<redacted>"] * 3, "api_keys_env": "DF_KEYS",
                                "api_keys_file": str(tmp_path / "keys"), "tenant_header": None}


def test_load_fleet_reads_this_processs_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(text('api_keys_env = "DF_TEST_KEYS"'))
    monkeypatch.setenv("DF_TEST_KEYS", FROM_ENV)
    assert load_fleet(path).frontend.auth.api_keys == (FROM_ENV,)
    monkeypatch.delenv("DF_TEST_KEYS")
    with pytest.raises(FleetError, match="DF_TEST_KEYS is not set"):
        load_fleet(path)


def test_an_unset_or_empty_variable_is_an_error_on_its_line(tmp_path: Path) -> None:
    source = tmp_path / "fleet.toml"
    assert problems('api_keys_env = "DF_KEYS"', source) == (
        f"{source}:6: frontend.auth.api_keys_env: the environment variable DF_KEYS is not set")
    assert problems('api_keys_env = "DF_KEYS"', source, {"DF_KEYS": " , "}) == (
        f"{source}:6: frontend.auth.api_keys_env: the environment variable DF_KEYS holds no keys")
    assert problems('api_keys_env = "DF KEYS"', source).endswith(
        "api_keys_env: 'DF KEYS' is not an environment variable name")
    message = problems('api_keys_env = "DF_KEYS"', source, {"DF_KEYS": "ok-key sk-\x07bell"})
    assert message.endswith(
        "key 2 of $DF_KEYS must be non-empty, without spaces or control characters")
    assert "bell" not in message and "ok-key" not in message


def test_an_unreadable_empty_or_bad_keys_file_is_an_error_on_its_line(tmp_path: Path) -> None:
    source = tmp_path / "fleet.toml"
    keys = tmp_path / "keys"
    assert problems('api_keys_file = "keys"', source) == (
        f"{source}:6: frontend.auth.api_keys_file: cannot read {keys}: No such file or directory")
    keys.write_text("# none yet\n\n")
    assert problems('api_keys_file = "keys"', source).endswith(
        f"api_keys_file: {keys} holds no keys (one a line, # starts a comment)")
    keys.write_text(f"{FROM_FILE}\nsk-one sk-two\n")
    message = problems('api_keys_file = "keys"', source)
    assert message.endswith(
        f"api_keys_file: {keys}:2: the key must be non-empty, without spaces or control characters")
    assert FROM_FILE not in message and "sk-one" not in message
    keys.write_bytes(b"\xff\xfe")
    assert problems('api_keys_file = "keys"', source).endswith(f"{keys} is not UTF-8 text")
    assert problems('api_keys_file = "~/keys"', source).endswith(
        "'~/keys': '~' is not expanded; write the full path")


def tenants_fleet(tenants: str, environ: dict[str, str]) -> FleetConfig:
    fleet = text('api_keys = ["sk-some-key-0001"]').replace("[[engine]]", tenants + "\n[[engine]]")
    return parse_fleet(fleet, Path("fleet.toml"),
                       sources=KeySources(environ, process_sources().read_text))


def test_tenants_resolve_to_the_flows_requests_queue_in() -> None:
    from direct_frontend.fleet.keys import key_identity, named_flow, tenant_flow

    by_key = tenants_fleet('[frontend.tenants]\ndefault_weight = 2\nmax_in_flight = 8\n'
                           '[[frontend.tenants.tenant]]\napi_key_env = "TEAM_A"\nweight = 3\n'
                           'max_queue = 4\npriority = true\n'
                           '[[frontend.tenants.tenant]]\napi_key_env = "TEAM_B"\n'
                           'name = "team-b"\n',
                           {"TEAM_A": "sk-team-a-0123", "TEAM_B": "sk-team-b-4567"}
                           ).frontend.tenants
    team, other = by_key.tenant
    assert team.flow == key_identity("sk-team-a-0123") and "sk-team" not in repr(by_key)
    assert (team.weight, team.max_queue, team.priority, team.label) == (3, 4, True, "TEAM_A")
    assert other.label == "team-b" and other.priority is None  # its name, else its variable's
    by_header = tenants_fleet('[frontend.tenants]\nheader = "x-team"\n'
                              '[[frontend.tenants.tenant]]\nname = "search"\n'
                              'max_in_flight = 2\n', {}).frontend.tenants
    assert by_header.by_flow()[tenant_flow(b"search")].max_in_flight == 2
    by_field = tenants_fleet('[frontend.tenants]\nfield = "safety_identifier"\n'
                             '[[frontend.tenants.tenant]]\nname = "über-team"\n', {}
                             ).frontend.tenants
    assert by_field.field == "safety_identifier" and by_field.named_by == "field safety_identifier"
    assert [t.flow for t in by_field.tenant] == [named_flow("über-team")]


def test_a_tenant_is_named_one_way() -> None:
    for tables, message in (
        ('[[frontend.tenants.tenant]]\nname = "a"', "give the tenant's api_key_env"),
        ('header = "x-t"\n[[frontend.tenants.tenant]]\nname = "a"\napi_key_env = "K"',
         "its value names the tenants: give name instead"),
        ('field = "user"\n[[frontend.tenants.tenant]]\nweight = 2',
         "give the tenant's name (the value of the field that names it)"),
        ('[[frontend.tenants.tenant]]\napi_key_env = "NOT_SET_ANYWHERE"', "is not set"),
        ('header = "x-t"\nfield = "user"', "give header or field, not both"),
        ('field = "email"', "tenant field"),
        ('header = "x-t"\n[[frontend.tenants.tenant]]\nname = "a"\n'
         '[[frontend.tenants.tenant]]\nname = "a"', "two tenants are the same one"),
    ):
        with pytest.raises(FleetError, match=re.escape(message)):
            tenants_fleet(f"[frontend.tenants]\n{tables}\n", {})


def test_rate_limits_read_per_tenant_with_a_default_for_all() -> None:
    from direct_frontend.fleet.describe import describe_fleet
    from direct_frontend.pipeline.ratelimit import Rates, RateTable

    fleet = tenants_fleet('[frontend.tenants]\nheader = "x-team"\nrequests_per_minute = 60\n'
                          '[[frontend.tenants.tenant]]\nname = "search"\n'
                          'tokens_per_minute = 90000\n'
                          '[[frontend.tenants.tenant]]\nname = "batch"\n'
                          'requests_per_minute = 0\n', {})
    table = RateTable(fleet.frontend.tenants)
    assert table.rates("h:search") == Rates(60, 90000)  # its own tokens, the default requests
    assert table.rates("h:batch") == Rates(0, 0)  # 0: no limit, whatever the default
    assert table.rates("h:anyone") == Rates(60, 0)
    assert ("; rate limits a minute: 60 requests each (search 60 requests and 90000 tokens, "
            "batch no limit)\n") in describe_fleet(fleet)
    with pytest.raises(FleetError, match="tokens_per_minute"):
        tenants_fleet("[frontend.tenants]\ntokens_per_minute = -1\n", {})
