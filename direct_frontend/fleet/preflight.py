"""What ``check`` and ``run`` verify beyond the file's own text, each as a fleet-file problem.

The loader only reads the file (a reload must not touch anything else); these
checks look at the world the file names: whether the tokenizer directory
loads, whether the addresses the daemon binds at start are free, and whether
the daemon would be open to the network. Each answer is a
:class:`~direct_frontend.fleet.problems.FleetProblem` carrying the file, the
line and the field, so ``check`` and ``run`` report them the way they report
a typo: one line each.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import tomllib
from pathlib import Path

from direct_frontend.fleet.address import is_loopback, split_url
from direct_frontend.fleet.locate import KeyPath, Locator
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import FleetConfig
from direct_frontend.text.model_dir import ModelDirError, TextModel


class _Where:
    """Lines of the fleet file's fields, read again from the file (best effort)."""

    def __init__(self, source: Path) -> None:
        self.file = str(source)
        try:
            text = source.read_text(encoding="utf-8").removeprefix("\ufeff")
            self.data: dict[str, object] = tomllib.loads(text)
            self.locator: Locator | None = Locator(text)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            self.data, self.locator = {}, None  # changed since it was loaded: no lines

    def problem(self, path: KeyPath, field: str, message: str) -> FleetProblem:
        line = None if self.locator is None else self.locator.line_of(path)
        return FleetProblem(self.file, line, field, message)


def load_text_model(fleet: FleetConfig) -> TextModel:
    """Load the fleet's tokenizer, or raise :class:`FleetError` naming ``frontend.tokenizer``."""
    try:
        return TextModel.load(fleet.frontend.tokenizer)
    except ModelDirError as exc:
        where = _Where(fleet.source)
        message = str(exc)
        frontend = where.data.get("frontend")
        written = frontend.get("tokenizer") if isinstance(frontend, dict) else None
        if isinstance(written, str) and not Path(written).is_absolute():
            base = fleet.source.parent.absolute()
            message += f" (a relative path starts at the fleet file's directory, {base})"
        path: KeyPath = ("frontend", "tokenizer")
        raise FleetError([where.problem(path, "frontend.tokenizer", message)]) from None


def busy_addresses(fleet: FleetConfig) -> list[FleetProblem]:
    """The addresses the daemon binds at start (HTTP, simulated engines) that it cannot bind.

    Binding and closing again is racy by nature; it turns the common case (a
    second daemon on the same fleet) into one line before anything starts.
    """
    where: _Where | None = None
    problems: list[FleetProblem] = []
    frontend = fleet.frontend
    wanted: list[tuple[KeyPath, str, str, int]] = [
        (("frontend", "listen"), "frontend.listen", frontend.listen_host, frontend.listen_port)
    ]
    for index, engine in enumerate(fleet.engines, 1):
        endpoint = split_url(engine.url, "grpc") if engine.simulate else None
        if isinstance(endpoint, tuple):
            wanted.append((("engine", index, "url"), f"engine[{index}].url", *endpoint))
    for path, field, host, port in wanted:
        reason = _bind_failure(host, port)
        if reason is not None:
            where = where or _Where(fleet.source)
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            problems.append(where.problem(path, field, f"cannot listen on {address}: {reason}"))
    return problems


def _bind_failure(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound the way the daemon binds it (None: it can)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return str(exc.strerror or exc)
    family, kind, proto, _, address = infos[0]
    with contextlib.closing(socket.socket(family, kind, proto)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the address is already in use (is another daemon running?)"
            return str(exc.strerror or exc)
    return None


def exposure_warnings(fleet: FleetConfig) -> list[FleetProblem]:
    """Warnings for a daemon reachable beyond loopback with its admin endpoints open.

    The admin endpoints show the fleet and reload it; the OpenAI endpoints
    spend GPU time. Neither is a file error (a firewall may be in front), so
    these are warnings, said loudly at start and by ``check``.
    """
    frontend = fleet.frontend
    if is_loopback(frontend.listen_host) or not frontend.admin.enabled or frontend.admin.token:
        return []
    message = (
        f"{frontend.listen} is reachable beyond loopback and the admin endpoints"
        " (/fleet, /fleet/reload, /fleet/events) need no token: set [frontend.admin] token,"
        " or enabled = false"
    )
    if not frontend.auth.api_keys:
        message += "; the OpenAI endpoints are open too (no [frontend.auth] api_keys)"
    return [_Where(fleet.source).problem(("frontend", "listen"), "frontend.listen", message)]
