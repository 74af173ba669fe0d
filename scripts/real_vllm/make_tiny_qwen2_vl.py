#!/usr/bin/env python3
"""Build a tiny random-weight Qwen2-VL model directory, offline, around the demo vision model.

Run it with the real-vLLM peer's Python (torch, transformers 5)::

    <peer-venv>/bin/python scripts/real_vllm/make_tiny_qwen2_vl.py DEMO_VISION_DIR OUT_DIR

The tokenizer, chat template and ``preprocessor_config.json`` are the demo
vision model's (``direct_frontend/text/demo-vision-model``: Qwen2-VL's vision
tokens, images of at most 64 tokens); the weights are a
``Qwen2VLForConditionalGeneration`` with a one-block vision tower and a
two-layer text model, head_dim 32 (a head size vLLM's CPU attention accepts),
M-RoPE sections summing to 16, seeded, float32. Written to a temporary sibling
and renamed into place.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def build(demo: Path, out: Path) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    demo_config = json.loads((demo / "config.json").read_text())
    vocab = demo_config["vocab_size"]
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 32, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [4, 6, 6]},
            "tie_word_embeddings": False, "eos_token_id": demo_config["eos_token_id"],
            "bos_token_id": None, "pad_token_id": None,
        },
        vision_config={
            "depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=demo_config["image_token_id"],
        video_token_id=demo_config["video_token_id"],
        vision_start_token_id=demo_config["vision_start_token_id"],
        vision_end_token_id=demo_config["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                 "generation_config.json"):
        shutil.copy(demo / name, tmp / name)
    template = json.loads((demo / "tokenizer_config.json").read_text())["chat_template"]
    (tmp / "chat_template.jinja").write_text(template)
    pre = json.loads((tmp / "preprocessor_config.json").read_text())
    pre["processor_class"] = "Qwen2VLProcessor"
    (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
