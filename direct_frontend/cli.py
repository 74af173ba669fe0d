"""Command line: ``run``, ``check``, ``top``, ``simulate-engine``.

``trio_asyncio`` is imported first on purpose: grpclib captures asyncio
internals at import time, so on Python >= 3.12 it must see the patched ones.
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # noqa: F401  (must precede every grpclib import)

# isort: split
import json
import logging
import os
import pathlib
import sys
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Optional, TypeVar, cast, get_args

import typer

from direct_frontend import __version__

if TYPE_CHECKING:
    from direct_frontend.fleet.schema import FleetConfig

_T = TypeVar("_T")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help: rich's renders every flag as "<bool>" and eats "[frontend.admin]" as markup.
    rich_markup_mode=None,
    help="OpenAI-compatible router that talks gRPC directly to stock inference engines.",
)

def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"direct-frontend {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    """OpenAI-compatible router that talks gRPC directly to stock inference engines."""


FleetPath = Annotated[
    pathlib.Path, typer.Argument(metavar="FLEET", help="The fleet file (TOML).", show_default=False)
]


class LogLevel(StrEnum):
    """``--log-level`` choices (typer lists an enum's values in the help)."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


def _or_exit(load: Callable[[_T], object], what: _T) -> object:
    """``load(what)``, or each fleet-file problem on its own line and exit 2."""
    from direct_frontend.fleet.problems import FleetError

    try:
        return load(what)
    except FleetError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


def _load_or_exit(path: pathlib.Path) -> FleetConfig:
    from direct_frontend.fleet.load import load_fleet
    from direct_frontend.fleet.schema import FleetConfig

    return cast(FleetConfig, _or_exit(load_fleet, path))


def _warnings(config: FleetConfig) -> list[str]:
    """The fleet's exposure warnings, one line each."""
    from direct_frontend.fleet.preflight import exposure_warnings

    return [str(problem) for problem in exposure_warnings(config)]


@app.command()
def run(
    fleet: FleetPath,
    log_json: Annotated[
        Optional[bool],  # noqa: UP045  (typer needs Optional here)
        typer.Option("--log-json/--log-text",
                     help="One JSON object per log line, or text  [default: the fleet's log_json]"),
    ] = None,
    log_level: Annotated[
        LogLevel, typer.Option(case_sensitive=False, metavar="LEVEL",
                               help="DEBUG, INFO, WARNING or ERROR.")
    ] = LogLevel.INFO,
    watch: Annotated[
        bool, typer.Option("--watch/--no-watch", show_default=False,
                           help="Reload FLEET when the file changes (the default), or not.")
    ] = True,
    workers: Annotated[
        str | None,
        typer.Option(metavar="N", help="Processes serving the port: a number or 'auto' (one "
                                       "per core)  [default: the fleet's workers, 1]"),
    ] = None,
) -> None:
    """Serve the OpenAI API for the fleet described in FLEET.

    SIGHUP (systemctl reload) reloads FLEET; so does saving it, unless --no-watch.
    With --workers N, N processes serve one port (SO_REUSEPORT) and route as one.
    """
    from direct_frontend.control.workers import WorkerRole, resolve_count, run_workers
    from direct_frontend.daemon import run_daemon
    from direct_frontend.fleet.preflight import TextModelKey, busy_addresses, load_text_models
    from direct_frontend.observability.logging import configure_logging
    from direct_frontend.text.model_dir import TextModel

    config = _load_or_exit(fleet)
    text_models = cast(dict[TextModelKey, TextModel], _or_exit(load_text_models, config))
    role = WorkerRole.from_env(os.environ)
    configure_logging(json=config.frontend.log_json if log_json is None else log_json,
                      level=log_level.value, worker=None if role is None else role.index)
    log = logging.getLogger("direct_frontend")
    for warning in _warnings(config):
        log.warning("%s", warning)
    count = 1 if role is not None else resolve_count(_workers(workers, config.frontend.workers))
    busy = [] if role is not None else busy_addresses(config)  # a worker shares the port
    if busy:
        typer.echo("\n".join(str(problem) for problem in busy), err=True)
        raise typer.Exit(1)
    try:
        if count > 1:
            argv = [sys.executable, "-m", "direct_frontend.cli", "run", str(fleet),
                    "--log-level", log_level.value, "--watch" if watch else "--no-watch"]
            if log_json is not None:
                argv.append("--log-json" if log_json else "--log-text")
            code = run_workers(config, count, argv)
        else:
            code = run_daemon(config, watch=watch, text_models=text_models, worker=role)
    except Exception as exc:
        reason = _start_failure(exc)
        if reason is None:
            raise
        log.debug("the daemon could not start", exc_info=exc)
        typer.echo(f"direct-frontend: cannot start: {reason}"
                   " (--log-level DEBUG shows where)", err=True)
        raise typer.Exit(1) from None
    sys.exit(code)


def _workers(option: str | None, configured: int) -> int:
    """``--workers`` (a number or ``auto``, read as 0) over the fleet's ``workers``."""
    if option is None:
        return configured
    if option == "auto":
        return 0
    if not option.isdigit() or int(option) < 1:
        typer.echo(f"--workers: expected a number of at least 1 or 'auto', got {option!r}",
                   err=True)
        raise typer.Exit(2)
    return int(option)


def _start_failure(exc: BaseException) -> str | None:
    """One line for a daemon that failed on the system (a port, a file), None for a bug.

    Trio nests what failed in exception groups; only when every failure in
    them is an ``OSError`` (or a store's database that cannot be used) is it
    the machine's answer rather than our defect.
    """
    leaves: list[BaseException] = []
    pending = [exc]
    while pending:
        current = pending.pop()
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        else:
            leaves.append(current)
    from direct_frontend.state.sql import StoreError  # a database that cannot be used

    if leaves and all(isinstance(leaf, (OSError, StoreError)) for leaf in leaves):
        return "; ".join(dict.fromkeys(
            f"[frontend.responses] store: {leaf}" if isinstance(leaf, StoreError) else str(leaf)
            for leaf in leaves))
    return None


AdminToken = Annotated[
    str | None,
    typer.Option("--admin-token", envvar="DIRECT_FRONTEND_ADMIN_TOKEN", show_envvar=True,
                 metavar="TOKEN",
                 help="The daemon's [frontend.admin] token (prefer the environment variable)."),
]


@app.command()
def check(
    fleet: FleetPath,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the resolved fleet (or the diff) as JSON.")
    ] = False,
    against: Annotated[
        str | None,
        typer.Option(metavar="URL",
                     help="A running daemon's URL: print what reloading FLEET there would "
                          "change (a dry run; nothing is applied)."),
    ] = None,
    admin_token: AdminToken = None,
    no_tokenizer: Annotated[
        bool, typer.Option("--no-tokenizer", help="Check the file alone, without loading the "
                                                  "tokenizer (on a machine without the model).")
    ] = False,
) -> None:
    """Validate FLEET, load its tokenizer and print the resolved fleet (exit 2 on errors).

    Warnings (a daemon open to the network) go to stderr. With --against URL,
    print what a reload would change instead (exit 1 if the daemon cannot be
    asked); the tokenizer is not loaded then, as it may live on the daemon's
    machine only (and changing it needs a restart anyway). Secrets are
    compared by presence only.
    """
    from direct_frontend.fleet.describe import describe_fleet, to_jsonable
    from direct_frontend.fleet.preflight import load_text_models

    config = _load_or_exit(fleet)
    for warning in _warnings(config):
        typer.echo(f"warning: {warning}", err=True)
    if against is not None:
        _check_against(config, against, admin_token, as_json)
        return
    if not no_tokenizer:
        _or_exit(load_text_models, config)
    store = _reach_store(config)
    if as_json:
        typer.echo(json.dumps(to_jsonable(config), indent=2))
    else:
        typer.echo(describe_fleet(config))
        if store is not None:
            typer.echo(f"\nstore: {store}")


def _reach_store(config: FleetConfig) -> str | None:
    """The stored responses' database reached (exit 2 if it cannot be used); None: none kept."""
    from direct_frontend.state.backends import check_reachable
    from direct_frontend.state.sql import StoreError

    responses = config.frontend.responses
    if not responses.store:
        return None
    try:
        return check_reachable(responses, config.source)
    except StoreError as exc:
        typer.echo(f"{config.source}: frontend.responses: the {responses.backend} store cannot "
                   f"be used: {exc}", err=True)
        raise typer.Exit(2) from None


def _check_against(config: FleetConfig, url: str, token: str | None, as_json: bool) -> None:
    import urllib.error
    import urllib.request

    from direct_frontend.fleet.describe import to_jsonable
    from direct_frontend.fleet.diff import as_in_file, diff_fleet_data
    from direct_frontend.observability.redact import redact_url, scrub, url_secrets

    base = url if "://" in url else f"http://{url}"
    request = urllib.request.Request(base.rstrip("/") + "/fleet")
    base = redact_url(base)  # as shown from here on
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
        typer.echo(f"{base}: cannot fetch /fleet: {scrub(str(exc), url_secrets(url))}",
                   err=True)
        raise typer.Exit(1) from None
    diff = diff_fleet_data(as_in_file(running["fleet"]), to_jsonable(config))
    if as_json:
        typer.echo(json.dumps(diff.to_json(), indent=2))
        return
    version = running.get("config", {}).get("version", "?")
    typer.echo(f"{config.source} against {base} (running config v{version}):")
    for line in diff.lines():
        typer.echo(f"  {line}")


@app.command()
def top(
    url: Annotated[str, typer.Argument(
        metavar="URL", help="The daemon's base URL, e.g. http://127.0.0.1:8000")],
    admin_token: AdminToken = None,
    colour: Annotated[bool, typer.Option(
        "--colour/--no-colour", show_default=False,
        help="Colour on a terminal unless NO_COLOR is set (the default), or never.")] = True,
) -> None:
    """Show the fleet live (engines, states, load, reloads); follows daemon restarts. q quits."""
    from direct_frontend.top import run_top

    sys.exit(run_top(url, admin_token, sys.stdout, keys=sys.stdin,
                     colour=colour and sys.stdout.isatty() and "NO_COLOR" not in os.environ))


@app.command("simulate-engine")
def simulate_engine(
    kind: Annotated[str, typer.Option(help="sglang, vllm or trtllm.")] = "sglang",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 50051,
    model_dir: Annotated[
        pathlib.Path | None,
        typer.Option(metavar="DIR", help="Model directory with tokenizer.json (vocab and EOS "
                                         "come from it)  [default: the bundled demo model]"),
    ] = None,
    served_model_name: Annotated[str, typer.Option()] = "demo",
    context_length: Annotated[int, typer.Option()] = 4096,
    prefill_us_per_token: Annotated[float, typer.Option()] = 20.0,
    decode_us_per_token: Annotated[float, typer.Option()] = 2000.0,
    max_running: Annotated[int, typer.Option()] = 64,
    eos_probability: Annotated[float, typer.Option()] = 0.02,
    multibyte_probability: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="Chance per token of a non-ASCII character split over several "
                               "tokens (0: plain ASCII words).")] = 0.0,
    role: Annotated[str, typer.Option(help="both, prefill or decode.")] = "both",
    block_size: Annotated[int, typer.Option(help="KV block (page) size of the prefix cache.")] = 16,
    kv_capacity_blocks: Annotated[
        int | None, typer.Option(help="Prefix-cache capacity in blocks.")
    ] = None,
    kv_events_port: Annotated[
        int | None, typer.Option(help="Publish KV events on tcp://HOST:PORT.")
    ] = None,
    kv_replay_port: Annotated[
        int | None, typer.Option(help="Serve KV-event replay on this port.")
    ] = None,
    embedding_dim: Annotated[
        int, typer.Option(min=0, help="Serve an embedding model of N dimensions (0: generation).")
    ] = 0,
    dp_size: Annotated[
        int, typer.Option(min=1, help="Data-parallel ranks behind the one server, each with its "
                                      "own prefix cache and KV events on --kv-events-port + rank.")
    ] = 1,
    fault_die_after: Annotated[
        int | None, typer.Option(help="Drop the connection after N tokens.")
    ] = None,
    fault_hang_after: Annotated[
        int | None, typer.Option(help="Stop sending after N tokens.")
    ] = None,
    fault_status: Annotated[
        str | None,
        typer.Option(help="End Generate with this gRPC status (e.g. UNAVAILABLE)."),
    ] = None,
    fault_status_after: Annotated[int, typer.Option(help="... after N tokens.")] = 0,
    fault_token_delay_ms: Annotated[float, typer.Option(help="Extra delay per token.")] = 0.0,
    fault_only_request: Annotated[
        int | None, typer.Option(help="Apply the faults to the Nth request only.")
    ] = None,
    control_port: Annotated[
        int | None,
        typer.Option(help="JSON-lines control socket for faults at run time (0: any port)."),
    ] = None,
) -> None:
    """Serve a simulated engine speaking the stock gRPC contract of --kind."""
    from direct_frontend.simulator.cli import fault_plan
    from direct_frontend.simulator.cli import run as run_simulator
    from direct_frontend.simulator.model import TimingModel
    from direct_frontend.simulator.settings import EngineConfig, EngineKind, SimRole
    from direct_frontend.text.demo_model import BUNDLED_DIR

    kinds, roles = get_args(EngineKind), get_args(SimRole)
    if kind not in kinds:
        raise typer.BadParameter(f"{kind!r}: expected {_one_of(kinds)}", param_hint="--kind")
    if role not in roles:
        raise typer.BadParameter(f"{role!r}: expected {_one_of(roles)}", param_hint="--role")
    if kind == "trtllm" and embedding_dim:
        raise typer.BadParameter("the TRT-LLM contract serves no embeddings",
                                 param_hint="--embedding-dim")
    if kind == "trtllm" and dp_size != 1:
        raise typer.BadParameter("the TRT-LLM contract has no data-parallel rank",
                                 param_hint="--dp-size")
    model_dir = BUNDLED_DIR if model_dir is None else model_dir
    if not (model_dir / "tokenizer.json").is_file():
        raise typer.BadParameter(f"{model_dir}: no tokenizer.json there", param_hint="--model-dir")
    config = EngineConfig.from_model_dir(
        cast(EngineKind, kind), model_dir, served_model_name=served_model_name,
        context_length=context_length, role=cast(SimRole, role),
        timing=TimingModel(prefill_us_per_token, decode_us_per_token, max_running),
        eos_probability=eos_probability, unit_probability=multibyte_probability,
        block_size=block_size, page_size=block_size, kv_capacity_blocks=kv_capacity_blocks,
        kv_events_port=kv_events_port, kv_replay_port=kv_replay_port,
        embedding_dim=embedding_dim, dp_size=dp_size,
    )
    faults = fault_plan(
        fault_die_after=fault_die_after, fault_hang_after=fault_hang_after,
        fault_status=fault_status, fault_status_after=fault_status_after,
        fault_token_delay_ms=fault_token_delay_ms, fault_only_request=fault_only_request,
    )
    try:
        run_simulator(config, host, port, faults=faults, control_port=control_port)
    except OSError as exc:  # a busy or unknown address: the machine's answer, not a bug
        reason = exc.strerror or str(exc)
        typer.echo(f"direct-frontend simulate-engine: cannot listen on {host}:{port}: {reason}",
                   err=True)
        raise typer.Exit(1) from None


def _one_of(choices: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}"


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def main() -> None:
    app()


if __name__ == "__main__":  # how ``run --workers`` starts its workers
    main()
