"""Which engines can carry a request at all: the contracts differ in a few sampling fields.

A seed cannot reach an SGLang engine and a logit bias cannot reach a
TensorRT-LLM one (their contracts lack the field; the dialects' capabilities
say so), a kind whose contract lacks a constraint kind cannot enforce it, and
TensorRT-LLM returns prompt logprobs (``echo`` with ``logprobs``) too late.
Such engines are excluded from the request's placement, so it goes to a kind
that carries everything it asked for instead of being served without it; when
every serving engine lacks it, the client gets a 400 naming the field.
"""

from __future__ import annotations

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import (
    OptionalFields,
    missing_capability,
    why_missing,
)
from direct_frontend.multimodal.parts import ImagePart
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.routing.catalog import Catalog


def needs_capabilities(sampling: OptionalFields) -> bool:
    """Whether ``sampling`` sets a field some kind lacks (most requests do not: no walk)."""
    return (
        sampling.seed is not None or bool(sampling.logit_bias) or sampling.constraint is not None
        or sampling.prompt_logprobs is not None or bool(_images(sampling))
    )


def _images(request: object) -> tuple[ImagePart, ...]:
    """A chat request's images (none for other requests)."""
    images: tuple[ImagePart, ...] = getattr(request, "images", ())
    return images


def incapable(catalog: Catalog, sampling: OptionalFields) -> dict[str, str]:
    """The serving engines that cannot carry ``sampling``, each with the field it lacks.

    An embedding model's engines cannot generate at all: they lack ``model``.
    """
    lacking = dict.fromkeys(catalog.embedders, "model") if catalog.embedders else {}
    if not needs_capabilities(sampling):
        return lacking
    by_kind: dict[str, str | None] = {}
    images = _images(sampling)
    for engine in catalog.engines:
        if engine.kind not in by_kind:
            capabilities = dialect_for(engine.kind).capabilities
            by_kind[engine.kind] = (
                images[0].param if images and not capabilities.images
                else missing_capability(capabilities, sampling)
            )
        param = by_kind[engine.kind]
        if param is not None:
            lacking[engine.name] = param
    return lacking


def none_capable(catalog: Catalog, lacking: dict[str, str]) -> OpenAIHTTPError | None:
    """The 400 for a request no serving engine can carry (None: some can, or none serve)."""
    if not lacking or len(lacking) < len(catalog.engines):
        return None
    if all(name in catalog.embedders for name in lacking):
        return invalid_request(
            "This model is an embedding model: its engines serve /v1/embeddings, not "
            "generation.", "model",
        )
    param = next(v for v in lacking.values() if v != "model")
    kinds = sorted({e.kind for e in catalog.engines if lacking.get(e.name) == param})
    return invalid_request(
        f"'{param}' is not supported by the engines serving this model ({', '.join(kinds)}): "
        f"{why_missing(param)}.",
        param,
    )
