"""Fetching images safely: real sockets on loopback, every refusal a 400 naming the part.

Nothing is fetched that the policy does not allow: a refused address is
refused before any connection (the guarded backend records every address it
connected to), and a server that should not be reached records no request.
"""

from __future__ import annotations

import ipaddress
import socket

import pytest
import trio
import trio.testing

from direct_frontend.multimodal.errors import MediaError
from direct_frontend.multimodal.fetch import GuardedBackend, image_bytes, open_image
from direct_frontend.multimodal.parts import ImagePart
from direct_frontend.multimodal.policy import MediaPolicy
from tests.support.images import data_url, encoded, image_server, picture

PARAM = "messages[0].content[0].image_url"
PNG = encoded(picture(20, 10))
LOOPBACK_2 = MediaPolicy(allowed_networks=(ipaddress.ip_network("127.0.0.2/32"),))


def part(url: str) -> ImagePart:
    return ImagePart(url=url, param=PARAM)


async def refused(url: str, policy: MediaPolicy, backend: GuardedBackend | None = None) -> str:
    with pytest.raises(MediaError) as caught:
        await image_bytes(part(url), policy, backend)
    assert caught.value.param == PARAM and caught.value.status == 400
    return caught.value.message


async def test_a_data_url_is_decoded_and_checked() -> None:
    data, declared = await image_bytes(part(data_url(PNG)), MediaPolicy())
    assert data == PNG and declared == "image/png"
    assert "not valid base64" in await refused("data:image/png;base64,@@@", MediaPolicy())
    assert "base64-encoded" in await refused("data:image/png,abc", MediaPolicy())
    assert "larger than the 10 bytes" in await refused(data_url(PNG), MediaPolicy(max_bytes=10))


async def test_private_loopback_and_link_local_addresses_are_refused_before_connecting() -> None:
    backend = GuardedBackend(MediaPolicy())
    for url in ("http://10.0.0.1/a.png", "http://192.168.1.1/a.png",
                "http://169.254.169.254/latest/meta-data", "http://127.0.0.1:9/a.png",
                "http://[::1]/a.png", "http://[::ffff:127.0.0.1]/a.png", "http://0.0.0.0/a.png",
                "http://[fe80::1]/a.png"):
        assert "address this model may not fetch from" in await refused(url, MediaPolicy(),
                                                                          backend)
    assert backend.connected == []


async def test_a_name_resolving_to_loopback_is_refused_and_nothing_is_fetched() -> None:
    with image_server() as server:
        url = server.serve("/a.png", PNG).replace("127.0.0.1", "localhost")
        backend = GuardedBackend(MediaPolicy())
        message = await refused(url, MediaPolicy(), backend)
        assert "'localhost' resolves to" in message
        assert backend.connected == [] and server.requests == []


async def test_an_allowed_network_is_fetched_from() -> None:
    with image_server("127.0.0.2") as server:
        backend = GuardedBackend(LOOPBACK_2)
        data, declared = await image_bytes(part(server.serve("/a.png", PNG)), LOOPBACK_2, backend)
        assert data == PNG and declared == "image/png"
        assert backend.connected == ["127.0.0.2"] and server.requests == ["/a.png"]


async def test_a_redirect_to_loopback_is_refused_and_never_followed() -> None:
    with image_server("127.0.0.2") as allowed, image_server("127.0.0.1") as loopback:
        target = loopback.serve("/secret.png", PNG)
        start = allowed.serve("/r", b"", status=302, Location=target)
        backend = GuardedBackend(LOOPBACK_2)
        assert "127.0.0.1" in await refused(start, LOOPBACK_2, backend)
        assert allowed.requests == ["/r"] and loopback.requests == []
        assert backend.connected == ["127.0.0.2"]
        # a redirect within what is allowed is followed, and re-checked each time
        allowed.serve("/b.png", PNG)
        moved = allowed.serve("/moved", b"", status=301, Location="/b.png")
        assert (await image_bytes(part(moved), LOOPBACK_2))[0] == PNG
        loop = allowed.serve("/loop", b"", status=302, Location="/loop")
        assert "redirected more than 3 times" in await refused(loop, LOOPBACK_2)
        assert allowed.requests.count("/loop") == 4


async def test_hosts_schemes_and_credentials_are_checked() -> None:
    only = MediaPolicy(allowed_hosts=("images.example.com", "*.cdn.example.com"))
    assert "not one this model may fetch" in await refused("https://evil.example.com/a", only)
    assert "not 'ftp:'" in await refused("ftp://images.example.com/a", only)
    assert "user name or password" in await refused("http://u:p@images.example.com/a", only)
    assert "data URLs only" in await refused("https://images.example.com/a",
                                             MediaPolicy(fetch=False))


async def test_oversized_mistyped_and_failing_responses_are_400s() -> None:
    with image_server("127.0.0.2") as server:
        small = MediaPolicy(allowed_networks=LOOPBACK_2.allowed_networks, max_bytes=len(PNG) - 1)
        assert "larger than" in await refused(server.serve("/big.png", PNG), small)
        # no Content-Length: the body is cut off as it streams past the limit
        assert "larger than" in await refused(server.serve("/unsized/big.png", PNG), small)
        html = server.serve("/page", b"<html></html>", content_type="text/html")
        assert "'text/html' is not an image format" in await refused(html, LOOPBACK_2)
        assert "HTTP 500" in await refused(server.serve("/err", b"", status=500), LOOPBACK_2)
        data, declared = await image_bytes(part(server.serve("/gif", b"GIF89a....",
                                                             content_type="image/png")),
                                           LOOPBACK_2)
        with pytest.raises(MediaError, match="is a GIF image but was declared 'image/png'"):
            open_image(data, declared, LOOPBACK_2, PARAM)


async def test_a_server_that_never_answers_times_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))
    listener.listen(1)
    try:
        port = listener.getsockname()[1]
        policy = MediaPolicy(allowed_networks=LOOPBACK_2.allowed_networks, timeout_s=5)
        assert "longer than 5 s" in await refused(f"http://127.0.0.2:{port}/a.png", policy)
    finally:
        listener.close()


@pytest.mark.parametrize(("data", "words"), [
    (b"not an image at all", "no image signature"),
    (PNG[:40], "cannot be decoded"),  # a PNG cut short
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "cannot be decoded"),
    (encoded(picture(20, 10), "JPEG")[:100], "cannot be decoded"),
])
def test_malformed_images_are_400s(data: bytes, words: str) -> None:
    with pytest.raises(MediaError, match=words) as caught:
        open_image(data, "", MediaPolicy(), PARAM)
    assert caught.value.param == PARAM


def test_pixels_are_counted_from_the_header_before_decoding() -> None:
    from PIL import Image

    huge = encoded(Image.new("L", (3000, 2000)))
    with pytest.raises(MediaError, match="3000x2000 = 6000000 pixels"):
        open_image(huge, "image/png", MediaPolicy(max_pixels=1_000_000), PARAM)
    assert open_image(huge, "image/png", MediaPolicy(), PARAM).size == (3000, 2000)


def test_every_mode_and_format_decodes() -> None:
    for mode in ("RGB", "RGBA", "L", "P", "LA", "CMYK"):
        for fmt in ("PNG", "JPEG", "GIF", "WEBP"):
            image = picture(9, 7, "RGB", seed=1)
            image = picture(9, 7, mode, seed=1) if mode in ("RGB", "RGBA", "L", "P") else (
                image.convert(mode))
            try:
                data = encoded(image, fmt)
            except (OSError, ValueError):
                continue  # a mode the format cannot hold
            assert open_image(data, "", MediaPolicy(), PARAM).size == (9, 7)
