"""The one error every refusal of an image becomes: a 4xx naming the content part."""

from __future__ import annotations


class MediaError(Exception):
    """An image the request cannot use; ``param`` names its content part.

    The pipeline answers it as an OpenAI-shaped error with ``status`` (a 4xx:
    the client's input is at fault, whether it sent bytes that are not an
    image or a URL the fleet file does not let the router fetch).
    """

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def __repr__(self) -> str:
        return f"MediaError({self.message!r}, param={self.param!r}, status={self.status})"
