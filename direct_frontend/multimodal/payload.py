"""What a request's images become on their way to an engine, and each image's hash.

:class:`MediaPayload` rides on the neutral ``GenerateCall``: the prompt's ids
already hold each image's expanded placeholder run, the batch its tensors,
``placeholders`` where each run is, ``hashes`` one id per image. The engines
take the hash as the image's identity: vLLM caches encoder outputs under it
and keys the KV blocks an image's tokens fill with it, so the KV-aware
router, which keys blocks the same way (kv/prefix.py ``mm_block_extras``),
predicts a repeated image prefix as it predicts text.

A worker that processes media itself (a vLLM servicer advertising a media
processor) is sent ``refs`` instead: the images as the client gave them (data
URLs, http(s) URLs), with the prompt's one unexpanded placeholder per image
(``anchor_ids``).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Sequence

from direct_frontend.multimodal.processors import Batch, Tensor


def image_hash(data: bytes, fingerprint: str, detail: str) -> str:
    """An image's identity: its bytes and what shaped its tensors (hex SHA-256).

    Two requests with the same image and processor settings get the same id,
    so the engines reuse its encoder output and its KV blocks; any change to
    what the tensors are made of gives another id. An engine takes one form of
    the pixels (raw or normalised, per its discovery), so one id names one
    encoder input on each engine.
    """
    digest = hashlib.sha256()
    digest.update(fingerprint.encode())
    digest.update(b"\0" + detail.encode() + b"\0")
    digest.update(data)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class MediaPayload:
    """A request's images, preprocessed, as every engine kind's dialect sends them."""

    batch: Batch
    #: the token each placeholder run repeats
    image_token_id: int
    #: (offset, length) of each image's run in the prompt's ids, in order
    placeholders: tuple[tuple[int, int], ...]
    hashes: tuple[str, ...]
    family: str = ""
    #: the images as the client sent them (URLs), for a worker that processes them itself
    refs: tuple[str, ...] = ()
    #: each image's bytes and declared media type, as fetched (for a ``data:`` reference)
    sources: tuple[tuple[bytes, str], ...] = dataclasses.field(default=(), repr=False)
    #: set for an engine that processes media itself: the URL schemes it fetches; the
    #: dialect then sends references and the unexpanded prompt instead of tensors
    ref_schemes: frozenset[str] | None = None
    #: set for an engine that rescales and normalises pixels itself (vLLM's
    #: ``mm_device_do_normalize``): it is sent the raw 8-bit pixels, where the batch has them
    raw_pixels: bool = False
    #: references may go to engines that process media themselves (``[model.media]
    #: engine_processing``); False: always tensors
    references_allowed: bool = True

    @property
    def count(self) -> int:
        return len(self.placeholders)

    @property
    def pixel_values(self) -> Tensor:
        """The pixels as this payload's engine takes them (raw or normalised)."""
        raw = self.batch.raw_pixel_values
        return raw if self.raw_pixels and raw is not None else self.batch.pixel_values

    def can_reference(self, schemes: frozenset[str]) -> bool:
        """Whether a worker fetching ``schemes`` can be sent every image as a reference."""
        return self.references_allowed and all(
            ("data" in schemes and data) or ref.split(":", 1)[0].lower() in schemes
            for ref, (data, _) in zip(self.refs, self.sources, strict=True))

    def references(self, schemes: frozenset[str]) -> tuple[str, ...] | None:
        """The images as URLs a worker fetching ``schemes`` takes (None: not all can be).

        A ``data:`` URL of the bytes the router fetched, when the worker takes
        them: it processes exactly the image the router checked, without a second
        fetch (and without network access of its own); else the client's URL.
        """
        out = []
        for ref, (data, media_type) in zip(self.refs, self.sources, strict=True):
            if "data" in schemes and data:
                encoded = base64.b64encode(data).decode()
                out.append(f"data:{media_type or 'application/octet-stream'};base64,{encoded}")
            elif ref.split(":", 1)[0].lower() in schemes:
                out.append(ref)
            else:
                return None
        return tuple(out)

    def anchor_ids(self, input_ids: Sequence[int]) -> list[int]:
        """``input_ids`` with each image's run cut back to one placeholder token: the prompt
        a worker expands itself (the token is special, so the unexpanded prompt tokenizes
        to exactly this)."""
        out: list[int] = []
        at = 0
        for offset, length in self.placeholders:
            out.extend(input_ids[at:offset + 1])
            at = offset + length
        out.extend(input_ids[at:])
        return out

    def kv_items(self) -> tuple[tuple[str, int, int], ...]:
        """(hash, offset, length) per image: what keys the KV blocks its tokens fill."""
        return tuple((h, offset, length)
                     for h, (offset, length) in zip(self.hashes, self.placeholders, strict=True))
