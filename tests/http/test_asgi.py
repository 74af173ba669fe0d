"""The ASGI plumbing's last resort: a handler that failed is still answered properly."""

from __future__ import annotations

import json
from typing import Any

import trio

from direct_frontend.http.asgi import Message, ResponseProgress, send_body

REQUEST_ID = [(b"x-request-id", b"abc123")]


def failed_after(*sent: Message) -> list[Message]:
    """What the server receives when a handler sends ``sent`` and then fails."""
    received: list[Message] = []

    async def server_send(message: Message) -> None:
        received.append(message)

    async def main() -> None:
        progress = ResponseProgress(server_send, b"abc123")
        for message in sent:
            await progress.send(message)
        await progress.fail(REQUEST_ID)
        await progress.fail(REQUEST_ID)  # a second call sends nothing more

    trio.run(main)
    return received


def test_nothing_sent_yet_becomes_an_openai_500_naming_the_request() -> None:
    start, body = failed_after()
    assert start["status"] == 500
    assert (b"x-request-id", b"abc123") in start["headers"]
    assert (b"content-type", b"application/json") in start["headers"]
    error: dict[str, Any] = json.loads(body["body"])["error"]
    assert error == {
        "message": "Internal server error.", "type": "server_error", "param": None,
        "code": "internal_error",
    }
    assert body["more_body"] is False


def test_a_response_under_way_is_ended_as_it_stands() -> None:
    start: Message = {"type": "http.response.start", "status": 200, "headers": []}
    part: Message = {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}
    received = failed_after(start, part)
    assert received[:2] == [{**start, "headers": [(b"x-request-id", b"abc123")]}, part]
    assert received[2:] == [{"type": "http.response.body", "body": b"", "more_body": False}]


def test_a_finished_response_is_left_alone() -> None:
    received: list[Message] = []

    async def server_send(message: Message) -> None:
        received.append(message)

    async def main() -> None:
        progress = ResponseProgress(server_send, b"abc123")
        await send_body(progress.send, 200, b"{}")
        await progress.fail(REQUEST_ID)

    trio.run(main)
    assert [m["type"] for m in received] == ["http.response.start", "http.response.body"]
    assert received[0]["status"] == 200
