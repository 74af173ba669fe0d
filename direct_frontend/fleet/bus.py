"""``[frontend.replicas]``'s NATS settings as text: their rules and their printable form (sans-IO).

The loader reports :func:`replicas_problems` with the file's lines; every
place that shows the NATS URL (``check``, ``/fleet``, the log) shows
:func:`shown_url`, which keeps a ``user:password@`` (or a token in the user
part) out of sight.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from direct_frontend.fleet.schema import ReplicasConfig
from direct_frontend.observability.redact import redact_url, scrub, url_secrets

SCHEMES = ("nats", "tls")
#: the keys naming files (resolved against the fleet file's directory by the loader)
REPLICAS_FILES = ("password_file", "token_file", "nkey_seed_file", "creds_file", "tls_ca",
                  "tls_cert", "tls_key")

#: a subject token of ours: no wildcard (``*``, ``>``), no space, no empty token
_TOKEN = r"[A-Za-z0-9_-]+"
_CLUSTER = re.compile(rf"{_TOKEN}(?:\.{_TOKEN})*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def shown_url(url: str | None) -> str | None:
    """``url`` as it may be printed (:func:`~direct_frontend.observability.redact.redact_url`)."""
    return None if url is None else redact_url(url)


def scrubbed(text: str, url: str | None) -> str:
    """``text`` (a client library's message) without the credentials of ``url`` in it."""
    return text if url is None else scrub(text, url_secrets(url))


def nats_credentials(config: ReplicasConfig) -> str:
    """How a replica authenticates to NATS, without any secret."""
    if config.creds_file is not None:
        how = "a creds file"
    elif config.nkey_seed_file is not None:
        how = "an nkey seed"
    elif config.token_env is not None or config.token_file is not None:
        how = "a token"
    elif config.user is not None:
        how = f"user {config.user}"
    elif config.nats is not None and "@" in config.nats:
        how = "credentials in the URL"
    else:
        how = "no credentials"
    return how


def nats_auth_summary(config: ReplicasConfig) -> str:
    """How a replica authenticates to NATS and whether TLS is required, without any secret."""
    how = nats_credentials(config)
    tls = "TLS required" if config.wants_tls else "TLS if the server asks"
    server = "an open server accepted (insecure)" if config.insecure else "open servers refused"
    return f"{how}, {tls}, {server}"


def cluster_problem(cluster: str) -> str | None:
    """Why ``cluster`` cannot name subjects (a wildcard would hear other fleets), or None."""
    if _CLUSTER.fullmatch(cluster):
        return None
    return (f"{cluster!r} is not a NATS subject prefix: use letters, digits, '-' and '_' in "
            "dot-separated parts (no '*' or '>', which would hear other fleets)")


def replicas_problems(config: ReplicasConfig) -> list[tuple[str, str]]:
    """(key, message) for each rule between ``[frontend.replicas]`` keys it breaks."""
    problems: list[tuple[str, str]] = []
    problem = cluster_problem(config.cluster)
    if problem is not None:
        problems.append(("cluster", problem))
    for key in ("password_env", "token_env"):
        name = getattr(config, key)
        if name is not None and not _ENV_NAME.fullmatch(name):
            problems.append((key, f"{name!r} is not an environment variable name"))
    problems.extend(_auth_problems(config))
    if (config.tls_cert is None) != (config.tls_key is None):
        present = "tls_cert" if config.tls_key is None else "tls_key"
        missing = "tls_key" if config.tls_key is None else "tls_cert"
        problems.append((present, f"{present} needs {missing}"))
    problems.extend(_nats_problems(config))
    return problems


def _auth_problems(config: ReplicasConfig) -> list[tuple[str, str]]:
    """The ways to authenticate: each given once, a user with a password, only one way."""
    problems: list[tuple[str, str]] = []
    password = [k for k in ("password_env", "password_file") if getattr(config, k) is not None]
    token = [k for k in ("token_env", "token_file") if getattr(config, k) is not None]
    for keys in (password, token):
        if len(keys) > 1:
            problems.append((keys[1], f"give {keys[0]} or {keys[1]}, not both"))
    if config.user is not None and not password:
        problems.append(("user", "a user needs password_env or password_file"))
    if password and config.user is None:
        problems.append((password[0], "a password needs user"))
    methods = [key for key, given in (
        ("user", config.user is not None), (token[0] if token else "token", bool(token)),
        ("nkey_seed_file", config.nkey_seed_file is not None),
        ("creds_file", config.creds_file is not None)) if given]
    if len(methods) > 1:
        problems.append((methods[1],
                         f"give one way to authenticate, not {' and '.join(methods)}"))
    return problems


def _nats_problems(config: ReplicasConfig) -> list[tuple[str, str]]:
    """Without ``nats`` the NATS keys do nothing; with it, it must be a nats:// or tls:// URL."""
    if config.nats is None:
        return [(key, "has no effect without nats") for key in _NEEDS_NATS
                if getattr(config, key) not in (None, False)]
    parts = urlsplit(config.nats)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in SCHEMES or not parts.hostname or not port_ok:
        return [("nats", f"{shown_url(config.nats)!r} is not a nats:// or tls:// "
                         "URL (host, and port if not 4222)")]
    return []


_NEEDS_NATS = ("user", "password_env", "password_file", "token_env", "token_file",
               "nkey_seed_file", "creds_file", "tls", "tls_ca", "tls_cert", "tls_key",
               "insecure")
