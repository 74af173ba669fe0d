"""The commands as a newcomer meets them: real processes, one line per problem, no traceback."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.daemon import PROCESS_S, fleet_text, free_port, sim_engine, wait_for
from tests.support.http import http
from tests.support.sim import run as run_async

ROOT = Path(__file__).resolve().parents[1]
DAEMON = str(Path(sys.executable).with_name("direct-frontend"))


def cli(*args: str, timeout: float = 60,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command, with ``env`` added to this process's environment."""
    return subprocess.run([DAEMON, *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def one_line(text: str) -> str:
    assert "Traceback" not in text, text
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture()
def listening() -> Iterator[int]:
    """A port another process holds, as a second daemon finds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def fleet_file(tmp_path: Path, model_dir: Path, listen: str,
               engine: dict[str, object] | None = None) -> Path:
    """A fleet of one simulated engine listening on ``listen``."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(fleet_text(model_dir, [engine or sim_engine("a")]).replace(
        'listen = "127.0.0.1:0"', f'listen = "{listen}"'))
    return fleet


def copied_demo(tmp_path: Path) -> Path:
    """config/fleet.toml copied out of config/, as a newcomer does first."""
    fleet = tmp_path / "fleet.toml"
    shutil.copy(ROOT / "config" / "fleet.toml", fleet)
    return fleet


# -- a fleet file copied out of config/ ---------------------------------------------------


def test_check_and_run_name_a_tokenizer_that_is_not_there_in_one_line(tmp_path: Path) -> None:
    fleet = copied_demo(tmp_path)
    expected = (
        f"{fleet}:15: frontend.tokenizer: {tmp_path}/demo-model: not a model directory"
        f" (a relative path starts at the fleet file's directory, {tmp_path})"
    )
    checked = cli("check", str(fleet))
    assert checked.returncode == 2 and one_line(checked.stderr) == expected
    assert checked.stdout == ""
    ran = cli("run", str(fleet), timeout=60)
    assert ran.returncode == 2 and one_line(ran.stderr) == expected
    # Without the tokenizer, check still validates the file (a machine without the model).
    assert cli("check", "--no-tokenizer", str(fleet)).returncode == 0


def test_the_demo_fleets_simulated_ports_are_outside_the_ephemeral_range() -> None:
    """A port the kernel hands out to outgoing connections can be taken when the demo starts."""
    text = (ROOT / "config" / "fleet.toml").read_text()
    ports = [int(p) for p in re.findall(r'^url = "grpc://127\.0\.0\.1:(\d+)"', text, re.M)]
    assert ports
    low, high = 32768, 65535  # Linux's default range starts at 32768; BSD, macOS, Windows at 49152
    assert all(not low <= port <= high for port in ports), ports


def test_the_demo_fleet_checks_clean_with_its_tokenizer() -> None:
    checked = cli("check", str(ROOT / "config" / "fleet.toml"))
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr == ""


# -- busy ports -----------------------------------------------------------------------------


@pytest.mark.parametrize("binder", ["run: listen", "run: simulated engine", "simulate-engine"])
def test_a_busy_port_is_one_line_naming_the_address(
    binder: str, tmp_path: Path, model_dir: Path, listening: int
) -> None:
    busy = f"127.0.0.1:{listening}"
    in_use = "the address is already in use (is another daemon running?)"
    if binder == "run: listen":
        fleet = fleet_file(tmp_path, model_dir, busy)
        args = ["run", str(fleet)]
        expected = f"{fleet}:2: frontend.listen: cannot listen on {busy}: {in_use}"
    elif binder == "run: simulated engine":
        engine = sim_engine("a") | {"url": f"grpc://{busy}"}
        fleet = fleet_file(tmp_path, model_dir, f"127.0.0.1:{free_port()}", engine)
        line = fleet.read_text().splitlines().index(f'url = "grpc://{busy}"') + 1
        args = ["run", str(fleet)]
        expected = f"{fleet}:{line}: engine[1].url: cannot listen on {busy}: {in_use}"
    else:
        args = ["simulate-engine", "--port", str(listening)]
        reason = "Address already in use"
        expected = f"direct-frontend simulate-engine: cannot listen on {busy}: {reason}"
    ran = cli(*args, timeout=60)
    assert ran.returncode == 1
    assert one_line(ran.stderr) == expected


# -- exposure -------------------------------------------------------------------------------


def test_an_open_admin_side_beyond_loopback_is_warned_about(
    tmp_path: Path, model_dir: Path, listening: int
) -> None:
    production = ROOT / "config" / "examples" / "production.toml"
    checked = cli("check", "--no-tokenizer", str(production),
                  env={"DIRECT_FRONTEND_API_KEYS": "sk-example-1 sk-example-2"})
    assert checked.returncode == 0 and checked.stderr == ""  # the example is closed
    assert "sk-example" not in checked.stdout
    assert re.search(r"auth\.api_keys +2 \(redacted; read from \$DIRECT_FRONTEND_API_KEYS\)",
                     checked.stdout)
    unset = cli("check", "--no-tokenizer", str(production), env={"DIRECT_FRONTEND_API_KEYS": ""})
    assert unset.returncode == 2 and one_line(unset.stderr).endswith(
        "frontend.auth.api_keys_env: the environment variable DIRECT_FRONTEND_API_KEYS holds"
        " no keys")
    fleet = fleet_file(tmp_path, model_dir, f"0.0.0.0:{listening}")
    warning = (
        f"{fleet}:2: frontend.listen: 0.0.0.0:{listening} is reachable beyond loopback"
        " and the admin endpoints (/fleet, /fleet/reload, /fleet/events) need no token"
    )
    checked = cli("check", str(fleet))
    assert checked.returncode == 0
    assert one_line(checked.stderr).startswith(f"warning: {warning}")
    # run says it as a WARNING log line at start (here just before the busy port stops it).
    ran = cli("run", str(fleet), timeout=60)
    assert ran.returncode == 1
    logged = [line for line in ran.stderr.splitlines() if " WARNING " in line]
    assert len(logged) == 1 and warning in logged[0], ran.stderr


def test_open_openai_endpoints_beyond_loopback_are_warned_about(
    tmp_path: Path, model_dir: Path, listening: int
) -> None:
    """The admin side closed is not enough: the OpenAI endpoints without keys are said too."""
    fleet = fleet_file(tmp_path, model_dir, f"0.0.0.0:{listening}")
    fleet.write_text(fleet.read_text() + "\n[frontend.admin]\nenabled = false\n")
    warning = (
        f"{fleet}:2: frontend.listen: 0.0.0.0:{listening} is reachable beyond loopback and the"
        " OpenAI endpoints (/v1/..., /tokenize, /detokenize) need no key"
    )
    checked = cli("check", str(fleet))
    assert checked.returncode == 0
    assert one_line(checked.stderr).startswith(f"warning: {warning}")
    ran = cli("run", str(fleet), timeout=60)
    assert ran.returncode == 1  # the busy port, after the warning
    logged = [line for line in ran.stderr.splitlines() if " WARNING " in line]
    assert len(logged) == 1 and warning in logged[0], ran.stderr


# -- an empty fleet --------------------------------------------------------------------------


@contextlib.contextmanager
def daemon(fleet: Path) -> Iterator[tuple[str, list[str]]]:
    """``run --no-watch FLEET`` until the block ends; the list then holds its stderr."""
    port = int(fleet.read_text().split('listen = "127.0.0.1:')[1].split('"')[0])
    proc = subprocess.Popen([DAEMON, "run", "--no-watch", str(fleet)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            return http.get(url + "/ready").status_code == 200
        except httpx.TransportError:
            return False

    log: list[str] = []
    try:
        wait_for(ready, PROCESS_S, "the daemon to serve")
        yield url, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        log.append(proc.communicate(timeout=60)[1])


def test_a_truncated_file_is_refused_at_start_and_on_reload(
    tmp_path: Path, model_dir: Path
) -> None:
    fleet = fleet_file(tmp_path, model_dir, f"127.0.0.1:{free_port()}")
    full = fleet.read_text()
    truncated = full[: full.index("[[engine]]")]
    last_line = len(truncated.rstrip().splitlines())
    refusal = (
        f"{fleet}:{last_line}: engine: no [[engine]] or [[pool]] tables (is the file cut short?);"
        " add engines, or set allow_empty_fleet = true in [frontend] to run with none"
    )
    fleet.write_text(truncated)
    ran = cli("run", str(fleet), timeout=60)
    assert ran.returncode == 2 and one_line(ran.stderr) == refusal

    fleet.write_text(full)
    with daemon(fleet) as (url, log):
        fleet.write_text(truncated)
        http.post(url + "/fleet/reload")
        status = http.get(url + "/fleet").json()
        assert status["last_reload"]["ok"] is False
        assert status["last_reload"]["errors"] == [refusal]
        assert [e["name"] for e in status["engines"]] == ["a"]
        assert http.get(url + "/ready").status_code == 200
        # Said so explicitly, an empty fleet is a fleet.
        fleet.write_text(truncated.replace("[frontend.probe]",
                                           "allow_empty_fleet = true\n\n[frontend.probe]"))
        reload = http.post(url + "/fleet/reload").json()
        assert reload["ok"] is True and reload["diff"]["removed"] == ["a"]
    assert refusal in log[0]  # the log names the line and field too


# -- simulate-engine and --help -------------------------------------------------------------


def test_simulate_engine_defaults_to_the_bundled_demo_model() -> None:
    port = free_port()
    proc = subprocess.Popen([DAEMON, "simulate-engine", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"sim sglang engine listening on 127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err


def test_simulate_engine_serves_data_parallel_ranks() -> None:
    from grpclib.client import Channel

    from direct_frontend.protos import vllm_engine_pb2
    from direct_frontend.protos.vllm_engine_grpc import VllmEngineStub

    refused = cli("simulate-engine", "--kind", "trtllm", "--dp-size", "2")
    assert refused.returncode == 2 and "no data-parallel rank" in refused.stderr
    port = free_port()
    proc = subprocess.Popen([DAEMON, "simulate-engine", "--kind", "vllm", "--dp-size", "2",
                             "--port", str(port)], stdout=subprocess.PIPE, text=True)

    async def ask() -> tuple[int, int]:
        async with Channel("127.0.0.1", port) as channel:
            stub = VllmEngineStub(channel)
            server = await stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
            loads = await stub.GetLoads(vllm_engine_pb2.GetLoadsRequest())
            return server.data_parallel_size, len(loads.loads)

    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        assert run_async(ask()) == (2, 2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


@pytest.mark.parametrize("command", ["run", "check", "top", "simulate-engine"])
def test_help_reads_naturally(command: str) -> None:
    shown = cli(command, "--help")
    assert shown.returncode == 0
    assert "<bool>" not in shown.stdout
    if command in ("check", "top"):
        assert "[frontend.admin] token" in " ".join(shown.stdout.split())


def test_only_failures_of_the_machine_become_one_line() -> None:
    from direct_frontend.cli import _start_failure

    busy = OSError(98, "Address already in use")
    nested = ExceptionGroup("nursery", [ExceptionGroup("inner", [busy]), busy])
    assert _start_failure(nested) == "[Errno 98] Address already in use"
    denied = PermissionError(13, "Permission denied")
    assert _start_failure(denied) == "[Errno 13] Permission denied"
    # Anything else is a defect of ours: the traceback stays.
    assert _start_failure(ExceptionGroup("nursery", [busy, KeyError("x")])) is None
    assert _start_failure(RuntimeError("bug")) is None


def test_version_is_an_option_and_a_command() -> None:
    from direct_frontend import __version__

    assert one_line(cli("--version").stdout) == f"direct-frontend {__version__}"
    assert one_line(cli("version").stdout) == __version__


def test_check_against_a_url_with_credentials_never_prints_them(listening: int) -> None:
    secret = "pa55-in-the-url"
    urls = (f"http://admin:{secret}@127.0.0.1:{listening}", f"http://127.0.0.1:1?token={secret}")
    for url in urls:
        checked = cli("check", str(ROOT / "config" / "fleet.toml"), "--against", url, timeout=30)
        assert checked.returncode == 1
        assert "cannot fetch /fleet" in one_line(checked.stderr) and "<redacted>" in checked.stderr
        assert secret not in checked.stdout + checked.stderr
