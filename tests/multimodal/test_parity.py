"""Our preprocessing equals the Hugging Face reference processors' (their PIL backends).

The reference (transformers' PIL image processors and the Qwen2-VL and LLaVA
processors, which need no torch) runs here only, in tests. A chat with images
goes through the router's whole walk (pipeline/media.py: decode, preprocess,
template, expand, tokenize) and is compared with the reference processor
given the same rendered prompt and the same decoded images: the token ids
equal, the tensors within float tolerance, over images of different sizes and
modes. The model directories are built here, offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from PIL import Image

from direct_frontend.multimodal.fetch import open_image
from direct_frontend.multimodal.policy import MediaPolicy
from direct_frontend.multimodal.processors import (
    LlavaProcessor,
    QwenVLProcessor,
    load_processor,
)
from direct_frontend.openai.parse import parse_chat_request
from direct_frontend.pipeline.media import MediaProfile, lists_content, media_prompt
from direct_frontend.pipeline.preprocess import message_dict
from direct_frontend.text import demo_vision
from direct_frontend.text.demo_model import train_tokenizer
from direct_frontend.text.model_dir import TextModel
from tests.support.images import data_url, encoded, picture

transformers = pytest.importorskip("transformers")
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.models.llava.image_processing_pil_llava import (  # noqa: E402
    LlavaImageProcessorPil,
)
from transformers.models.llava.processing_llava import (  # noqa: E402
    LlavaProcessor as ReferenceLlava,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor  # noqa: E402
from transformers.processing_utils import ProcessorMixin  # noqa: E402


class ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """The reference Qwen2-VL processor without its video processor (which needs torch)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: Any = None, **kwargs: Any) -> None:
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = None
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def _transparent_p() -> Image.Image:
    image = picture(23, 29, "P", seed=9)
    image.info["transparency"] = 0
    return image


#: sizes and modes: a few of each, tiny, large, odd aspect, with and without transparency
IMAGES: list[tuple[str, Image.Image]] = [
    ("rgb", picture(64, 48, "RGB", seed=1)),
    ("rgba", picture(33, 77, "RGBA", seed=2)),
    ("grey", picture(300, 200, "L", seed=3)),
    ("palette", picture(17, 19, "P", seed=4)),
    ("palette-transparent", _transparent_p()),
    ("grey-alpha", picture(40, 30, "RGB", seed=5).convert("LA")),
    ("tiny", picture(1, 1, "RGB", seed=6)),
    ("large", picture(1200, 900, "RGB", seed=7)),
    ("odd-aspect", picture(2, 300, "RGB", seed=8)),
]
POLICY = MediaPolicy(max_images=len(IMAGES))


def _decoded(png: bytes) -> Image.Image:
    """The image as the router decodes it (what the reference is given too)."""
    return open_image(png, "image/png", POLICY, "x")


def _chat(pngs: list[bytes]) -> Any:
    content: list[Any] = []
    for i, png in enumerate(pngs):
        content += [{"type": "text", "text": f"Picture {i}:"},
                    {"type": "image_url", "image_url": {"url": data_url(png)}}]
    content.append({"type": "text", "text": "What do they show?"})
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": content}]}
    return parse_chat_request(json.dumps(body).encode())


def _ours(model_dir: Path, pngs: list[bytes]) -> tuple[str, tuple[int, ...], Any]:
    text_model = TextModel.load(model_dir)
    processor = load_processor(model_dir, text_model.token_to_id)
    assert processor is not None
    profile = MediaProfile(processor, POLICY, list_content=lists_content(
        text_model.template_text))
    request = _chat(pngs)

    async def encode(text: str) -> list[int]:
        return text_model.encode(text)

    async def run() -> tuple[str, tuple[int, ...], Any]:
        return await media_prompt(request, text_model, profile,
                                  [message_dict(m) for m in request.messages], None, encode)

    return trio.run(run)


def _tensor(media: Any, name: str) -> np.ndarray:
    tensor = dict(media.batch.tensors)[name] if name != "pixel_values" else (
        media.batch.pixel_values)
    dtype = {"float32": np.float32, "int64": np.int64}[tensor.dtype]
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape)


def _qwen_config(model_dir: Path) -> dict[str, Any]:
    raw = json.loads((model_dir / "preprocessor_config.json").read_text())
    return {k: v for k, v in raw.items() if k != "image_processor_type"}


def test_qwen_vl_chat_equals_the_reference_processor(tmp_path: Path) -> None:
    model_dir = demo_vision.build_model_dir(tmp_path / "qwen")
    pngs = [encoded(image) for _, image in IMAGES]
    prompt, ids, media = _ours(model_dir, pngs)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    reference = ImagesOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**_qwen_config(model_dir)), tokenizer=tokenizer)
    expected = reference(text=[prompt], images=[_decoded(p) for p in pngs], return_tensors="np")
    assert list(ids) == expected["input_ids"][0].tolist()
    np.testing.assert_array_equal(_tensor(media, "image_grid_thw"), expected["image_grid_thw"])
    np.testing.assert_allclose(_tensor(media, "pixel_values"), expected["pixel_values"],
                               rtol=0, atol=1e-6)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    runs = [(o, n) for o, n in media.placeholders]
    assert sum(n for _, n in runs) == expected["input_ids"][0].tolist().count(image_id)
    assert all(set(expected["input_ids"][0][o:o + n].tolist()) == {image_id} for o, n in runs)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_qwen_family_configs_equal_the_reference(family: str) -> None:
    """Qwen2.5-VL's defaults (large images kept large) and Qwen3-VL's (16-pixel patches,
    mean and std 0.5), on every test image."""
    if family == "qwen2.5-vl":
        config: dict[str, Any] = {"min_pixels": 3136, "max_pixels": 12845056}
    else:
        config = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                  "min_pixels": 65536, "max_pixels": 1048576}
    ours = QwenVLProcessor(image_token_id=1, **{
        "patch_size": config.get("patch_size", 14),
        "min_pixels": config["min_pixels"], "max_pixels": config["max_pixels"],
        **({"mean": (0.5,) * 3, "std": (0.5,) * 3} if "image_mean" in config else {}),
    })
    reference = Qwen2VLImageProcessorPil(**config)
    for name, image in IMAGES:
        decoded = _decoded(encoded(image))
        expected = reference(decoded, return_tensors="np")
        got = ours.process(decoded, "auto")
        assert got.grid_thw == tuple(expected["image_grid_thw"][0].tolist()), name
        np.testing.assert_allclose(got.pixel_values, expected["pixel_values"], rtol=0,
                                   atol=1e-6, err_msg=name)


LLAVA_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- message.role.upper() + ': ' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<image>\\n' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)


def llava_dir(path: Path, *, pad: bool) -> Path:
    """A tiny LLaVA-1.5-style directory: 56-pixel crops of 14-pixel patches (16 tokens)."""
    path.mkdir(parents=True)
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens(["<image>", "</s>"])
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    image_id = tokenizer.token_to_id("<image>")
    files = {
        "tokenizer_config.json": {"chat_template": LLAVA_TEMPLATE, "eos_token": "</s>"},
        "config.json": {"model_type": "llava", "image_token_index": image_id,
                        "vision_feature_select_strategy": "default",
                        "vision_config": {"patch_size": 14, "image_size": 56}},
        "processor_config.json": {"patch_size": 14, "vision_feature_select_strategy": "default",
                                  "num_additional_image_tokens": 1, "image_token": "<image>"},
        "preprocessor_config.json": {
            "image_processor_type": "CLIPImageProcessor", "do_resize": True,
            "size": {"shortest_edge": 56}, "do_center_crop": True,
            "crop_size": {"height": 56, "width": 56}, "resample": 3, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711], "do_pad": pad},
    }
    for name, data in files.items():
        (path / name).write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("pad", [False, True])
def test_llava_chat_equals_the_reference_processor(tmp_path: Path, pad: bool) -> None:
    model_dir = llava_dir(tmp_path / "llava", pad=pad)
    pngs = [encoded(image) for _, image in IMAGES]
    prompt, ids, media = _ours(model_dir, pngs)
    assert isinstance(load_processor(model_dir, TextModel.load(model_dir).token_to_id),
                      LlavaProcessor)
    raw = json.loads((model_dir / "preprocessor_config.json").read_text())
    reference = ReferenceLlava(
        image_processor=LlavaImageProcessorPil(
            size=raw["size"], crop_size=raw["crop_size"], do_pad=pad, resample=3),
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json")),
        patch_size=14, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1)
    expected = reference(text=[prompt], images=[_decoded(p) for p in pngs], return_tensors="np")
    assert list(ids) == expected["input_ids"][0].tolist()
    assert [n for _, n in media.placeholders] == [16] * len(IMAGES)
    np.testing.assert_allclose(_tensor(media, "pixel_values"), expected["pixel_values"],
                               rtol=0, atol=1e-6)
