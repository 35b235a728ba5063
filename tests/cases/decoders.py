"""Llama-style decoder cases (eigenhooks/models/decoders.py).

Each ``mid`` reference is built from the block's input plus the output of the module the
model itself adds to the residual (the attention, or the norm after it in sandwich and
post-only blocks), times the residual multiplier where the model has one.
"""

import transformers as T
from harness import DECODER_BASE as BASE
from harness import Case, family_model, seeded, sum_mid, token_inputs

TOK = token_inputs()


def small(cls, cfg_cls, **kw):
    """A 2-layer, d=16, 4-query/2-kv-head decoder of one Llama-style family."""
    cfg = {**BASE, **kw}
    return seeded(lambda: cls(cfg_cls(**cfg)))


def _layers(m):
    return m.base_model.layers


def added(name: str, scale=None):
    """mid = block input + (output of the block's module ``name``), as the block adds them."""
    return sum_mid(_layers, lambda b: getattr(b, name), scale=scale)


LLAMA_MID = added("self_attn")
SANDWICH_MID = added("post_attention_layernorm")  # Gemma 2/3, OLMo 2/3, EXAONE 4: x + N(attn)
GEMMA = dict(head_dim=4)
GEMMA2 = dict(head_dim=4, query_pre_attn_scalar=4, sliding_window=4)
MOE = dict(num_experts_per_tok=2)


def case(cls, cfg_cls, family, mid=LLAMA_MID, **kw):
    return Case(small(cls, cfg_cls, **kw), family, mid, TOK, generate=True)


def gemma3_multimodal():
    """Gemma3ForConditionalGeneration with a 1-layer SigLIP tower (16x16 images, 4 image tokens)."""
    text = T.Gemma3TextConfig(**{**BASE, **GEMMA2})
    vision = T.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    cfg = T.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=5,
        boi_token_index=6,
        eoi_token_index=7,
    )
    return T.Gemma3ForConditionalGeneration(cfg)


CASES = {
    "llama": Case(seeded(lambda: family_model("llama")), "llama", LLAMA_MID, TOK, generate=True),
    "mistral": Case(
        seeded(lambda: family_model("mistral", num_key_value_heads=2)), "mistral", LLAMA_MID, TOK, generate=True
    ),  # fmt: skip
    "qwen2": Case(seeded(lambda: family_model("qwen2")), "qwen2", LLAMA_MID, TOK, generate=True),
    "qwen3": case(T.Qwen3ForCausalLM, T.Qwen3Config, "qwen3", head_dim=4),
    "mixtral": case(T.MixtralForCausalLM, T.MixtralConfig, "mixtral", num_local_experts=4, **MOE),
    "qwen2_moe": case(
        T.Qwen2MoeForCausalLM,
        T.Qwen2MoeConfig,
        "qwen2_moe",
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        **MOE,
    ),
    "qwen3_moe": case(
        T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, "qwen3_moe", head_dim=4, num_experts=4, moe_intermediate_size=16, **MOE
    ),
    "gemma": case(T.GemmaForCausalLM, T.GemmaConfig, "gemma", **GEMMA),
    "gemma2": case(T.Gemma2ForCausalLM, T.Gemma2Config, "gemma2", SANDWICH_MID, **GEMMA2),
    "gemma3 (text)": case(T.Gemma3ForCausalLM, T.Gemma3TextConfig, "gemma3_text", SANDWICH_MID, **GEMMA2),
    "gemma3 (multimodal, text stack)": Case(
        seeded(gemma3_multimodal),
        "gemma3",
        sum_mid(lambda m: m.model.language_model.layers, lambda b: b.post_attention_layernorm),
        token_inputs(n=7, seed=1),
        generate=True,
        stacks=("text",),
    ),
    "phi3 (fused qkv)": case(T.Phi3ForCausalLM, T.Phi3Config, "phi3", pad_token_id=0),
    "cohere (parallel)": case(T.CohereForCausalLM, T.CohereConfig, "cohere", None, use_qk_norm=True),
    "cohere2 (parallel)": case(T.Cohere2ForCausalLM, T.Cohere2Config, "cohere2", None, sliding_window=4),
    "stablelm (parallel)": case(
        T.StableLmForCausalLM, T.StableLmConfig, "stablelm", None, use_parallel_residual=True, qk_layernorm=True
    ),
    "stablelm (sequential)": case(T.StableLmForCausalLM, T.StableLmConfig, "stablelm", use_qkv_bias=True),
    "starcoder2": case(T.Starcoder2ForCausalLM, T.Starcoder2Config, "starcoder2"),
    "granite (residual x0.5)": case(
        T.GraniteForCausalLM,
        T.GraniteConfig,
        "granite",
        added("self_attn", scale=lambda b: b.residual_multiplier),
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        embedding_multiplier=2.0,
    ),
    "granitemoe (residual x0.5)": case(
        T.GraniteMoeForCausalLM,
        T.GraniteMoeConfig,
        "granitemoe",
        added("self_attn", scale=lambda b: b.residual_multiplier),
        residual_multiplier=0.5,
        num_local_experts=4,
        **MOE,
    ),
    "granitemoeshared (residual x0.5)": case(
        T.GraniteMoeSharedForCausalLM,
        T.GraniteMoeSharedConfig,
        "granitemoeshared",
        added("self_attn", scale=lambda b: b.residual_multiplier),
        residual_multiplier=0.5,
        num_local_experts=4,
        shared_intermediate_size=16,
        **MOE,
    ),
    "hyperclovax (post norm, residual x0.5)": case(
        T.HyperCLOVAXForCausalLM,
        T.HyperCLOVAXConfig,
        "hyperclovax",
        added("post_norm1", scale=lambda b: b.residual_multiplier),
        residual_multiplier=0.5,
    ),
    "granite_swa (sinks, nonlinear)": Case(
        small(T.GraniteSWAForCausalLM, T.GraniteSWAConfig, residual_multiplier=0.5, sliding_window=4),
        "granite_swa",
        added("self_attn", scale=lambda b: b.residual_multiplier),
        TOK,
        generate=True,
        nonlinear=True,
    ),
    "bitnet (sub-norm, nonlinear)": Case(
        small(T.BitNetForCausalLM, T.BitNetConfig), "bitnet", LLAMA_MID, TOK, generate=True, nonlinear=True
    ),
    "smollm3": case(T.SmolLM3ForCausalLM, T.SmolLM3Config, "smollm3", no_rope_layer_interval=2, pad_token_id=0),
    "olmo": case(T.OlmoForCausalLM, T.OlmoConfig, "olmo"),
    "olmo (clip_qkv)": Case(
        small(T.OlmoForCausalLM, T.OlmoConfig, clip_qkv=0.02), "olmo", LLAMA_MID, TOK, generate=True, nonlinear=True
    ),
    "olmo2": case(T.Olmo2ForCausalLM, T.Olmo2Config, "olmo2", SANDWICH_MID),
    "olmo3": case(T.Olmo3ForCausalLM, T.Olmo3Config, "olmo3", SANDWICH_MID, sliding_window=4),
    "exaone4": case(T.Exaone4ForCausalLM, T.Exaone4Config, "exaone4", SANDWICH_MID, sliding_window=4),
    "glm": case(T.GlmForCausalLM, T.GlmConfig, "glm", head_dim=4, pad_token_id=0),
    "glm4 (sandwich)": case(
        T.Glm4ForCausalLM, T.Glm4Config, "glm4", added("post_self_attn_layernorm"), head_dim=4, pad_token_id=0
    ),
    "helium": case(T.HeliumForCausalLM, T.HeliumConfig, "helium", head_dim=4),
    "nemotron": case(T.NemotronForCausalLM, T.NemotronConfig, "nemotron", head_dim=4),
    "apertus": case(T.ApertusForCausalLM, T.ApertusConfig, "apertus"),
    "ernie4_5": case(T.Ernie4_5ForCausalLM, T.Ernie4_5Config, "ernie4_5", head_dim=4),
    "seed_oss": case(T.SeedOssForCausalLM, T.SeedOssConfig, "seed_oss", head_dim=4),
    "arcee": case(T.ArceeForCausalLM, T.ArceeConfig, "arcee"),
    "olmoe": case(T.OlmoeForCausalLM, T.OlmoeConfig, "olmoe", num_experts=4, **MOE),
    "hunyuan_v1_dense": case(T.HunYuanDenseV1ForCausalLM, T.HunYuanDenseV1Config, "hunyuan_v1_dense", head_dim=4),
    "hunyuan_v1_moe": case(
        T.HunYuanMoEV1ForCausalLM, T.HunYuanMoEV1Config, "hunyuan_v1_moe", head_dim=4, num_experts=4, moe_topk=2
    ),
    "ernie4_5_moe": case(
        T.Ernie4_5_MoeForCausalLM,
        T.Ernie4_5_MoeConfig,
        "ernie4_5_moe",
        head_dim=4,
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=16,
        moe_num_shared_experts=1,
    ),
    "glm4_moe": case(
        T.Glm4MoeForCausalLM,
        T.Glm4MoeConfig,
        "glm4_moe",
        head_dim=4,
        pad_token_id=0,
        n_routed_experts=4,
        moe_intermediate_size=16,
        **MOE,
    ),
    "phimoe": case(T.PhimoeForCausalLM, T.PhimoeConfig, "phimoe", num_local_experts=4, **MOE),
    "exaone_moe": case(
        T.ExaoneMoeForCausalLM, T.ExaoneMoeConfig, "exaone_moe", num_experts=4, moe_intermediate_size=16, **MOE
    ),
    "mellum": case(T.MellumForCausalLM, T.MellumConfig, "mellum", num_experts=4, moe_intermediate_size=16, **MOE),
    "solar_open": case(
        T.SolarOpenForCausalLM,
        T.SolarOpenConfig,
        "solar_open",
        head_dim=4,
        pad_token_id=0,
        n_routed_experts=4,
        moe_intermediate_size=16,
        **MOE,
    ),
    "ministral3": case(T.Ministral3ForCausalLM, T.Ministral3Config, "ministral3", head_dim=4),
    "jais2": case(T.Jais2ForCausalLM, T.Jais2Config, "jais2"),
    "nanochat": case(T.NanoChatForCausalLM, T.NanoChatConfig, "nanochat"),
    "cwm": case(T.CwmForCausalLM, T.CwmConfig, "cwm"),
    "ministral": case(T.MinistralForCausalLM, T.MinistralConfig, "ministral", head_dim=4, sliding_window=4),
}
