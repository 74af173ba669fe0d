"""``POST /v1/embeddings`` output: the vectors as one body, in OpenAI's shape.

The walk is the stair's (pipeline/serve.py ``Stair.embed``: each input
tokenized, one admission slot per input, each embedded on one of the model's
embedding engines). The body is rendered once: ``encoding_format`` ``float``
(a list) or ``base64`` (little-endian float32 bytes, what the ``openai`` SDK
asks for by default).
"""

from __future__ import annotations

from direct_frontend.http.render import render_embeddings
from direct_frontend.http.stream import Renderer
from direct_frontend.openai.types import EmbeddingRequest
from direct_frontend.pipeline.serve_events import Embedded


class EmbeddingsRenderer(Renderer):
    """One embeddings response."""

    __slots__ = ("_request",)

    def __init__(self, request: EmbeddingRequest) -> None:
        self._request = request

    def embedded(self, event: Embedded) -> bytes:
        request = self._request
        return render_embeddings(request.model, event.vectors, event.prompt_tokens,
                                 request.encoding_format == "base64")
