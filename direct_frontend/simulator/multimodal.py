"""The simulated engines' multimodal inputs: checked as a stock servicer would build them.

A stock vLLM servicer (smg-grpc-servicer 0.14.1) turns a preprocessed
``MultimodalInputs`` into the model's keyword arguments without the model's
processor: a tensor whose bytes do not fill its shape, placeholder runs out
of the prompt or not of the image token, a flat tensor whose per-image sizes
do not add up, or a hash per image missing, fail there or in the model. The
simulator refuses the same things with ``INVALID_ARGUMENT``, so a router bug
shows up in tests. It keeps the images' (hash, offset, length) to key the KV
blocks their tokens fill, as vLLM does (``_gen_mm_extra_hash_keys``): each
block overlapping an image's run carries (the hash, the run's offset from
the block's start) in its hash and in its ``BlockStored`` ``extra_keys``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpclib import GRPCError, Status

#: one image: (its hash, its placeholder run's offset in the prompt, the run's length)
MediaKey = tuple[str, int, int]

_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "uint32": 4, "int32": 4,
          "uint8": 1}


def _refuse(message: str) -> GRPCError:
    return GRPCError(Status.INVALID_ARGUMENT, f"multimodal input: {message}")


def _elements(tensor: Any, name: str, inline: bool) -> int:
    size = _SIZES.get(tensor.dtype)
    if size is None:
        raise _refuse(f"{name} has dtype {tensor.dtype!r}")
    count: int = math.prod(tensor.shape)
    data = tensor.inline if inline else tensor.data
    if len(data) != count * size:
        raise _refuse(f"{name} holds {len(data)} bytes for shape {list(tensor.shape)} "
                      f"of {tensor.dtype}")
    return count


def _ints(tensor: Any, inline: bool) -> list[int]:
    data = tensor.inline if inline else tensor.data
    width = _SIZES[tensor.dtype]
    return [int.from_bytes(data[i:i + width], "little", signed=True)
            for i in range(0, len(data), width)]


@functools.cache
def normalizes_on_device(model_dir: str) -> bool:
    """Whether vLLM 0.32 normalises this model's pixels on device (``mm_device_do_normalize``,
    on by default where the model class supports it: the Qwen-VL family, not LLaVA)."""
    path = Path(model_dir) / "preprocessor_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    kind = config.get("image_processor_type") if isinstance(config, dict) else None
    return isinstance(kind, str) and kind.startswith("Qwen2VLImageProcessor")


def check_inputs(mm: Any, prompt: Sequence[int], *, inline: bool, merge_size: int = 2,
                 raw_pixels: bool = False) -> tuple[MediaKey, ...]:
    """The images' KV keys once ``mm`` (either contract's ``MultimodalInputs``) checks out.

    ``inline``: vLLM's ``TensorData`` (bytes in ``inline``), else SGLang's (``data``).
    Placeholders must lie in the prompt, in order, each run all ``im_token_id``;
    with ``image_grid_thw`` (Qwen-VL), ``pixel_values`` has one row per patch of
    every image and each run ``t·h·w / merge_size²`` tokens. ``raw_pixels``: the
    engine normalises on device, so the pixels must be raw ``uint8`` (normalised
    ones would be normalised twice: no error on a real engine, a wrong answer).
    """
    ranges = [(p.offset, p.length) for p in mm.mm_placeholders]
    if not ranges:
        raise _refuse("no mm_placeholders")
    pixels = _pixels(mm, inline, raw_pixels)
    if not mm.HasField("im_token_id"):
        raise _refuse("no im_token_id")
    _check_placeholders(ranges, prompt, mm.im_token_id)
    tensors = dict(mm.model_specific_tensors)
    for name, tensor in tensors.items():
        _elements(tensor, name, inline)
    grid = tensors.get("image_grid_thw")
    if grid is not None:
        _check_grid(grid, pixels, ranges, inline, merge_size)
    elif pixels.shape[0] != len(ranges):
        raise _refuse(f"pixel_values has {pixels.shape[0]} images for {len(ranges)} "
                      "placeholders")
    hashes = list(getattr(mm, "mm_hashes", ()))
    if inline and len(hashes) != len(ranges):
        raise _refuse(f"{len(hashes)} mm_hashes for {len(ranges)} images")
    if not hashes:  # SGLang's contract carries none: key by position alone
        hashes = [f"image-{i}" for i in range(len(ranges))]
    return tuple((h, offset, length) for h, (offset, length) in zip(hashes, ranges, strict=True))


def _pixels(mm: Any, inline: bool, raw_pixels: bool) -> Any:
    """``pixel_values``, present, filled, and raw ``uint8`` where the engine normalises."""
    if not mm.HasField("pixel_values"):
        raise _refuse("no pixel_values")
    pixels = mm.pixel_values
    _elements(pixels, "pixel_values", inline)
    if raw_pixels and pixels.dtype != "uint8":
        raise _refuse(f"pixel_values are {pixels.dtype}, but this engine normalises on device "
                      "and takes raw uint8 pixels")
    return pixels


def _check_placeholders(ranges: Sequence[tuple[int, int]], prompt: Sequence[int],
                        token: int) -> None:
    """Each run in the prompt, after the previous one, and all ``token``."""
    end = 0
    for offset, length in ranges:
        if offset < end or length < 1 or offset + length > len(prompt):
            raise _refuse(f"placeholder ({offset}, {length}) overlaps another or leaves the "
                          f"prompt of {len(prompt)} tokens")
        if any(prompt[i] != token for i in range(offset, offset + length)):
            raise _refuse(f"placeholder ({offset}, {length}) is not a run of token {token}")
        end = offset + length


def _check_grid(grid: Any, pixels: Any, ranges: Sequence[tuple[int, int]], inline: bool,
                merge_size: int) -> None:
    """Qwen-VL: one ``t, h, w`` row per image, a pixel row per patch, a token per merged patch."""
    if list(grid.shape) != [len(ranges), 3]:
        raise _refuse(f"image_grid_thw has shape {list(grid.shape)} for {len(ranges)} images")
    values = _ints(grid, inline)
    patches = [values[i] * values[i + 1] * values[i + 2] for i in range(0, len(values), 3)]
    if len(pixels.shape) != 2 or pixels.shape[0] != sum(patches):
        raise _refuse(f"pixel_values has shape {list(pixels.shape)} for {sum(patches)} "
                      "patches")
    for (offset, length), count in zip(ranges, patches, strict=True):
        if length * merge_size * merge_size != count:
            raise _refuse(f"placeholder at {offset} has {length} tokens for {count} patches")


def block_extra_keys(media: Sequence[MediaKey], block_size: int,
                     n_blocks: int) -> list[list[tuple[str, int]] | None]:
    """Each block's (hash, offset from the block's start) pairs, as vLLM keys them."""
    extras: list[list[tuple[str, int]] | None] = [None] * n_blocks
    for identifier, offset, length in media:
        for block in range(offset // block_size,
                           min(n_blocks, -(-(offset + length) // block_size))):
            keys = extras[block]
            if keys is None:
                keys = extras[block] = []
            keys.append((identifier, offset - block * block_size))
    return extras
