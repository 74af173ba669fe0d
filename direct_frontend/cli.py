"""Command line: ``run``, ``check``, ``top``, ``simulate-engine``.

``trio_asyncio`` is imported first on purpose: grpclib captures asyncio
internals at import time, so on Python >= 3.12 it must see the patched ones.
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # noqa: F401  (must precede every grpclib import)

# isort: split
import json
import os
import pathlib
import sys
from typing import Annotated, Optional, cast, get_args

import typer

from direct_frontend import __version__

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="OpenAI-compatible router that talks gRPC directly to stock inference engines.",
)

FleetPath = Annotated[pathlib.Path, typer.Argument(help="The fleet file (TOML).")]


def _load_or_exit(path: pathlib.Path):  # type: ignore[no-untyped-def]
    from direct_frontend.fleet.load import FleetError, load_fleet

    try:
        return load_fleet(path)
    except FleetError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    fleet: FleetPath,
    log_json: Annotated[
        Optional[bool],  # noqa: UP045  (typer needs Optional here)
        typer.Option("--log-json/--log-text", help="One JSON object per log line."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
    watch: Annotated[
        bool, typer.Option("--watch/--no-watch", help="Reload FLEET when the file changes.")
    ] = True,
) -> None:
    """Serve the OpenAI API for the fleet described in FLEET.

    SIGHUP (systemctl reload) reloads FLEET; so does saving it, unless --no-watch.
    """
    from direct_frontend.daemon import run_daemon
    from direct_frontend.observability.logging import configure_logging

    config = _load_or_exit(fleet)
    configure_logging(json=config.frontend.log_json if log_json is None else log_json,
                      level=log_level.upper())
    sys.exit(run_daemon(config, watch=watch))


AdminToken = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--admin-token", envvar="DIRECT_FRONTEND_ADMIN_TOKEN", show_envvar=True,
                 help="The daemon's [frontend.admin] token (prefer the environment variable)."),
]


@app.command()
def check(
    fleet: FleetPath,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the resolved fleet (or the diff) as JSON.")
    ] = False,
    against: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="A running daemon's URL: print what reloading FLEET there would "
                          "change (a dry run; nothing is applied)."),
    ] = None,
    admin_token: AdminToken = None,
) -> None:
    """Validate FLEET and print the resolved fleet (exit 2 on errors).

    With --against URL, print what a reload would change instead (exit 1 if
    the daemon cannot be asked). Secrets are compared by presence only.
    """
    from direct_frontend.fleet.describe import describe_fleet, to_jsonable

    config = _load_or_exit(fleet)
    if against is not None:
        _check_against(config, against, admin_token, as_json)
        return
    if as_json:
        typer.echo(json.dumps(to_jsonable(config), indent=2))
    else:
        typer.echo(describe_fleet(config))


def _check_against(config: object, url: str, token: str | None, as_json: bool) -> None:
    import urllib.error
    import urllib.request

    from direct_frontend.fleet.describe import to_jsonable
    from direct_frontend.fleet.diff import diff_fleet_data
    from direct_frontend.fleet.schema import FleetConfig

    assert isinstance(config, FleetConfig)
    base = url if "://" in url else f"http://{url}"
    request = urllib.request.Request(base.rstrip("/") + "/fleet")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            running = json.load(response)
    except urllib.error.HTTPError as exc:
        hint = {401: " (give --admin-token)", 404: " (is [frontend.admin] enabled?)"}
        typer.echo(f"{base}: HTTP {exc.code}{hint.get(exc.code, '')}", err=True)
        raise typer.Exit(1) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        typer.echo(f"{base}: cannot fetch /fleet: {exc}", err=True)
        raise typer.Exit(1) from None
    diff = diff_fleet_data(running["fleet"], to_jsonable(config))
    if as_json:
        typer.echo(json.dumps(diff.to_json(), indent=2))
        return
    version = running.get("config", {}).get("version", "?")
    typer.echo(f"{config.source} against {base} (running config v{version}):")
    for line in diff.lines():
        typer.echo(f"  {line}")


@app.command()
def top(
    url: Annotated[str, typer.Argument(help="The daemon's base URL, e.g. http://127.0.0.1:8000")],
    admin_token: AdminToken = None,
    colour: Annotated[bool, typer.Option("--colour/--no-colour")] = True,
) -> None:
    """Show the fleet live (engines, states, load, reloads); follows daemon restarts."""
    from direct_frontend.top import run_top

    sys.exit(run_top(url, admin_token, sys.stdout,
                     colour=colour and sys.stdout.isatty() and "NO_COLOR" not in os.environ))


@app.command("simulate-engine")
def simulate_engine(
    kind: Annotated[str, typer.Option(help="sglang, vllm or trtllm.")] = "sglang",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 50051,
    model_dir: Annotated[
        Optional[pathlib.Path],  # noqa: UP045
        typer.Option(help="Model directory with tokenizer.json (vocab and EOS come from it)."),
    ] = None,
    served_model_name: Annotated[str, typer.Option()] = "demo",
    context_length: Annotated[int, typer.Option()] = 4096,
    prefill_us_per_token: Annotated[float, typer.Option()] = 20.0,
    decode_us_per_token: Annotated[float, typer.Option()] = 2000.0,
    max_running: Annotated[int, typer.Option()] = 64,
    eos_probability: Annotated[float, typer.Option()] = 0.02,
    role: Annotated[str, typer.Option(help="both, prefill or decode.")] = "both",
    block_size: Annotated[int, typer.Option(help="KV block (page) size of the prefix cache.")] = 16,
    kv_capacity_blocks: Annotated[
        Optional[int], typer.Option(help="Prefix-cache capacity in blocks.")  # noqa: UP045
    ] = None,
    kv_events_port: Annotated[
        Optional[int], typer.Option(help="Publish KV events on tcp://HOST:PORT.")  # noqa: UP045
    ] = None,
    kv_replay_port: Annotated[
        Optional[int], typer.Option(help="Serve KV-event replay on this port.")  # noqa: UP045
    ] = None,
    fault_die_after: Annotated[
        Optional[int], typer.Option(help="Drop the connection after N tokens.")  # noqa: UP045
    ] = None,
    fault_hang_after: Annotated[
        Optional[int], typer.Option(help="Stop sending after N tokens.")  # noqa: UP045
    ] = None,
    fault_status: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="End Generate with this gRPC status (e.g. UNAVAILABLE)."),
    ] = None,
    fault_status_after: Annotated[int, typer.Option(help="... after N tokens.")] = 0,
    fault_token_delay_ms: Annotated[float, typer.Option(help="Extra delay per token.")] = 0.0,
    fault_only_request: Annotated[
        Optional[int], typer.Option(help="Apply the faults to the Nth request only.")  # noqa: UP045
    ] = None,
    control_port: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="JSON-lines control socket for faults at run time (0: any port)."),
    ] = None,
) -> None:
    """Serve a simulated engine speaking the stock gRPC contract of KIND."""
    from direct_frontend.simulator.cli import run as run_simulator
    from direct_frontend.simulator.core import EngineKind, SimRole

    kinds, roles = get_args(EngineKind), get_args(SimRole)
    if kind not in kinds:
        raise typer.BadParameter(f"{kind!r}: expected {_one_of(kinds)}", param_hint="--kind")
    if role not in roles:
        raise typer.BadParameter(f"{role!r}: expected {_one_of(roles)}", param_hint="--role")
    run_simulator(
        kind=cast(EngineKind, kind), host=host, port=port,
        model_dir=str(model_dir) if model_dir else None,
        served_model_name=served_model_name, context_length=context_length,
        prefill_us_per_token=prefill_us_per_token, decode_us_per_token=decode_us_per_token,
        max_running=max_running, eos_probability=eos_probability,
        role=cast(SimRole, role),
        fault_die_after=fault_die_after, fault_hang_after=fault_hang_after,
        fault_status=fault_status, fault_status_after=fault_status_after,
        fault_token_delay_ms=fault_token_delay_ms, fault_only_request=fault_only_request,
        control_port=control_port,
        options={
            "block_size": block_size, "page_size": block_size,
            "kv_capacity_blocks": kv_capacity_blocks,
            "kv_events_port": kv_events_port, "kv_replay_port": kv_replay_port,
        },
    )


def _one_of(choices: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}"


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def main() -> None:
    app()
