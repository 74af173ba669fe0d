"""A chat with images: fetched, decoded and preprocessed, its placeholders expanded.

The walk (:func:`media_prompt`), for a model whose directory describes an image
processor we have (multimodal/processors.py) and whose fleet entry lets it
take images (``[model.media]``):

1. every image part is fetched or decoded from its data URL at once, each
   under the policy's limits (multimodal/fetch.py), decoded and preprocessed
   in a worker thread under the daemon's decode limiter;
2. the chat template renders the messages with their image parts (a template
   that iterates content gets ``{"type": "image"}`` parts, one that reads text
   gets the model's placeholder text in place of each image);
3. each image's placeholder token is repeated to the image's length in the
   prompt text, as the reference processors do, and the text is tokenized;
4. the placeholder runs are found in the ids, and the payload (tensors,
   ranges, one hash per image) goes with the request to its engine.

Every refusal is a 4xx naming the image's content part; the first image in
request order that fails is the one named.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from direct_frontend.fleet.schema import MediaConfig
from direct_frontend.multimodal.errors import MediaError
from direct_frontend.multimodal.fetch import image_bytes, new_decode_limiter, open_image
from direct_frontend.multimodal.parts import ImagePart
from direct_frontend.multimodal.payload import MediaPayload, image_hash
from direct_frontend.multimodal.policy import MediaPolicy
from direct_frontend.multimodal.processors import (
    ImageProcessor,
    ProcessedImage,
    ProcessorConfigError,
    expand,
    load_processor,
    placeholder_ranges,
)
from direct_frontend.openai.errors import OpenAIHTTPError, invalid_request
from direct_frontend.openai.types import ChatMessage, ChatRequest
from direct_frontend.text.model_dir import ChatTemplateError, TextModel

log = logging.getLogger("direct_frontend.media")


@dataclasses.dataclass(frozen=True, slots=True)
class MediaProfile:
    """How one model takes images: its processor (None: it has none) and the fleet's rules."""

    processor: ImageProcessor | None
    policy: MediaPolicy = dataclasses.field(default_factory=MediaPolicy)
    #: the daemon's decode limiter (image decodes and preprocessing take turns under it)
    limiter: trio.CapacityLimiter = dataclasses.field(default_factory=new_decode_limiter)
    #: the chat template iterates a message's content parts (else it reads text)
    list_content: bool = True
    #: references may go to engines that process media themselves
    engine_processing: bool = True

    @property
    def takes_images(self) -> bool:
        return self.processor is not None and self.policy.enabled


def http_error(err: MediaError) -> OpenAIHTTPError:
    """The client's view of a refused image."""
    return OpenAIHTTPError(err.status, err.message, "invalid_request_error", err.param,
                           "invalid_image")


def refuse_images(model: str, parts: Sequence[ImagePart]) -> OpenAIHTTPError:
    """The 400 of a request with images to a model that takes none."""
    return invalid_request(
        f"The model '{model}' does not take images: only text content parts are supported "
        "for it.", param.removesuffix(".image_url") + ".type"
        if (param := parts[0].param).endswith(".image_url") else param)


Loaded = tuple[ProcessedImage, str, bytes, str]  # the image, its hash, its bytes and type


async def _one(part: ImagePart, profile: MediaProfile) -> Loaded:
    """One image fetched (or decoded from its data URL) and preprocessed, with its hash."""
    processor = profile.processor
    assert processor is not None
    data, declared = await image_bytes(part, profile.policy)

    def work() -> Loaded:
        image = open_image(data, declared, profile.policy, part.param)
        try:
            processed = processor.process(image, part.detail)
        except MediaError as err:
            raise MediaError(err.message, part.param, err.status) from None
        except (ValueError, OSError) as exc:  # Pillow on an image it decoded but cannot convert
            raise MediaError(f"The image cannot be processed: {exc}.", part.param) from None
        digest = image_hash(data, processor.fingerprint, part.detail)
        return processed, digest, data, declared

    return await trio.to_thread.run_sync(work, limiter=profile.limiter)


async def load_images(parts: Sequence[ImagePart], profile: MediaProfile) -> list[Loaded]:
    """Every image at once; the first failing one (in request order) is the error raised."""
    results: list[Loaded | None] = [None] * len(parts)
    errors: list[MediaError | None] = [None] * len(parts)

    async with trio.open_nursery() as nursery:
        for i, part in enumerate(parts):
            async def run(i: int = i, part: ImagePart = part) -> None:
                try:
                    results[i] = await _one(part, profile)
                except MediaError as err:
                    errors[i] = err
                    nursery.cancel_scope.cancel()
            nursery.start_soon(run)
    first = next((err for err in errors if err is not None), None)
    if first is not None:
        raise http_error(first)
    return [r for r in results if r is not None]


def image_message(base: dict[str, object], message: ChatMessage,
                  profile: MediaProfile) -> dict[str, object]:
    """A message's chat-template view with its images in place."""
    processor = profile.processor
    assert processor is not None and message.content_parts is not None
    if profile.list_content:
        base["content"] = [{"type": "text", "text": part} if isinstance(part, str)
                           else {"type": "image"} for part in message.content_parts]
    else:
        base["content"] = "\n".join(part if isinstance(part, str) else processor.template_text
                                    for part in message.content_parts)
    return base


Encode = Callable[[str], Awaitable[list[int]]]


async def media_prompt(
    request: ChatRequest, text_model: TextModel, profile: MediaProfile,
    messages: list[dict[str, object]], tools: list[dict[str, object]] | None, encode: Encode,
    *, add_generation_prompt: bool = True,
) -> tuple[str, tuple[int, ...], MediaPayload]:
    """The prompt text (unexpanded), its ids (expanded) and the payload of a chat with images.

    ``messages`` are the template's views of ``request.messages`` (text only);
    those with images get their parts here.
    """
    parts = request.images
    processor = profile.processor
    assert processor is not None
    limit = profile.policy.max_images
    if len(parts) > limit:
        raise invalid_request(f"At most {limit} images may be sent in one request to this "
                              f"model; this one has {len(parts)}.", parts[limit].param)
    loaded = await load_images(parts, profile)
    views = [image_message(view, m, profile) if m.images else view
             for view, m in zip(messages, request.messages, strict=True)]
    try:
        prompt = text_model.render_chat(views, add_generation_prompt=add_generation_prompt,
                                        tools=tools, extra=request.chat_template_kwargs)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None
    counts = [image.tokens for image, *_ in loaded]
    try:
        expanded = expand(prompt, processor.image_token, counts, "messages")
        ids = tuple(await encode(expanded))
        ranges = placeholder_ranges(ids, processor.image_token_id, counts, "messages")
        batch = await trio.to_thread.run_sync(
            processor.batch, [image for image, *_ in loaded], limiter=profile.limiter)
    except MediaError as err:
        raise http_error(err) from None
    payload = MediaPayload(batch, processor.image_token_id, tuple(ranges),
                           tuple(h for _, h, *_ in loaded), processor.family,
                           refs=tuple(part.url for part in parts),
                           sources=tuple((data, declared) for *_, data, declared in loaded),
                           references_allowed=profile.engine_processing)
    return prompt, ids, payload


def media_profile(model: str, config: MediaConfig, text_model: TextModel,
                  limiter: trio.CapacityLimiter) -> MediaProfile | None:
    """How ``model`` takes images, from its directory and ``[model.media]``; None: it takes
    none (no image processor in its directory, or one the router does not have: logged)."""
    try:
        processor = load_processor(text_model.path, text_model.token_to_id)
    except ProcessorConfigError as exc:
        log.warning("model %s: images are refused: %s", model, exc, extra={"model": model})
        return None
    if processor is None:
        return None
    if config.images and not vision_installed():
        log.warning("model %s: images are refused: Pillow and NumPy are not installed "
                    "(pip install 'direct-frontend[vision]')", model, extra={"model": model})
        return None
    policy = MediaPolicy(
        enabled=config.images, fetch=config.fetch, allowed_hosts=config.allowed_hosts,
        allowed_networks=tuple(ipaddress.ip_network(n) for n in config.allowed_networks),
        max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels,
        max_images=config.max_images, timeout_s=config.fetch_timeout_s,
        max_redirects=config.max_redirects,
    )
    if config.images:
        log.info("model %s: images through the %s processor", model, processor.family,
                 extra={"model": model})
    return MediaProfile(processor, policy, limiter, lists_content(text_model.template_text),
                        config.engine_processing)


def vision_installed() -> bool:
    """Whether the ``vision`` extra (Pillow, NumPy) is importable."""
    try:
        import numpy  # noqa: F401
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def lists_content(template_text: str) -> bool:
    """Whether a chat template reads images from a message's content parts (it names
    them: ``'image'``), rather than reading the content as text."""
    return "image" in template_text
