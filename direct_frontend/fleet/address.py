"""Addresses in the fleet file: ``host:port`` and ``scheme://host:port`` (sans-IO).

Parsed by hand rather than with :mod:`urllib.parse` so each way an address
can be wrong gets its own reason in the message (a missing port, an IPv6
address without brackets, a bind address where a host to connect to belongs).
"""

from __future__ import annotations

import ipaddress
import re

Endpoint = tuple[str, int]  # host (IPv6 without brackets), port

_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*")


def _valid_host(host: str) -> bool:
    """A hostname or an IP literal; all-numeric names must be real IPv4 addresses."""
    if not _HOSTNAME.fullmatch(host):
        return False
    if all(label.isdigit() for label in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
    return True


def host_port(text: str, *, min_port: int, scheme: str) -> Endpoint | str:
    """Split ``host:port`` (IPv6 in brackets); a reason string when it is not one."""
    form = f"{scheme}://host:port" if scheme else "host:port"
    split = _split_bracketed(text, form) if text.startswith("[") else _split_plain(text, form)
    if isinstance(split, str):
        return split
    host, port_text = split
    port = _port(port_text, min_port, form)
    return port if isinstance(port, str) else (host, port)


def _split_bracketed(text: str, form: str) -> tuple[str, str] | str:
    """``[v6]:port`` as (host, port text), or the reason it is not one."""
    close = text.find("]")
    if close < 0:
        return "the IPv6 address has no closing ']'"
    host, rest = text[1:close], text[close + 1 :]
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return f"{host!r} is not an IPv6 address"
    if not rest.startswith(":"):
        return f"the port is missing (expected {form})"
    return host, rest[1:]


def _split_plain(text: str, form: str) -> tuple[str, str] | str:
    """``host:port`` (a name or IPv4) as (host, port text), or the reason it is not one."""
    if ":" not in text:
        return f"the port is missing (expected {form})"
    host, _, port_text = text.rpartition(":")
    if ":" in host:
        return "an IPv6 address must be in brackets, like [::1]:port"
    if not host:
        return f"the host is missing (expected {form})"
    if not _valid_host(host):
        return f"{host!r} is not a valid host name or IP address"
    return host, port_text


def _port(port_text: str, min_port: int, form: str) -> int | str:
    """The port number, or the reason ``port_text`` is not one in range."""
    if not port_text:
        return f"the port is missing (expected {form})"
    if not (port_text.isascii() and port_text.isdigit()):
        return f"the port {port_text!r} is not a number"
    port = int(port_text)
    if not min_port <= port <= 65535:
        return f"the port must be between {min_port} and 65535, got {port}"
    return port


def split_url(text: str, scheme: str) -> Endpoint | str | None:
    """Parse ``scheme://host:port``: the endpoint, a reason, or None if not URL-shaped."""
    sep = text.find("://")
    if sep <= 0:
        return None
    if text[:sep] != scheme:
        return f"the scheme must be {scheme}://, not {text[:sep]}://"
    rest = text[sep + 3 :]
    if any(ch in rest for ch in "/?#"):
        return f"only {scheme}://host:port is allowed (no path, query or fragment)"
    if "@" in rest:
        return "user info is not allowed"
    if rest.startswith("*:"):
        return f"'*' is a bind address; give the host to connect to ({scheme}://host:port)"
    return host_port(rest, min_port=1, scheme=scheme)


def endpoint_text(endpoint: Endpoint) -> str:
    """``host:port`` as written in the fleet file (IPv6 in brackets)."""
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def endpoint_key(endpoint: Endpoint) -> Endpoint:
    """Endpoints compare case-insensitively by host (DNS names are case-blind)."""
    return endpoint[0].lower(), endpoint[1]


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (where an embedded simulator may listen)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
