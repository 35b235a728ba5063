"""Llama-style decoder cases (eigenhooks/models/decoders.py)."""

import transformers as T
from harness import Case, seeded, sum_mid, token_inputs

TOK = token_inputs()


def small(cls, cfg_cls, **kw):
    """A 2-layer, d=16, 4-query/2-kv-head decoder of one Llama-style family."""
    base = dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=32,
    )
    base.update(kw)
    return seeded(lambda: cls(cfg_cls(**base)))


LLAMA_MID = sum_mid(lambda m: m.base_model.layers, lambda b: b.self_attn)

CASES = {
    "llama": Case(small(T.LlamaForCausalLM, T.LlamaConfig), "llama", LLAMA_MID, TOK, generate=True),
    "mistral": Case(small(T.MistralForCausalLM, T.MistralConfig), "mistral", LLAMA_MID, TOK, generate=True),
    "qwen2": Case(small(T.Qwen2ForCausalLM, T.Qwen2Config), "qwen2", LLAMA_MID, TOK, generate=True),
    "qwen3": Case(small(T.Qwen3ForCausalLM, T.Qwen3Config, head_dim=4), "qwen3", LLAMA_MID, TOK, generate=True),
}
