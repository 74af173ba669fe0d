"""Test images and a local image server: real sockets on loopback, nothing else."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
from collections.abc import Iterator

import numpy as np
from PIL import Image


def picture(width: int = 64, height: int = 48, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A deterministic noisy picture of ``mode`` (RGB, RGBA, L, P, ...)."""
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P":
        return rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    return rgba if mode == "RGBA" else rgba.convert(mode)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def path_has_length(path: str) -> bool:
    """Bodies under ``/unsized/`` go without a Content-Length (read until the close)."""
    return not path.startswith("/unsized/")


class ImageServer:
    """An HTTP server on ``host`` serving ``routes``: path → (status, headers, body).

    ``requests`` lists every path asked for, so a test can show that nothing
    was fetched from it.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                status, headers, body = server.routes.get(self.path, (404, {}, b"no"))
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if "Content-Length" not in headers and path_has_length(self.path):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.host = host
        self.port = self.httpd.server_address[1]

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def serve(self, path: str, body: bytes, content_type: str = "image/png",
              status: int = 200, **headers: str) -> str:
        self.routes[path] = (status, {"Content-Type": content_type, **headers}, body)
        return self.url(path)


@contextlib.contextmanager
def image_server(host: str = "127.0.0.1") -> Iterator[ImageServer]:
    server = ImageServer(host)
    # polled often, so the stop at the end of the block does not wait half a second
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(5)
