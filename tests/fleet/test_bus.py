"""``[frontend.replicas]``'s NATS settings: the rules between keys, and a URL's secret kept out
of everything that shows the fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from direct_frontend.fleet import FleetError, describe_fleet, load_fleet, parse_fleet, to_jsonable
from direct_frontend.fleet.bus import scrubbed, shown_url
from direct_frontend.fleet.preflight import exposure_warnings

FLEET = """\
[frontend]
served_model_name = "demo"
tokenizer = "demo-model"

[[engine]]
url = "grpc://127.0.0.1:1"
kind = "sglang"

[frontend.replicas]
"""


def problems(replicas: str) -> str:
    with pytest.raises(FleetError) as refused:
        parse_fleet(FLEET + replicas, Path("/fleets/fleet.toml"))
    return str(refused.value)


@pytest.mark.parametrize("cluster", ["*", "a.>", "a..b", "a b"])
def test_a_cluster_that_is_not_a_plain_subject_prefix_is_refused(cluster: str) -> None:
    """A wildcard would subscribe this fleet to every other fleet's news on the server."""
    said = problems(f'nats = "nats://n:4222"\ncluster = "{cluster}"\n')
    assert "frontend.replicas.cluster" in said and "not a NATS subject prefix" in said


@pytest.mark.parametrize(("table", "field", "message"), [
    ('user = "u"\n', "user", "a user needs password_env or password_file"),
    ('password_env = "P"\n', "password_env", "a password needs user"),
    ('user = "u"\npassword_env = "P"\npassword_file = "p"\n', "password_file",
     "give password_env or password_file, not both"),
    ('user = "u"\npassword_env = "P"\ntoken_file = "t"\n', "token_file",
     "give one way to authenticate, not user and token_file"),
    ('token_env = "not a name"\n', "token_env", "'not a name' is not an environment variable name"),
    ('tls_cert = "c.pem"\n', "tls_cert", "tls_cert needs tls_key"),
])
def test_credentials_given_half_or_twice_are_named(table: str, field: str, message: str) -> None:
    said = problems('nats = "nats://n:4222"\n' + table)
    assert f"frontend.replicas.{field}: {message}" in said


def test_credentials_without_nats_and_a_bad_url_are_named_without_the_password() -> None:
    said = problems('token_file = "t"\ninsecure = true\n')
    assert "frontend.replicas.token_file: has no effect without nats" in said
    assert "frontend.replicas.insecure: has no effect without nats" in said
    said = problems('nats = "http://u:hunter22@n:4222"\n')
    assert "'http://<redacted>@n:4222' is not a nats:// or tls:// URL" in said
    assert "hunter22" not in said


def test_files_start_at_the_fleet_files_directory() -> None:
    fleet = parse_fleet(FLEET + 'nats = "tls://n:4222"\ncreds_file = "nats/fleet.creds"\n'
                        'tls_ca = "/etc/ca.pem"\n', Path("/fleets/fleet.toml"))
    replicas = fleet.frontend.replicas
    assert replicas.creds_file == "/fleets/nats/fleet.creds" and replicas.tls_ca == "/etc/ca.pem"
    assert replicas.wants_tls  # a tls:// URL requires it


def test_a_password_in_the_url_is_redacted_wherever_the_fleet_is_shown() -> None:
    fleet = parse_fleet(FLEET + 'nats = "nats://fleet:hunter22@n:4222"\n', Path("f.toml"))
    shown = describe_fleet(fleet) + json.dumps(to_jsonable(fleet)) + repr(fleet)
    assert "hunter22" not in shown
    assert "share over nats://<redacted>@n:4222 (cluster direct-frontend; credentials in the " \
           "URL, TLS if the server asks, open servers refused)" in describe_fleet(fleet)
    assert to_jsonable(fleet)["frontend"]["replicas"]["nats"] == "nats://<redacted>@n:4222"
    assert to_jsonable(fleet, redact=False)["frontend"]["replicas"]["nats"] == (
        "nats://fleet:hunter22@n:4222")  # a reload compares the real one
    assert shown_url("nats://tok3n@n:4222") == "nats://<redacted>@n:4222"
    url = "nats://fleet:hunter22@n:4222"
    assert scrubbed(f"nats: no servers: {url}", url) == "nats: no servers: nats://<redacted>@n:4222"
    assert shown_url("nats://n:4222") == "nats://n:4222"


def test_an_insecure_bus_is_a_warning_of_check_and_run(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET + 'nats = "nats://n:4222"\ninsecure = true\n')
    (warning,) = exposure_warnings(load_fleet(path))
    assert str(warning).startswith(f"{path}:11: frontend.replicas.insecure: the replicas "
                                   "accept a NATS server that lets any client in")
