"""Per-family image preprocessing, read from the model directory, equal to the reference's.

The numbers are those of the Hugging Face processors' PIL backend (the
reference the parity test runs, tests/multimodal/test_parity.py), step for
step, so the tensors match within float rounding: convert to RGB (an image
with transparency composited onto white), resize with Pillow on the 8-bit
image, rescale in float64 then float32, normalise in float32, then the
family's own layout. Two families:

- **Qwen2-VL, Qwen2.5-VL, Qwen3-VL** (``Qwen2VLImageProcessor``): a resize to a
  multiple of ``patch_size × merge_size`` within ``[min_pixels, max_pixels]``
  keeping the aspect ratio, then patches of ``channels × temporal_patch_size ×
  patch_size²`` values (the still image repeated over time), one row per
  patch, ``image_grid_thw`` = (1, h, w) in patches; the prompt's
  ``<|image_pad|>`` becomes ``h·w / merge_size²`` of them.
- **LLaVA-style** (``CLIPImageProcessor``/``LlavaImageProcessor``): optional
  pad to a square, shortest edge resized, centre crop, one ``3 × H × W`` tensor
  per image; ``<image>`` becomes ``(H/patch)·(W/patch)`` tokens (+ the
  backbone's extra tokens, − the CLS one the ``default`` strategy drops).

A ``detail`` of ``low`` caps a Qwen image at 256 tokens (the router's own
rule: the reference has no such knob; ``auto`` and ``high`` take the
model's settings). LLaVA's images have one size whatever the detail.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from direct_frontend.json_files import read_object
from direct_frontend.multimodal.errors import MediaError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from PIL import Image

    Floats = npt.NDArray[np.float32]
    Ints = npt.NDArray[np.int64]

OPENAI_CLIP_MEAN: Final = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: Final = (0.26862954, 0.26130258, 0.27577711)
#: ``detail: "low"``: at most this many image tokens for a Qwen image
LOW_DETAIL_TOKENS: Final = 256
BICUBIC: Final = 3
QWEN_TYPES: Final = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
LLAVA_TYPES: Final = frozenset({"llava"})


class ProcessorConfigError(Exception):
    """A model directory's processor files cannot be read into a processor we have."""


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image, preprocessed: its tensors and the placeholder tokens it fills."""

    pixel_values: Floats  # Qwen: (patches, patch values); LLaVA: (3, H, W)
    tokens: int
    grid_thw: tuple[int, int, int] | None = None  # Qwen only
    #: the same layout of the resized 8-bit pixels, neither rescaled nor normalised: what an
    #: engine that normalises on device takes (vLLM's ``mm_device_do_normalize``)
    raw_pixel_values: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor as the engine contracts carry it: little-endian bytes, shape and dtype."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", "uint8"

    @classmethod
    def of(cls, array: Any) -> Tensor:
        import numpy as np

        dtype = {np.dtype("float32"): "float32", np.dtype("int64"): "int64",
                 np.dtype("uint8"): "uint8"}[array.dtype]
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        return cls(data, tuple(int(d) for d in array.shape), dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """A request's images as the engines take them: tensors and how vLLM slices them."""

    pixel_values: Tensor
    tensors: tuple[tuple[str, Tensor], ...] = ()  # model-specific (image_grid_thw, ...)
    #: ``pixel_values`` as raw 8-bit pixels (for an engine that normalises on device)
    raw_pixel_values: Tensor | None = None
    batched_keys: tuple[str, ...] = ()  # first dimension is per image
    flat_keys: tuple[tuple[str, str], ...] = ()  # tensor → the tensor of per-image sizes
    keep_on_cpu_keys: tuple[str, ...] = ()


class ImageProcessor(Protocol):
    """One family's preprocessing, configured from a model directory."""

    @property
    def family(self) -> str: ...

    @property
    def image_token(self) -> str:
        """The token a rendered prompt holds once per image, expanded to its length."""

    @property
    def image_token_id(self) -> int: ...

    @property
    def template_text(self) -> str:
        """What a chat template that takes text content gets in place of an image."""

    @property
    def fingerprint(self) -> str:
        """The settings that shape the tensors, for image hashes (a changed config, a
        changed hash: an engine's encoder cache must not serve the old tensors)."""

    def process(self, image: Image.Image, detail: str) -> ProcessedImage: ...

    def batch(self, images: Sequence[ProcessedImage]) -> Batch: ...


def expand(text: str, token: str, counts: Sequence[int], param: str) -> str:
    """``text`` with its i-th ``token`` repeated ``counts[i]`` times (what the reference
    processors do to the prompt before tokenizing it); a 400 when the template did not
    write one token per image."""
    pieces = text.split(token)
    if len(pieces) - 1 != len(counts):
        raise MediaError(f"The chat template placed {len(pieces) - 1} image placeholders for "
                         f"{len(counts)} images.", param)
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:], strict=True):
        out.append(token * count)
        out.append(piece)
    return "".join(out)


def placeholder_ranges(ids: Sequence[int], token_id: int, counts: Sequence[int],
                       param: str) -> list[tuple[int, int]]:
    """Where each image's run of ``token_id`` sits in ``ids``: (offset, length) in order."""
    ranges: list[tuple[int, int]] = []
    at = 0
    n = len(ids)
    for count in counts:
        while at < n and ids[at] != token_id:
            at += 1
        if at + count > n or any(ids[i] != token_id for i in range(at, at + count)):
            raise MediaError("The tokenized prompt does not hold the expanded image "
                             "placeholders where expected.", param)
        ranges.append((at, count))
        at += count
    return ranges


def _rgb(image: Image.Image) -> Image.Image:
    """RGB as the reference converts it: transparency composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _normalized(pixels: Any, scale: float, mean: Sequence[float] | None,
                std: Sequence[float] | None, rescale: bool) -> Floats:
    """8-bit HWC pixels rescaled (in float64, kept as float32) and normalised in float32,
    as channel-first (CHW) float32.

    Each output value depends only on its channel and its 8-bit input, so the
    reference's arithmetic is done once per channel and value (a 3 × 256 table,
    the very same operations on the very same numbers) and the image is one
    lookup per pixel: equal to the reference to the bit, several times faster.
    """
    import numpy as np

    values = np.arange(256, dtype=np.uint8)
    scaled: Any = values.astype(np.float64) * scale if rescale else values
    table: Any = np.repeat(scaled.astype(np.float32)[None, :], 3, axis=0)  # (3, 256)
    if mean is not None and std is not None:
        table = ((table.T - np.array(mean, dtype=np.float32))
                 / np.array(std, dtype=np.float32)).T
    table = np.ascontiguousarray(table, dtype=np.float32)
    out: Floats = np.empty((3, pixels.shape[0], pixels.shape[1]), dtype=np.float32)
    for channel in range(3):
        np.take(table[channel], pixels[:, :, channel], out=out[channel])
    return out


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen's target size: multiples of ``factor``, pixels within bounds, aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Processor:
    """What every family's processor is configured with: its image token, its patch size,
    and how it rescales, normalises and resamples pixels."""

    image_token_id: int
    family: str
    image_token: str
    template_text: str
    patch_size: int = 14
    mean: tuple[float, ...] | None = OPENAI_CLIP_MEAN
    std: tuple[float, ...] | None = OPENAI_CLIP_STD
    rescale: bool = True
    rescale_factor: float = 1 / 255
    resample: int = BICUBIC

    @property
    def fingerprint(self) -> str:
        return repr(dataclasses.astuple(self))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class QwenVLProcessor(_Processor):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL images (``Qwen2VLImageProcessor``)."""

    family: str = "qwen_vl"
    image_token: str = "<|image_pad|>"
    template_text: str = "<|vision_start|><|image_pad|><|vision_end|>"
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def target_size(self, height: int, width: int, detail: str) -> tuple[int, int]:
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if detail == "low":
            max_pixels = max(self.min_pixels, min(max_pixels, LOW_DETAIL_TOKENS * factor ** 2))
        return smart_resize(height, width, factor, self.min_pixels, max_pixels)

    def process(self, image: Image.Image, detail: str) -> ProcessedImage:
        import numpy as np

        rgb = _rgb(image)
        try:
            height, width = self.target_size(rgb.height, rgb.width, detail)
        except ValueError as exc:
            raise MediaError(f"The image cannot be used: {exc}.", None) from None
        resized = np.asarray(rgb.resize((width, height), resample=self.resample))
        pixels = _normalized(resized, self.rescale_factor, self.mean, self.std,
                             self.rescale)  # CHW
        grid_h, grid_w = height // self.patch_size, width // self.patch_size
        return ProcessedImage(self._patches(pixels), grid_h * grid_w // self.merge_size ** 2,
                              (1, grid_h, grid_w), self._patches(resized.transpose(2, 0, 1)))

    def _patches(self, pixels: Any) -> Any:
        """CHW pixels as rows of ``channels × temporal_patch_size × patch_size²`` values, in
        the order the merger reads them (the still image repeated over time)."""
        import numpy as np

        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = pixels.shape[1] // p, pixels.shape[2] // p
        patches = pixels.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None, :, :],
                                  (*patches.shape[:5], t, *patches.shape[5:]))
        return np.ascontiguousarray(patches.reshape(grid_h * grid_w, 3 * t * p * p))

    def batch(self, images: Sequence[ProcessedImage]) -> Batch:
        import numpy as np

        grids = np.array([image.grid_thw for image in images], dtype=np.int64)
        sizes = np.array([image.pixel_values.shape[0] for image in images], dtype=np.int64)
        pixels = np.concatenate([image.pixel_values for image in images], axis=0)
        raw = np.concatenate([image.raw_pixel_values for image in images], axis=0)
        return Batch(
            Tensor.of(pixels),
            (("image_grid_thw", Tensor.of(grids)), ("patches_per_image", Tensor.of(sizes))),
            batched_keys=("image_grid_thw", "patches_per_image"),
            flat_keys=(("pixel_values", "patches_per_image"),),
            keep_on_cpu_keys=("image_grid_thw",),
            raw_pixel_values=Tensor.of(raw),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LlavaProcessor(_Processor):
    """LLaVA-style images (``CLIPImageProcessor`` / ``LlavaImageProcessor``): one fixed size."""

    family: str = "llava"
    image_token: str = "<image>"
    template_text: str = "<image>"
    shortest_edge: int = 336
    crop: tuple[int, int] | None = (336, 336)  # (height, width); None: no centre crop
    pad_to_square: bool = False
    extra_tokens: int = 0  # num_additional_image_tokens
    drop_cls: bool = True  # vision_feature_select_strategy "default"

    def process(self, image: Image.Image, detail: str) -> ProcessedImage:
        import numpy as np

        rgb = _rgb(image)
        if self.pad_to_square and rgb.width != rgb.height:
            rgb = self._padded(rgb)
        height, width = _shortest_edge_size(rgb.height, rgb.width, self.shortest_edge)
        pixels = np.asarray(rgb.resize((width, height), resample=self.resample))
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        chw = _normalized(pixels, self.rescale_factor, self.mean, self.std, self.rescale)
        out_h, out_w = chw.shape[1], chw.shape[2]
        tokens = (out_h // self.patch_size) * (out_w // self.patch_size) + self.extra_tokens
        if self.drop_cls:
            tokens -= 1
        return ProcessedImage(np.ascontiguousarray(chw), tokens)

    def _padded(self, rgb: Image.Image) -> Image.Image:
        from PIL import Image

        side = max(rgb.width, rgb.height)
        fill = tuple(int(x * 255) for x in self.mean) if self.mean else (0, 0, 0)
        square = Image.new("RGB", (side, side), fill)
        square.paste(rgb, ((side - rgb.width) // 2, (side - rgb.height) // 2))
        return square

    def batch(self, images: Sequence[ProcessedImage]) -> Batch:
        import numpy as np

        shapes = {image.pixel_values.shape for image in images}
        if len(shapes) != 1:
            raise MediaError("The images of one request were preprocessed to different sizes.",
                             None)
        return Batch(Tensor.of(np.stack([image.pixel_values for image in images])),
                     batched_keys=("pixel_values",))


def _shortest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    """The reference's (height, width) for a shortest-edge resize (torchvision's rule)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_crop(pixels: Any, crop_h: int, crop_w: int) -> Any:
    """The reference's centre crop of an HWC array, zero-padded where it is smaller."""
    import numpy as np

    height, width = pixels.shape[0], pixels.shape[1]
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((new_h, new_w, pixels.shape[2]), dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_h - height) / 2), math.ceil((new_w - width) / 2)
    padded[top_pad:top_pad + height, left_pad:left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def _read(path: Path) -> dict[str, Any]:
    return read_object(path, ProcessorConfigError) if path.is_file() else {}


def _floats(value: Any, default: tuple[float, ...] | None) -> tuple[float, ...] | None:
    if isinstance(value, list) and all(isinstance(v, int | float) for v in value):
        return tuple(float(v) for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (float(value),) * 3
    return default


def _int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def load_processor(model_dir: str | Path,
                   token_id: Callable[[str], int | None]) -> ImageProcessor | None:
    """The image processor a model directory describes (None: not a vision model we serve).

    Read from ``preprocessor_config.json`` (the image processor's settings),
    ``processor_config.json`` (LLaVA's patch size and feature strategy) and
    ``config.json`` (the model type, the image token's id). ``token_id`` looks a
    token up in the model's tokenizer.
    """
    path = Path(model_dir)
    pre = _read(path / "preprocessor_config.json")
    if not pre:
        return None
    config = _read(path / "config.json")
    proc = _read(path / "processor_config.json")
    model_type = config.get("model_type")
    kind = str(pre.get("image_processor_type") or "")
    common = _pixel_settings(path, pre)
    if model_type in QWEN_TYPES or kind.startswith("Qwen2VLImageProcessor"):
        return _qwen(path, pre, token_id, common)
    if model_type in LLAVA_TYPES:
        return _llava(path, pre, proc, config, token_id, common)
    raise ProcessorConfigError(
        f"{path}: image processor {kind or '?'} of model type {model_type or '?'} is not one "
        "the router preprocesses (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA)")


def _pixel_settings(path: Path, pre: Mapping[str, Any]) -> dict[str, Any]:
    """How every family rescales, normalises and resamples, from ``preprocessor_config.json``."""
    settings: dict[str, Any] = {
        "rescale": pre.get("do_rescale", True) is not False,
        "rescale_factor": float(pre.get("rescale_factor", 1 / 255)),
        "resample": _int(pre, "resample", BICUBIC),
    }
    if pre.get("do_convert_rgb") is False:
        raise ProcessorConfigError(f"{path}: do_convert_rgb false is not supported")
    normalize = pre.get("do_normalize", True) is not False
    settings["mean"] = _floats(pre.get("image_mean"), OPENAI_CLIP_MEAN) if normalize else None
    settings["std"] = _floats(pre.get("image_std"), OPENAI_CLIP_STD) if normalize else None
    return settings


def _image_token_id(path: Path, token: str, token_id: Callable[[str], int | None]) -> int:
    tid = token_id(token)
    if tid is None:
        raise ProcessorConfigError(f"{path}: the tokenizer has no {token} token")
    return tid


def _qwen(path: Path, pre: Mapping[str, Any], token_id: Callable[[str], int | None],
          common: dict[str, Any]) -> QwenVLProcessor:
    tid = _image_token_id(path, "<|image_pad|>", token_id)
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    assert isinstance(size, dict)
    return QwenVLProcessor(
        image_token_id=tid,
        patch_size=_int(pre, "patch_size", 14),
        temporal_patch_size=_int(pre, "temporal_patch_size", 2),
        merge_size=_int(pre, "merge_size", 2),
        min_pixels=_int(pre, "min_pixels", _int(size, "shortest_edge", 56 * 56)),
        max_pixels=_int(pre, "max_pixels", _int(size, "longest_edge", 28 * 28 * 1280)),
        **common,
    )


def _llava(path: Path, pre: Mapping[str, Any], proc: Mapping[str, Any],
           config: Mapping[str, Any], token_id: Callable[[str], int | None],
           common: dict[str, Any]) -> LlavaProcessor:
    token = str(proc.get("image_token") or pre.get("image_token") or "<image>")
    tid = _image_token_id(path, token, token_id)
    size = pre.get("size")
    shortest = size.get("shortest_edge") if isinstance(size, dict) else size
    if not isinstance(shortest, int):
        raise ProcessorConfigError(f"{path}: size.shortest_edge is required")
    crop: tuple[int, int] | None = None
    if pre.get("do_center_crop", True) is not False:
        raw = pre.get("crop_size", shortest)
        crop = (_int(raw, "height", shortest), _int(raw, "width", shortest)) if isinstance(
            raw, dict) else (int(raw), int(raw))
    vision = config.get("vision_config") if isinstance(config.get("vision_config"),
                                                        dict) else {}
    assert isinstance(vision, dict)
    patch = proc.get("patch_size") or vision.get("patch_size")
    if not isinstance(patch, int):
        raise ProcessorConfigError(f"{path}: no patch_size in processor_config.json or "
                                   "config.json")
    strategy = proc.get("vision_feature_select_strategy",
                        config.get("vision_feature_select_strategy", "default"))
    return LlavaProcessor(
        image_token_id=tid,
        image_token=token,
        template_text=token,
        shortest_edge=shortest,
        crop=crop,
        pad_to_square=bool(pre.get("do_pad", False)),
        patch_size=patch,
        extra_tokens=_int(proc, "num_additional_image_tokens", 0),
        drop_cls=strategy == "default",
        **common,
    )
