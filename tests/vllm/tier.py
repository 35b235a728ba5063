"""Plain helpers of the vLLM tier (no fixtures): the tiny checkpoint, engine settings, greedy sampling.

Test modules import these from here (``from tier import greedy``), never from ``conftest``: several
conftest.py files share that module name under tests/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# Engine settings every test engine shares: float32 (dtype='auto' is bf16 on the CPU backend), 10 % of RAM
# for the KV cache (the CPU meaning of gpu_memory_utilization; the default 0.92 refuses to start here).
ENGINE = dict(dtype="float32", gpu_memory_utilization=0.1, max_model_len=256, seed=0)
TINY = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    initializer_range=0.05,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)  # fmt: skip  (head_dim 32: CPU attention refuses 16)
MAX_PARAMS = 1_000_000


def save_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save the tiny GQA Llama (``TINY`` with overrides) and the gpt2-tiny tokenizer into ``folder``."""
    import transformers as T

    import eigenhooks as eh

    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**TINY, **overrides})).eval()
    n = sum(p.numel() for p in model.parameters())
    assert n < MAX_PARAMS, f"the tiny Llama has {n} parameters: a config key misspelt?"
    with torch.no_grad():  # norm scales away from 1, so a folded norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.rand_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    zoo_tok = eh.zoo.path("gpt2-tiny")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(zoo_tok / f, folder / f)
    return folder


def start_engine(folder, **kw):
    """A ``vllm.LLM`` on ``folder`` with the tier's settings (``ENGINE``), overridden by ``kw``."""
    from vllm import LLM

    return LLM(model=str(folder), **{**ENGINE, **kw})


def greedy(max_tokens: int):
    """Greedy sampling of exactly ``max_tokens`` tokens (``ignore_eos``): the tokens are the checkpoint's."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
