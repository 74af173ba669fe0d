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

from direct_frontend.fleet.address import endpoint_text, is_loopback, split_url
from direct_frontend.fleet.checker import field_name
from direct_frontend.fleet.locate import KeyPath, Locator
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import FleetConfig, ModelConfig
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


#: what a model's text handling is loaded from: its tokenizer directory and template file
TextModelKey = tuple[Path, Path | None]


def text_model_key(model: ModelConfig) -> TextModelKey:
    return model.tokenizer, model.chat_template


def load_text_model(fleet: FleetConfig) -> TextModel:
    """Load the fleet's first model's tokenizer (see :func:`load_text_models`)."""
    return load_text_models(fleet)[text_model_key(fleet.models[0])]


def load_text_models(
    fleet: FleetConfig, loaded: dict[TextModelKey, TextModel] | None = None
) -> dict[TextModelKey, TextModel]:
    """Every model's tokenizer, each loaded once (``loaded`` ones are reused).

    Raises :class:`FleetError` naming the tokenizer (``frontend.tokenizer`` or
    ``model[i].tokenizer``) or template that does not load, one problem each.
    """
    out: dict[TextModelKey, TextModel] = {}
    problems: list[FleetProblem] = []
    where: _Where | None = None
    for index, model in enumerate(fleet.models, 1):
        key = text_model_key(model)
        if key in out:
            continue
        if loaded is not None and key in loaded:
            out[key] = loaded[key]
            continue
        try:
            out[key] = TextModel.load(model.tokenizer, model.chat_template)
        except ModelDirError as exc:
            where = where or _Where(fleet.source)
            table: KeyPath = ("frontend",) if model.implicit else ("model", index)
            template = model.chat_template
            key_name = (
                "chat_template" if template is not None and str(exc).startswith(str(template))
                else "tokenizer"
            )
            if _written(where.data, table).get(key_name) is None:
                table = ("frontend",)  # the model falls back on frontend.tokenizer
            message = str(exc)
            text = _written(where.data, table).get(key_name)
            if isinstance(text, str) and not Path(text).is_absolute():
                base = fleet.source.parent.absolute()
                message += f" (a relative path starts at the fleet file's directory, {base})"
            path: KeyPath = (*table, key_name)
            problems.append(where.problem(path, field_name(path), message))
    if problems:
        raise FleetError(problems)
    return out


def _written(data: dict[str, object], table: KeyPath) -> dict[str, object]:
    """The table at ``table`` as written in the file ({} if it is not there)."""
    value: object = data
    for part in table:
        if isinstance(value, dict):
            value = value.get(str(part))
        elif isinstance(value, list) and isinstance(part, int) and 0 < part <= len(value):
            value = value[part - 1]
        else:
            return {}
    return value if isinstance(value, dict) else {}


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
            address = endpoint_text((host, port))
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
    """Warnings for a daemon reachable beyond loopback with its admin or OpenAI endpoints open.

    The admin endpoints show the fleet and reload it; the OpenAI endpoints
    spend GPU time. Neither is a file error (a firewall or an authenticating
    proxy may be in front), so these are warnings, said loudly at start and by
    ``check``: one line naming whichever is open.
    """
    frontend = fleet.frontend
    warnings = _replicas_warnings(fleet)
    if is_loopback(frontend.listen_host):
        return warnings
    admin_open = frontend.admin.enabled and not frontend.admin.token
    if admin_open:
        message = (
            f"{frontend.listen} is reachable beyond loopback and the admin endpoints"
            " (/fleet, /fleet/reload, /fleet/events) need no token: set [frontend.admin] token,"
            " or enabled = false"
        )
        if not frontend.auth.api_keys:
            message += "; the OpenAI endpoints are open too (no [frontend.auth] api_keys)"
    elif not frontend.auth.api_keys:
        message = (
            f"{frontend.listen} is reachable beyond loopback and the OpenAI endpoints"
            " (/v1/..., /tokenize, /detokenize) need no key: set [frontend.auth] api_keys,"
            " api_keys_env or api_keys_file"
        )
    else:
        return warnings
    where = _Where(fleet.source)
    return [where.problem(("frontend", "listen"), "frontend.listen", message), *warnings]


def _replicas_warnings(fleet: FleetConfig) -> list[FleetProblem]:
    """``insecure = true``: the replicas would share over a NATS server anyone may use."""
    replicas = fleet.frontend.replicas
    if replicas.nats is None or not replicas.insecure:
        return []
    message = ("the replicas accept a NATS server that lets any client in: whoever reaches "
               "it can read and delete stored responses and steer routing (require "
               "authentication on the server, give credentials, and drop insecure)")
    path: KeyPath = ("frontend", "replicas", "insecure")
    return [_Where(fleet.source).problem(path, field_name(path), message)]
