"""What the router may fetch and decode for a model's images (sans-IO).

The fleet file sets a :class:`MediaPolicy` per model. Its rules, in the order
they are applied:

- a URL is ``data:`` or ``http(s):`` (no ``file:``, ``ftp:``...), with a host and
  no user name or password in it; ``fetch = false`` allows ``data:`` URLs only;
- ``allowed_hosts`` (when not empty) lists the hosts that may be fetched:
  ``images.example.com`` exactly, ``*.example.com`` for its subdomains;
- every address a host resolves to is checked before a connection is made,
  and the connection goes to the checked address (no second lookup an
  attacker's DNS could answer differently): private, loopback, link-local,
  multicast, reserved and unspecified addresses are refused unless one of
  ``allowed_networks`` holds them (``127.0.0.1/32`` for a local image server);
- the same checks again for every redirect, at most ``max_redirects`` of them;
- the bytes: at most ``max_bytes``, within ``timeout_s`` for the whole
  fetch, of a declared type that is an image format we decode, whose
  first bytes are that format's signature; at most ``max_pixels`` pixels,
  read from the header before anything is decoded.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import urllib.parse
from collections.abc import Sequence
from typing import Final

from direct_frontend.multimodal.errors import MediaError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: the formats we decode, by their media type
FORMATS: Final = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
                  "image/gif": "GIF", "image/webp": "WEBP"}
#: declared types that say nothing about the bytes: the signature decides alone
_UNTYPED: Final = frozenset({"", "application/octet-stream", "binary/octet-stream"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MediaPolicy:
    """One model's rules for images (``[model.media]``)."""

    #: images are taken at all (a model without a vision processor refuses them anyway)
    enabled: bool = True
    #: http(s) URLs are fetched; False: data URLs only
    fetch: bool = True
    allowed_hosts: tuple[str, ...] = ()
    allowed_networks: tuple[IPNetwork, ...] = ()
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_images: int = 16
    timeout_s: float = 10.0
    max_redirects: int = 3


def sniff(data: bytes) -> str | None:
    """The image format ``data`` starts with (PNG, JPEG, GIF, WEBP), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def check_declared(declared: str, param: str) -> str:
    """A declared media type (a data URL's, a response's ``Content-Type``), normalised; a
    400 unless it is an image format we decode or says nothing about the bytes."""
    declared = declared.split(";", 1)[0].strip().lower()
    if declared and declared not in _UNTYPED and declared not in FORMATS:
        raise MediaError(f"The content type '{declared}' is not an image format this server "
                         "reads (PNG, JPEG, GIF, WebP).", param)
    return declared


def check_bytes(data: bytes, declared: str, param: str) -> str:
    """The format of ``data``; a 400 unless its signature is a format we decode and any
    declared media type agrees with it."""
    declared = check_declared(declared, param)
    found = sniff(data)
    if found is None:
        raise MediaError("The data is not a PNG, JPEG, GIF or WebP image (its first bytes are "
                         "no image signature).", param)
    if declared in FORMATS and FORMATS[declared] != found:
        raise MediaError(f"The data is a {found} image but was declared '{declared}'.", param)
    return found


def check_pixels(width: int, height: int, policy: MediaPolicy, param: str) -> None:
    """A 400 for an image of more than ``max_pixels`` pixels, or of no pixels."""
    if width <= 0 or height <= 0:
        raise MediaError(f"The image has no pixels ({width}x{height}).", param)
    if width * height > policy.max_pixels:
        raise MediaError(f"The image is {width}x{height} = {width * height} pixels; this model "
                         f"accepts at most {policy.max_pixels}.", param)


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A URL allowed to be fetched: where to connect, and what to ask for there."""

    url: str
    scheme: str
    host: str  # as in the URL, IPv6 without brackets, lower case
    port: int


def check_url(url: str, policy: MediaPolicy, param: str) -> Target:
    """``url`` if the policy lets it be fetched (its addresses are checked at connect)."""
    if not policy.fetch:
        raise MediaError("This model takes images as data URLs only; fetching image URLs is "
                         "turned off for it.", param)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MediaError(f"The image URL is not valid: {exc}.", param) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaError(f"Image URLs must be http, https or data URLs, not '{scheme}:'.",
                         param)
    host = (parts.hostname or "").lower()
    if not host:
        raise MediaError("The image URL has no host.", param)
    if parts.username is not None or parts.password is not None:
        raise MediaError("The image URL must not carry a user name or password.", param)
    if policy.allowed_hosts and not host_allowed(host, policy.allowed_hosts):
        raise MediaError(f"The host '{host}' is not one this model may fetch images from.",
                         param)
    literal = _literal(host)
    if literal is not None:
        check_address(literal, policy, param)
    return Target(url, scheme, host, port or (443 if scheme == "https" else 80))


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether ``host`` is one of ``allowed`` (``*.example.com``: its subdomains)."""
    for entry in allowed:
        entry = entry.lower()
        if entry.startswith("*."):
            if host.endswith(entry[1:]):
                return True
        elif host == entry:
            return True
    return False


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def public(address: IPAddress) -> bool:
    """Whether ``address`` is a global unicast address (not private, loopback, link-local...)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def address_allowed(address: IPAddress, policy: MediaPolicy) -> bool:
    """Whether the router may connect to ``address`` for an image."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in network for network in policy.allowed_networks):
        return True
    return public(address)


def check_address(address: IPAddress, policy: MediaPolicy, param: str) -> None:
    """A 400 unless the router may connect to ``address``."""
    if not address_allowed(address, policy):
        raise MediaError(f"The image URL leads to {address}, a private, loopback, link-local "
                         "or reserved address this model may not fetch from.", param)


def redirect_target(base: str, location: str | None, param: str) -> str:
    """The absolute URL a redirect names; a 400 when it names none."""
    if not location:
        raise MediaError("Fetching the image was redirected without a Location.", param)
    return urllib.parse.urljoin(base, location)
