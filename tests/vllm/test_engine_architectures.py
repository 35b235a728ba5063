"""Every architecture eigenhooks monitors on vLLM, held to the HF monitor on a seeded tiny checkpoint (issue 57).

One tiny GQA model per architecture of ``models.vllm.VLLM_ARCHITECTURES`` (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma, Gemma 2, Gemma 3, Granite, OLMo 2) (head_dim 32: CPU attention
refuses 16; norms moved away from 1; Granite's multipliers away from 1), served by an opted-in eager
engine; its table must equal the HF monitor's on the tokens the engine processed (tests/vllm/parity.py:
counts exact, gamma to 1e-4). The structurally new layouts (Gemma 2 and 3's sandwich norm, Granite's single
stream, OLMo 2's transformers layers) are held in compiled mode too. An architecture vLLM serves that eigenhooks cannot read is refused
at the build (test_engine_limits.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from parity import compare, hf_table, processed_tokens
from test_engine_monitor import OPT_IN, OPTS, greedy, prompts, shut
from tier import start_engine

import eigenhooks as eh
from eigenhooks.models.vllm import VLLM_ARCHITECTURES

BASE = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
    pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip


def _configs():
    import transformers as T

    return {
        "LlamaForCausalLM": (T.LlamaForCausalLM, T.LlamaConfig, {}),
        "MistralForCausalLM": (T.MistralForCausalLM, T.MistralConfig, {}),
        "Qwen2ForCausalLM": (T.Qwen2ForCausalLM, T.Qwen2Config, {}),
        "Qwen3ForCausalLM": (T.Qwen3ForCausalLM, T.Qwen3Config, {}),
        "Phi3ForCausalLM": (T.Phi3ForCausalLM, T.Phi3Config, {}),
        "GemmaForCausalLM": (T.GemmaForCausalLM, T.GemmaConfig, {}),
        "Gemma2ForCausalLM": (  # vLLM's Gemma 2 ties its embeddings (an lm_head in the checkpoint is refused)
            T.Gemma2ForCausalLM,
            T.Gemma2Config,
            {"query_pre_attn_scalar": 32, "tie_word_embeddings": True},
        ),
        "Gemma3ForCausalLM": (T.Gemma3ForCausalLM, T.Gemma3TextConfig, {"query_pre_attn_scalar": 32}),
        "Olmo2ForCausalLM": (T.Olmo2ForCausalLM, T.Olmo2Config, {}),
        "GraniteForCausalLM": (
            T.GraniteForCausalLM,
            T.GraniteConfig,
            {"residual_multiplier": 0.5, "embedding_multiplier": 3.0, "attention_multiplier": 0.2},
        ),
    }


def save_tiny(folder, arch: str, seed: int = 0):
    """A seeded tiny checkpoint of ``arch`` (norm scales away from 1) with the zoo's tokenizer."""
    cls, cfg_cls, extra = _configs()[arch]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**{**BASE, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.rand_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [arch]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(eh.zoo.path("gpt2-tiny") / f, folder / f)
    return folder


def test_the_table_covers_every_monitored_architecture():
    assert sorted(_configs()) == sorted(VLLM_ARCHITECTURES)


@pytest.mark.parametrize("arch", ["Starcoder2ForCausalLM"])
def test_an_architecture_eigenhooks_cannot_read_is_refused_by_name_at_the_build(arch, tmp_path):
    """vLLM serves these; eigenhooks reads their spectra but not their layers in the engine: refused in one
    line naming the architecture, before anything loads (never measured wrong)."""
    import transformers as T

    cls, cfg_cls = {"Starcoder2ForCausalLM": (T.Starcoder2ForCausalLM, T.Starcoder2Config)}[arch]
    torch.manual_seed(0)
    cls(cfg_cls(**BASE)).save_pretrained(tmp_path / arch)
    with pytest.raises(eh.UnsupportedModelError, match=rf"cannot monitor vLLM architecture \['{arch}'\]") as e:
        start_engine(tmp_path / arch, additional_config=OPT_IN)
    assert "\n" not in str(e.value)


def _parity(folder, **engine_kw):
    llm = start_engine(folder, additional_config=OPT_IN, **engine_kw)
    try:
        with eh.monitor(llm, **OPTS) as mon:
            outs = llm.generate(prompts([23, 9, 31], seed=7), greedy(5))
    finally:
        shut(llm)
    seqs = processed_tokens(outs)
    got = mon.summary()
    compare(got, hf_table(folder, seqs, **OPTS))
    assert int(got["n_tokens"].iloc[0]) == sum(len(s.token_ids) for s in seqs) == 63 + 3 * 4


@pytest.mark.parametrize("arch", sorted(VLLM_ARCHITECTURES))
def test_eager_engine_equals_hf_for_each_architecture(arch, tmp_path):
    _parity(save_tiny(tmp_path / arch, arch), enforce_eager=True)


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM"])
def test_compiled_engine_equals_hf_for_the_new_layouts(arch, tmp_path):
    _parity(save_tiny(tmp_path / arch, arch))
