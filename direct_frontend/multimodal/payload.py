"""What a request's images become on their way to an engine, and each image's hash.

:class:`MediaPayload` rides on the neutral ``GenerateCall``: the prompt's ids
already hold each image's expanded placeholder run, the batch its tensors,
``placeholders`` where each run is, ``hashes`` one id per image. The engines
take the hash as the image's identity: vLLM caches encoder outputs under it
and keys the KV blocks an image's tokens fill with it, so the KV-aware
router, which keys blocks the same way (kv/index.py ``mm_block_extras``),
predicts a repeated image prefix as it predicts text.

A worker that processes media itself (a vLLM servicer advertising a media
processor) is sent ``refs`` instead: the images as the client gave them (data
URLs, http(s) URLs), with the prompt's one unexpanded placeholder per image
(``anchor_ids``).
"""

from __future__ import annotations

import dataclasses
import hashlib

from direct_frontend.multimodal.processors import Batch


def image_hash(data: bytes, fingerprint: str, detail: str) -> str:
    """An image's identity: its bytes and what shaped its tensors (hex SHA-256).

    Two requests with the same image and processor settings get the same id,
    so the engines reuse its encoder output and its KV blocks; any change to
    what the tensors are made of gives another id.
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
    #: the images as the client sent them, for a worker that fetches and processes them
    refs: tuple[str, ...] = ()
    #: the prompt before expansion: one placeholder token per image (with ``refs``)
    anchor_ids: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return len(self.placeholders)

    def kv_items(self) -> tuple[tuple[str, int, int], ...]:
        """(hash, offset, length) per image: what keys the KV blocks its tokens fill."""
        return tuple((h, offset, length)
                     for h, (offset, length) in zip(self.hashes, self.placeholders, strict=True))
