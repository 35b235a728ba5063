"""Unusual-attention and hybrid cases (eigenhooks/models/special.py).

gpt_oss (sinks), deepseek_v3 (MLA) and qwen3_next (gated output) have nonlinear value
paths: F from the weights is the linear map stated in special.py, and the probe is not
compared to it here. tests/models/test_nonlinear_value_paths.py checks each stated F against the model's own
identical-token output, from the raw weights: gpt_oss with the sinks switched off, MLA as
F x / rms(latent), qwen3_next as O (sigmoid(gate) * V x).
"""

import transformers as T
from harness import Case, seeded, sum_mid, token_inputs

from .decoders import BASE as DECODER_BASE

TOK = token_inputs()

BASE = DECODER_BASE  # the same tiny Llama-shaped config as the decoders


def cfg(**kw) -> dict:
    """The tiny base config with overrides."""
    return {**BASE, **kw}


def attention_blocks(m):
    """The blocks that hold softmax attention (hybrids interleave others)."""
    base = m.base_model if hasattr(m.base_model, "layers") else m.model  # Llama4ForCausalLM: base_model is m
    return [b for b in base.layers if hasattr(b, "self_attn")]


ATTN_MID = sum_mid(attention_blocks, lambda b: b.self_attn)

LLAMA4 = cfg(
    intermediate_size_mlp=32,
    num_local_experts=2,
    num_experts_per_tok=1,
    head_dim=4,
    interleave_moe_layer_step=1,
    attention_chunk_size=4,
    no_rope_layer_interval=2,
)
GPT_OSS = cfg(head_dim=4, num_local_experts=2, num_experts_per_tok=1, sliding_window=4)
DEEPSEEK = cfg(
    num_key_value_heads=4,
    moe_intermediate_size=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    initializer_range=0.2,  # F is a product of three projections: keep it well above rounding
)
JAMBA = cfg(
    num_hidden_layers=4,
    attn_layer_period=2,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    num_experts=2,
    num_experts_per_tok=1,
    mamba_d_state=4,
    mamba_d_conv=2,
    mamba_expand=2,
    mamba_dt_rank=4,
)
QWEN3_NEXT = cfg(
    num_hidden_layers=4,
    head_dim=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=4,
    linear_value_head_dim=4,
    linear_conv_kernel_dim=2,
    num_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def build(cls, cfg_cls, kw):
    return seeded(lambda: cls(cfg_cls(**kw)))


CASES = {
    "llama4_text": Case(
        build(T.Llama4ForCausalLM, T.Llama4TextConfig, LLAMA4), "llama4_text", ATTN_MID, TOK, generate=True
    ),
    "gpt_oss (sinks)": Case(
        build(T.GptOssForCausalLM, T.GptOssConfig, GPT_OSS), "gpt_oss", ATTN_MID, TOK, generate=True, nonlinear=True
    ),
    "deepseek_v3 (MLA)": Case(
        build(T.DeepseekV3ForCausalLM, T.DeepseekV3Config, DEEPSEEK),
        "deepseek_v3",
        ATTN_MID,
        TOK,
        generate=True,
        nonlinear=True,
    ),
    "jamba (hybrid)": Case(build(T.JambaForCausalLM, T.JambaConfig, JAMBA), "jamba", ATTN_MID, TOK, generate=True),
    "qwen3_next (hybrid, gated)": Case(
        build(T.Qwen3NextForCausalLM, T.Qwen3NextConfig, QWEN3_NEXT),
        "qwen3_next",
        ATTN_MID,
        TOK,
        generate=True,
        nonlinear=True,
    ),
}
