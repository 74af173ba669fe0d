"""How a replica meets its NATS server: credentials, TLS, and whether to trust the server.

``[frontend.replicas]`` names its secrets (an environment variable or a
file) rather than holding them; :func:`connect_options` reads them once,
at start, into nats-py's ``connect`` arguments, and a missing one stops the
start with a message naming the key, never the value. :func:`probe_info`
reads a server's ``INFO`` line before anything is sent to it, and
:func:`server_problem` says why a replica will not share over that server:
one that lets any client in (anyone who reaches it would read stored
responses and steer routing) unless ``insecure = true``, or one without TLS
when TLS is required. :class:`Link` is what the link's helpers
(control/response_rpc.py, control/kv_share.py) use of it; :class:`ChunkInbox`
receives what a sibling sends in pieces (a KV index, a stored response):
more than one NATS message holds.
"""

from __future__ import annotations

# isort: split
import trio_asyncio  # before nats, see cli.py

# isort: split
import importlib.util
import json
import logging
import math
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import trio

from direct_frontend.control.replica_wire import Subjects
from direct_frontend.fleet.bus import nats_credentials
from direct_frontend.fleet.schema import ReplicasConfig
from direct_frontend.kv.snapshot import Reassembly

log = logging.getLogger("direct_frontend.replicas")

DEFAULT_PORT = 4222
INFO_TIMEOUT_S = 1.0
#: what nats-server says to a client whose credentials it does not accept
AUTH_VIOLATION = "Authorization Violation"


class NatsRefused(ConnectionError):
    """This replica will not share over the NATS server (the message says why, without secrets).

    A ``ConnectionError``: like a port that cannot be bound, it is the
    world's answer to the daemon's start, reported as one line.
    """


def _secret(config: ReplicasConfig, name: str, env: Mapping[str, str]) -> str | None:
    """The secret ``name`` (``password`` or ``token``) from its variable or file."""
    variable: str | None = getattr(config, f"{name}_env")
    path: str | None = getattr(config, f"{name}_file")
    if variable is not None:
        value = env.get(variable, "")
        if not value:
            raise NatsRefused(f"[frontend.replicas] {name}_env: the environment variable "
                              f"{variable} is not set (or empty)")
        return value
    if path is not None:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise NatsRefused(f"[frontend.replicas] {name}_file: cannot read {path} "
                              f"({exc.__class__.__name__})") from None
        value = lines[0].strip() if lines else ""
        if not value:
            raise NatsRefused(f"[frontend.replicas] {name}_file: {path} is empty")
        return value
    return None


def tls_context(config: ReplicasConfig) -> ssl.SSLContext | None:
    """The client's TLS context: the CA given (else the system's) and its own certificate."""
    if not (config.wants_tls or config.tls_ca is not None):
        return None
    try:
        context = ssl.create_default_context(cafile=config.tls_ca)
        if config.tls_cert is not None:
            context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise NatsRefused(f"[frontend.replicas] TLS files: {exc}") from None
    return context


def connect_options(config: ReplicasConfig, env: Mapping[str, str]) -> dict[str, Any]:
    """nats-py ``connect`` arguments for ``config``'s credentials and TLS (secrets read now)."""
    options: dict[str, Any] = {}
    password = _secret(config, "password", env)
    if config.user is not None:
        options.update(user=config.user, password=password)
    token = _secret(config, "token", env)
    if token is not None:
        options["token"] = token
    for key, option in (("nkey_seed_file", "nkeys_seed"), ("creds_file", "user_credentials")):
        path: str | None = getattr(config, key)
        if path is None:
            continue
        if importlib.util.find_spec("nkeys") is None:
            raise NatsRefused(f"[frontend.replicas] {key} needs the nkeys package "
                              "(pip install nkeys)")
        if not Path(path).is_file():
            raise NatsRefused(f"[frontend.replicas] {key}: {path} is not a file")
        options[option] = path
    context = tls_context(config)
    if context is not None:
        options["tls"] = context
    return options


def server_problem(info: Mapping[str, Any], config: ReplicasConfig) -> str | None:
    """Why a replica of ``config`` will not share over the server that sent ``info``, or None."""
    if config.wants_tls and not info.get("tls_required"):
        return "it does not require TLS, and this replica does (tls)"
    if not info.get("auth_required") and not config.insecure:
        return ("it lets any client in (no auth_required): anyone who reaches it could read "
                "stored responses and steer routing. Require authentication on the server "
                "and give this replica credentials, or set insecure = true in "
                "[frontend.replicas] to share over it anyway")
    return None


def is_open(info: Mapping[str, Any]) -> bool:
    """The server lets clients in without credentials."""
    return not info.get("auth_required")


def refusal(error: str, config: ReplicasConfig) -> str | None:
    """Why connecting again cannot help, from a nats-py error text (None: it may).

    The server refused the credentials, or its certificate is not one the
    replica trusts: both are settings to mend, not an outage to wait out.
    """
    text = error.removeprefix("nats: ")
    if AUTH_VIOLATION.lower() in text.lower() or "authorization" in text.lower():
        return f"it refuses this replica's credentials ({nats_credentials(config)}): {text}"
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (f"its TLS certificate is not trusted ({text}); tls_ca names the CA that "
                "signed it")
    return None


def endpoint(url: str) -> tuple[str, int]:
    """The host and port of a nats:// or tls:// URL (4222 when it names none)."""
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORT


async def probe_info(url: str) -> dict[str, Any] | None:
    """The server's ``INFO`` (sent before anything is asked of it); None if it sends none."""
    host, port = endpoint(url)
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError:
        return None
    line = b""
    async with stream:
        with trio.move_on_after(INFO_TIMEOUT_S):
            while b"\n" not in line and len(line) < 65536:
                try:
                    data = await stream.receive_some(4096)
                except trio.BrokenResourceError:
                    return None
                if not data:
                    break
                line += data
    head, _, _ = line.partition(b"\n")
    if not head.startswith(b"INFO "):
        return None
    try:
        info = json.loads(head[5:])
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


class ChunkInbox:
    """A fresh inbox on a NATS client that puts the chunks sent to it back together.

    :meth:`open` subscribes; :meth:`close` unsubscribes (a failure there is
    only logged: the connection may be gone already).
    """

    def __init__(self, subscription: Any, subject: str,
                 chunks: trio.MemoryReceiveChannel[bytes]) -> None:
        self.subject = subject
        self._subscription = subscription
        self._chunks = chunks

    @classmethod
    async def open(cls, nc: Any) -> ChunkInbox:
        subject: str = nc.new_inbox()
        tx, rx = trio.open_memory_channel[bytes](math.inf)

        async def deliver(msg: Any) -> None:  # asyncio side: hand over, decide nothing
            tx.send_nowait(msg.data)

        subscription = await trio_asyncio.aio_as_trio(nc.subscribe)(subject, cb=deliver)
        return cls(subscription, subject, rx)

    async def reassembled(self) -> bytes:
        """The whole message, once its last chunk is in (``ValueError``: malformed)."""
        assembly = Reassembly()
        while not assembly.done:
            assembly.add(await self._chunks.receive())
        return assembly.data()

    async def close(self) -> None:
        try:
            await trio_asyncio.aio_as_trio(self._subscription.unsubscribe)()
        except Exception as exc:
            log.debug("replicas: unsubscribe: %s", exc)


class Link(Protocol):
    """What the replica link's helpers use of it (control/replicas.py ``ReplicaLink``)."""

    replica: str
    subjects: Subjects
    counts: dict[str, int]

    @property
    def connection(self) -> Any:
        """The NATS client while the link shares over it; None while it is down."""
        ...

    async def publish(self, subject: str, data: bytes) -> bool: ...

    def malformed(self, what: str) -> None: ...
