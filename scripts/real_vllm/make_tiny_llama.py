#!/usr/bin/env python3
"""Build a tiny random-weight Llama model directory with its own BPE tokenizer, offline.

Run it with the real-vLLM peer's Python (it needs torch, transformers 5 and
tokenizers); ``scripts/real_vllm.py`` does that for you::

    <peer-venv>/bin/python scripts/real_vllm/make_tiny_llama.py OUT_DIR

The recipe is docs/real-vllm.md §3: a byte-level BPE tokenizer
trained on the interpreter's own standard library (no download), a BOS-adding
post-processor, a minimal chat template, and a 2-layer LlamaForCausalLM with
head_dim 32 (one of the head sizes vLLM's CPU attention accepts), seeded, in
float32. The directory is written to a temporary sibling first and renamed into
place, so an interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 2048
CORPUS_FILES = 60
MAX_LEN = 512

# Jinja; "\n" below is a real newline in the rendered prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: p.name)[:CORPUS_FILES]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    for want, token in enumerate(SPECIAL_TOKENS):
        got = core.token_to_id(token)
        if got != want:
            raise SystemExit(f"special token {token!r} got id {got}, expected {want}")
    # Prepend BOS the way Llama does, so vLLM's text-input path sees one too.
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token=None,
        model_max_length=MAX_LEN,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tok):  # -> transformers.LlamaForCausalLM
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    return model


def build(out: Path) -> dict:
    out = out.resolve()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_tokenizer()
    model = build_model(tok)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    # transformers 5 writes the template to chat_template.jinja only; keep a copy
    # in tokenizer_config.json as well, for readers that look only there.
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if not cfg.get("chat_template"):
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (tmp / required).is_file():
            raise SystemExit(f"model build did not write {required}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {
        "vocab_size": len(tok),
        "parameters": sum(p.numel() for p in model.parameters()),
        "files": sorted(p.name for p in out.iterdir()),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    info = build(Path(argv[1]))
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
