"""A tiny vision-language model directory (Qwen2-VL layout) for tests and the demo fleet.

The demo model's tokenizer (:mod:`.demo_model`) with Qwen2-VL's vision tokens
added, a ChatML template that writes ``<|vision_start|><|image_pad|>
<|vision_end|>`` for each image part, a ``preprocessor_config.json`` of
``Qwen2VLImageProcessor`` sized small (at most 64 image tokens an image), and a
``config.json`` naming the image token. There are no weights: the simulator
serves it, and the router preprocesses its images as for a real Qwen2-VL.
Committed as package data (:data:`BUNDLED_DIR`), written by
``scripts/make_demo_model.py``.
"""

from __future__ import annotations

from pathlib import Path

from direct_frontend.text.demo_model import (
    EOS_TOKEN,
    MAX_POSITION_EMBEDDINGS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    demo_tokenizer_config,
    train_tokenizer,
    write_configs,
)

VISION_TOKENS: tuple[str, ...] = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
BUNDLED_DIR = Path(__file__).resolve().with_name("demo-vision-model")
"""The demo vision model as shipped (package data)."""
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role not in ('system', 'user', 'assistant', 'tool') %}"
    "{{- raise_exception('Unknown message role: ' + message.role) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- elif message.content %}"
    "{%- for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_model_dir(path: Path, *, max_pixels: int = 28 * 28 * 64) -> Path:
    """Write the demo vision model into ``path``; returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens(list(VISION_TOKENS))
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    ids = {token: tokenizer.token_to_id(token) for token in (*SPECIAL_TOKENS, *VISION_TOKENS)}
    tokenizer_config = demo_tokenizer_config(ids, CHAT_TEMPLATE)
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_convert_rgb": True, "do_resize": True, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
        "min_pixels": 56 * 56, "max_pixels": max_pixels,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    }
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "eos_token_id": ids[EOS_TOKEN],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }
    files = (("tokenizer_config.json", tokenizer_config),
             ("generation_config.json", {"eos_token_id": ids[EOS_TOKEN],
                                         "pad_token_id": ids[PAD_TOKEN]}),
             ("preprocessor_config.json", preprocessor), ("config.json", config))
    write_configs(path, files)
    return path
