"""One request answered inside this process: the ASGI exchange a batch line runs through.

A batch line is a request to an endpoint with no client on a socket. It
runs through the endpoint's own handler, so its answer is byte for byte
what a client of that endpoint gets (and every check, limit and route a
client's request meets, it meets). :class:`Exchange` is the handler's
``receive`` and ``send``: the body arrives at once and no disconnect ever
comes (a line is stopped by cancelling it, which reaches the engine as a
client's disconnect does), and the answer's status and body are collected.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import trio

from direct_frontend.http.asgi import Message, Scope

#: what a line's request carries: its body is JSON
HEADERS: Final = ((b"content-type", b"application/json"),)


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """What an endpoint answered a line: its status, body and request id, and how long the
    server asked to be left before a retry (its ``retry-after``; None: it did not say)."""

    status: int
    body: bytes
    request_id: str
    retry_after_s: float | None = None


class Exchange:
    """One in-process request's ``receive`` and ``send``; see the module's text."""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self._given = False
        self.status = 0
        self._chunks: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []

    @staticmethod
    def scope(path: str) -> Scope:
        return {"type": "http", "method": "POST", "path": path, "headers": list(HEADERS),
                "query_string": b"", "http_version": "1.1", "scheme": "http",
                "client": None, "server": None}

    async def receive(self) -> Message:
        if not self._given:
            self._given = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await trio.sleep_forever()  # nobody leaves: a line is stopped by its cancellation
        raise AssertionError("unreachable")

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self._headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
        elif message["type"] == "http.response.body":
            self._chunks.append(bytes(message.get("body", b"")))

    @property
    def body(self) -> bytes:
        return b"".join(self._chunks)

    @property
    def retry_after_s(self) -> float | None:
        """The answer's ``retry-after-ms`` (or ``retry-after``, in seconds), if it has one."""
        found = dict(self._headers)
        for name, scale in ((b"retry-after-ms", 0.001), (b"retry-after", 1.0)):
            value = found.get(name, b"").strip()
            if value.isdigit() and len(value) <= 12:
                return int(value) * scale
        return None
