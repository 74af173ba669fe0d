"""What ``check`` and ``run`` verify beyond the file: the tokenizer, free addresses, exposure."""

from __future__ import annotations

import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from direct_frontend.fleet import FleetError, load_fleet
from direct_frontend.fleet.preflight import busy_addresses, exposure_warnings, load_text_model
from tests.support.daemon import free_port


def fleet_file(tmp_path: Path, frontend: str, engines: str = "") -> Path:
    path = tmp_path / "fleet.toml"
    engines = engines or '[[engine]]\nurl = "grpc://10.0.0.9:50051"\nkind = "vllm"\n'
    path.write_text(
        textwrap.dedent(frontend).rstrip("\n") + '\nserved_model_name = "demo"\n\n' + engines
    )
    return path


@pytest.fixture()
def listening() -> Iterator[socket.socket]:
    """A socket listening on a loopback port, as another daemon's would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


# -- the tokenizer ---------------------------------------------------------------


def test_a_tokenizer_path_relative_to_a_copied_file_is_named_with_its_line(
    tmp_path: Path,
) -> None:
    path = fleet_file(tmp_path, '[frontend]\nlisten = "127.0.0.1:0"\ntokenizer = "demo-model"')
    with pytest.raises(FleetError) as caught:
        load_text_model(load_fleet(path))
    assert str(caught.value) == (
        f"{path}:3: frontend.tokenizer: {tmp_path}/demo-model: not a model directory"
        f" (a relative path starts at the fleet file's directory, {tmp_path})"
    )


def test_a_broken_absolute_tokenizer_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    path = fleet_file(tmp_path, f'[frontend]\ntokenizer = "{tmp_path}/model"')
    with pytest.raises(FleetError) as caught:
        load_text_model(load_fleet(path))
    assert str(caught.value) == (
        f"{path}:2: frontend.tokenizer: {tmp_path}/model/tokenizer.json: file missing"
    )


def test_a_good_tokenizer_loads(tmp_path: Path, model_dir: Path) -> None:
    path = fleet_file(tmp_path, f'[frontend]\ntokenizer = "{model_dir}"')
    assert load_text_model(load_fleet(path)).has_chat_template


# -- addresses the daemon binds at start ----------------------------------------------


def test_busy_addresses_name_the_field_and_the_address(
    tmp_path: Path, listening: socket.socket
) -> None:
    busy = listening.getsockname()[1]
    free = free_port()
    engines = "".join(
        f'[[engine]]\nurl = "grpc://127.0.0.1:{port}"\nkind = "sglang"\nsimulate = true\n\n'
        for port in (free, busy)
    ) + '[[engine]]\nurl = "grpc://10.0.0.9:50051"\nkind = "vllm"\n'  # not ours to bind
    path = fleet_file(
        tmp_path, f'[frontend]\nlisten = "127.0.0.1:{busy}"\ntokenizer = "m"', engines
    )
    in_use = "the address is already in use (is another daemon running?)"
    assert [str(p) for p in busy_addresses(load_fleet(path))] == [
        f"{path}:2: frontend.listen: cannot listen on 127.0.0.1:{busy}: {in_use}",
        f"{path}:12: engine[2].url: cannot listen on 127.0.0.1:{busy}: {in_use}",
    ]


def test_free_addresses_and_port_zero_pass(tmp_path: Path) -> None:
    for listen in (f"127.0.0.1:{free_port()}", "127.0.0.1:0"):
        path = fleet_file(tmp_path, f'[frontend]\nlisten = "{listen}"\ntokenizer = "m"')
        assert busy_addresses(load_fleet(path)) == []


def test_an_address_that_is_not_this_machines_is_named(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, '[frontend]\nlisten = "192.0.2.1:8000"\ntokenizer = "m"')
    (problem,) = busy_addresses(load_fleet(path))
    assert str(problem).startswith(f"{path}:2: frontend.listen: cannot listen on 192.0.2.1:8000: ")


# -- exposure -------------------------------------------------------------------------


@pytest.mark.parametrize("listen", ["0.0.0.0:8000", "[::]:8000", "10.1.2.3:8000", "gpu-1:80"])
def test_listening_beyond_loopback_without_an_admin_token_warns(
    tmp_path: Path, listen: str
) -> None:
    path = fleet_file(tmp_path, f'[frontend]\nlisten = "{listen}"\ntokenizer = "m"')
    (warning,) = exposure_warnings(load_fleet(path))
    assert str(warning) == (
        f"{path}:2: frontend.listen: {listen} is reachable beyond loopback and the admin"
        " endpoints (/fleet, /fleet/reload, /fleet/events) need no token: set"
        " [frontend.admin] token, or enabled = false; the OpenAI endpoints are open too"
        " (no [frontend.auth] api_keys)"
    )


def test_api_keys_are_not_asked_for_once_set(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, '[frontend]\nlisten = "0.0.0.0:8000"\ntokenizer = "m"',
                      '[frontend.auth]\napi_keys = ["sk-1"]\n\n'
                      '[[engine]]\nurl = "grpc://10.0.0.9:1"\nkind = "vllm"\n')
    (warning,) = exposure_warnings(load_fleet(path))
    assert "need no token" in str(warning) and "OpenAI" not in str(warning)


@pytest.mark.parametrize("admin", ['token = "a-long-random-token"', "enabled = false"])
def test_a_closed_admin_side_beyond_loopback_still_warns_of_open_openai_endpoints(
    tmp_path: Path, admin: str
) -> None:
    path = fleet_file(tmp_path, '[frontend]\nlisten = "0.0.0.0:8000"\ntokenizer = "m"',
                      f"[frontend.admin]\n{admin}\n\n"
                      '[[engine]]\nurl = "grpc://10.0.0.9:1"\nkind = "vllm"\n')
    (warning,) = exposure_warnings(load_fleet(path))
    assert str(warning) == (
        f"{path}:2: frontend.listen: 0.0.0.0:8000 is reachable beyond loopback and the OpenAI"
        " endpoints (/v1/..., /tokenize, /detokenize) need no key: set [frontend.auth]"
        " api_keys, api_keys_env or api_keys_file"
    )


KEYS = '[frontend.auth]\napi_keys = ["sk-1"]\n\n'


@pytest.mark.parametrize(
    ("listen", "admin"),
    [
        ("127.0.0.1:8000", ""),
        ("[::1]:8000", ""),
        ("localhost:8000", ""),
        ("0.0.0.0:8000", '[frontend.admin]\ntoken = "a-long-random-token"\n\n' + KEYS),
        ("0.0.0.0:8000", "[frontend.admin]\nenabled = false\n\n" + KEYS),
    ],
)
def test_loopback_or_a_closed_admin_side_is_quiet(tmp_path: Path, listen: str, admin: str) -> None:
    path = fleet_file(tmp_path, f'[frontend]\nlisten = "{listen}"\ntokenizer = "m"',
                      admin + '[[engine]]\nurl = "grpc://10.0.0.9:1"\nkind = "vllm"\n')
    assert exposure_warnings(load_fleet(path)) == []
