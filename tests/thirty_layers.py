"""A seeded tiny GPT-2 with 30 layers, SmolLM2's depth, saved as a model folder with gpt2-tiny's tokenizer:
what the report, progress and table tests need to see a real model's number of layers in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import eigenhooks as eh

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def thirty_layer_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = Path(eh.zoo.__file__).parent / "gpt2-tiny"
    ref = eh.zoo.load("gpt2-tiny")[0].config
    torch.manual_seed(30)
    cfg = GPT2Config(
        n_layer=30, n_head=2, n_embd=32, n_positions=128,
        vocab_size=ref.vocab_size, bos_token_id=ref.bos_token_id, eos_token_id=ref.eos_token_id,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    assert n < 3_000_000, n  # really tiny (a misspelt config key would build GPT-2 small)
    return model, tiny


def thirty_layer_folder(path: Path) -> Path:
    """path/ holding the model (safetensors) and gpt2-tiny's tokenizer: `eigenhooks run path` loads it."""
    model, tiny = thirty_layer_model()
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tiny / name, path / name)
    return path
