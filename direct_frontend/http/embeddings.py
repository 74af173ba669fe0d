"""``POST /v1/embeddings``: tokenize each input, embed them on the model's engines, one body.

The router tokenizes (text with the model's special tokens, as the engines'
own servers do; token ids as they are), holds one admission slot per input
(and runs at most as many inputs at once as it holds slots), and answers in
OpenAI's shape: ``encoding_format`` ``float`` (a list) or ``base64``
(little-endian float32 bytes, what the ``openai`` SDK asks for by default).
The engines compute vectors at their own size: ``dimensions`` is accepted
only when it is that size. A client that leaves cancels the calls. With
tracing on, the request is one trace: ``preprocess``, ``admission`` and an
``engine leg`` per ``Embed`` call.
"""

from __future__ import annotations

from collections.abc import Callable

from direct_frontend.engines.neutral import Embedding
from direct_frontend.http.asgi import JSON, Headers, Receive, Send, send_body
from direct_frontend.http.render import render_embeddings
from direct_frontend.http.responses import _answer
from direct_frontend.observability.tracing import RequestTrace
from direct_frontend.openai.errors import invalid_request
from direct_frontend.openai.types import EmbeddingRequest
from direct_frontend.pipeline.embed import embed_all
from direct_frontend.pipeline.models import ServedModel
from direct_frontend.pipeline.preprocess import prompt_ids


async def respond_embeddings(
    served: ServedModel, request: EmbeddingRequest, request_id: str, routing_key: str | None,
    tenant: str, receive: Receive, send: Send, headers: Headers,
    trace: RequestTrace | None = None, limit: Callable[[int], object] | None = None,
) -> int:
    """Embed every input and write the body; the HTTP status (499: the client left).

    ``tenant``: whose share of the admission queue its slots come from, at the tier its
    ``service_tier`` gets (a batch line's ``flex``; else ``default``). ``limit`` admits
    the request against its tenant's rate limits by its tokens, once they are counted (it
    raises the 429 of a request over them)."""
    settings = served.settings
    several = len(request.inputs) > 1
    if trace is not None:
        trace.enter("preprocess")
    inputs = [
        await prompt_ids(one, f"input[{k}]" if several else "input", served.tokenizing,
                         cached=False)
        for k, one in enumerate(request.inputs)
    ]
    tokens = sum(len(ids) for _, ids in inputs)
    if trace is not None:
        trace.leave(prompt_tokens=tokens)
    if limit is not None:
        limit(tokens)
    if trace is not None:
        trace.enter("admission")
    async def embed() -> list[Embedding]:
        embeddings = await embed_all(
            served.relay, settings, request.model, request_id, inputs, routing_key,
            at_once=min(len(inputs), settings.admission.config.max_in_flight), trace=trace,
        )
        size = len(embeddings[0].vector)
        if request.dimensions is not None and request.dimensions != size:
            raise invalid_request(
                f"This model's embeddings have {size} dimensions, and its engines do not "
                f"shorten them: 'dimensions' may only be {size}.", "dimensions",
            )
        return embeddings

    async def write(embeddings: list[Embedding]) -> int:
        prompt_tokens = sum(e.prompt_tokens or len(ids)
                            for e, (_, ids) in zip(embeddings, inputs, strict=True))
        if trace is not None:
            trace.usage(prompt_tokens, 0)
        body = render_embeddings(request.model, [e.vector for e in embeddings],
                                 prompt_tokens, request.encoding_format == "base64")
        await send_body(send, 200, body, JSON, headers)
        return 200

    tier = settings.admission.tier(tenant, request.service_tier)
    async with settings.admission.slot(len(inputs), tenant, tier):
        if trace is not None:
            trace.leave()
        return await _answer(served.relay, embed, write, lambda _, ok: None, receive, send,
                             headers)
