"""The I/O shell: an image's bytes from a data URL or an http(s) fetch, then its pixels.

Fetching goes through httpcore (``httpcore2``, the client under the daemon's
``httpx2``) on the Trio loop, with a network backend of our own: a host is
resolved once, every address it resolves to is checked against the model's
policy (:func:`~direct_frontend.multimodal.policy.address_allowed`), and the
connection is made to a checked address itself, never to the name again, so
a DNS answer that changes between check and connect (rebinding) changes
nothing. TLS still verifies the certificate against the URL's host name.
Redirects are followed by hand, each new URL checked as the first. The body
is read in chunks and dropped past ``max_bytes``; the whole fetch, redirects
included, runs under ``timeout_s``.

Decoding runs in a worker thread under a daemon-wide limiter (Pillow
releases the GIL while it decodes and resizes), after the header's size is
checked against ``max_pixels``, so no client can make the router decode a
decompression bomb.
"""

from __future__ import annotations

import io
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

import httpcore2
import trio

from direct_frontend.multimodal.errors import MediaError
from direct_frontend.multimodal.parts import ImagePart, parse_data_url
from direct_frontend.multimodal.policy import (
    MediaPolicy,
    address_allowed,
    check_bytes,
    check_declared,
    check_pixels,
    check_url,
    redirect_target,
)

if TYPE_CHECKING:
    from PIL import Image

#: images decoded at once, daemon-wide (each holds its pixels; a bound on memory and cores)
DECODE_THREADS: Final = 2
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_CHUNK: Final = 64 * 1024
_HEADERS: Final = [(b"Accept", b"image/png, image/jpeg, image/gif, image/webp"),
                   (b"User-Agent", b"direct-frontend")]


def new_decode_limiter() -> trio.CapacityLimiter:
    """The limiter a daemon's image decodes and preprocessing share."""
    return trio.CapacityLimiter(DECODE_THREADS)


class _Refused(Exception):
    """A connection the policy does not allow (raised inside httpcore, re-raised as ours)."""

    def __init__(self, host: str, addresses: list[str]) -> None:
        super().__init__(host)
        self.host = host
        self.addresses = addresses


class GuardedBackend(httpcore2.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses the policy allows."""

    def __init__(self, policy: MediaPolicy, inner: httpcore2.AsyncNetworkBackend | None = None,
                 ) -> None:
        self.policy = policy
        self.inner = inner if inner is not None else httpcore2.TrioBackend()
        #: every address connected to, for the logs and tests
        self.connected: list[str] = []

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109 (httpcore)
        local_address: str | None = None,
        socket_options: Iterable[httpcore2.SOCKET_OPTION] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise httpcore2.ConnectError(f"cannot resolve {host}: {exc}") from exc
        allowed: list[str] = []
        refused: list[str] = []
        for info in infos:
            address = str(info[4][0]).split("%", 1)[0]
            ip = ipaddress.ip_address(address)
            (allowed if address_allowed(ip, self.policy) else refused).append(address)
        if not allowed:
            raise _Refused(host, refused)
        error: Exception | None = None
        for address in dict.fromkeys(allowed):
            try:
                stream = await self.inner.connect_tcp(address, port, timeout, local_address,
                                                      socket_options)
            except httpcore2.ConnectError as exc:
                error = exc
                continue
            self.connected.append(address)
            return stream
        assert error is not None
        raise error

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


async def image_bytes(part: ImagePart, policy: MediaPolicy,
                      backend: GuardedBackend | None = None) -> tuple[bytes, str]:
    """The bytes of ``part``'s image and their declared media type; a 400 naming its part."""
    if part.is_data:
        data_url = parse_data_url(part.url, part.param, policy.max_bytes)
        return data_url.data, data_url.media_type
    check_url(part.url, policy, part.param)
    backend = backend if backend is not None else GuardedBackend(policy)
    with trio.move_on_after(policy.timeout_s) as scope:
        return await _fetch(part.url, policy, part.param, backend)
    assert scope.cancelled_caught
    raise MediaError(f"Fetching the image took longer than {policy.timeout_s:g} s.", part.param)


async def _fetch(url: str, policy: MediaPolicy, param: str,
                 backend: GuardedBackend) -> tuple[bytes, str]:
    context = ssl.create_default_context()
    async with httpcore2.AsyncConnectionPool(
        ssl_context=context, network_backend=backend, max_connections=1, retries=0,
    ) as pool:
        for _ in range(policy.max_redirects + 1):
            try:
                async with pool.stream("GET", url, headers=_HEADERS) as response:
                    headers = {k.lower(): v for k, v in response.headers}
                    status = response.status
                    if status in _REDIRECTS:
                        location = headers.get(b"location", b"").decode("latin-1")
                        url = redirect_target(url, location, param)
                        check_url(url, policy, param)
                        continue
                    if status != 200:
                        raise MediaError(f"Fetching the image failed: the server answered "
                                         f"HTTP {status}.", param)
                    media_type = check_declared(
                        headers.get(b"content-type", b"").decode("latin-1"), param)
                    declared = headers.get(b"content-length")
                    if declared is not None and declared.isdigit() and int(
                            declared) > policy.max_bytes:
                        raise MediaError(f"The image is larger than the {policy.max_bytes} "
                                         "bytes this model accepts.", param)
                    body = bytearray()
                    async for chunk in response.aiter_stream():
                        body += chunk
                        if len(body) > policy.max_bytes:
                            raise MediaError(f"The image is larger than the {policy.max_bytes} "
                                             "bytes this model accepts.", param)
                    return bytes(body), media_type
            except _Refused as refused:
                shown = ", ".join(refused.addresses) or "no address"
                raise MediaError(
                    f"The image URL's host '{refused.host}' resolves to {shown}: a private, "
                    "loopback, link-local or reserved address this model may not fetch from.",
                    param) from None
            except (httpcore2.ConnectError, httpcore2.ReadError, httpcore2.WriteError,
                    httpcore2.RemoteProtocolError, httpcore2.ConnectTimeout,
                    httpcore2.ReadTimeout, httpcore2.UnsupportedProtocol, ssl.SSLError,
                    OSError) as exc:
                raise MediaError(f"Fetching the image failed: {exc or type(exc).__name__}.",
                                 param) from None
        raise MediaError(f"Fetching the image was redirected more than {policy.max_redirects} "
                         "times.", param)


def open_image(data: bytes, declared: str, policy: MediaPolicy, param: str) -> Image.Image:
    """``data`` decoded into an image (its first frame); a 400 naming ``param`` if it is not
    one this policy takes. Blocking: call it in a worker thread."""
    from PIL import Image, UnidentifiedImageError

    fmt = check_bytes(data, declared, param)
    try:
        image = Image.open(io.BytesIO(data), formats=[fmt])
        check_pixels(image.width, image.height, policy, param)
        image.load()  # the first frame of an animation
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as exc:
        raise MediaError(f"The image cannot be decoded: {exc}.", param) from None
    return image
