"""GPT-lineage cases (eigenhooks/models/gpt.py)."""

import transformers as T
from harness import Case, family_model, record, seeded, sum_mid, token_inputs

TOK = token_inputs()


def _h(m):
    return m.base_model.h


CASES = {
    "gpt2": Case(
        seeded(lambda: family_model("gpt2")),
        "gpt2",
        sum_mid(_h, lambda b: b.attn),
        TOK,
        generate=True,
    ),
    "gpt_neo": Case(
        seeded(lambda: family_model("gpt_neo")),
        "gpt_neo",
        sum_mid(_h, lambda b: b.attn),
        TOK,
        generate=True,
    ),
    "gpt_neox (parallel)": Case(
        seeded(lambda: family_model("gpt_neox", max_position_embeddings=2048)),
        "gpt_neox",
        None,
        TOK,
        generate=True,
    ),
    "gpt_neox (sequential)": Case(
        seeded(lambda: family_model("gpt_neox", max_position_embeddings=2048, use_parallel_residual=False)),
        "gpt_neox",
        sum_mid(lambda m: m.base_model.layers, lambda b: b.attention),
        TOK,
        generate=True,
    ),
    "gptj": Case(
        seeded(lambda: family_model("gptj")),
        "gptj",
        None,
        TOK,
        generate=True,
    ),
    "opt": Case(
        seeded(lambda: family_model("opt")),
        "opt",
        sum_mid(lambda m: m.base_model.decoder.layers, lambda b: b.self_attn),
        TOK,
        generate=True,
    ),
    "opt (post-norm)": Case(
        seeded(lambda: family_model("opt_postnorm")),
        "opt",
        sum_mid(
            lambda m: m.base_model.decoder.layers, lambda b: b.self_attn, then=lambda b, x: b.self_attn_layer_norm(x)
        ),
        TOK,
        generate=True,
    ),
}


# ---- fused-qkv decoders ----

SMALL = dict(vocab_size=64, hidden_size=16)


def _phi(**kw):
    c = dict(SMALL, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32, max_position_embeddings=32)
    return seeded(lambda: T.PhiForCausalLM(T.PhiConfig(**{**c, **kw})))


def _falcon(**kw):
    c = dict(SMALL, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    return seeded(lambda: T.FalconForCausalLM(T.FalconConfig(**{**c, **kw})))


def _bigcode(**kw):
    c = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_inner=32, n_positions=32)
    return seeded(lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(**{**c, **kw})))


def _bloom(**kw):
    return seeded(lambda: T.BloomForCausalLM(T.BloomConfig(**{**SMALL, "n_layer": 2, "n_head": 4, **kw})))


def _mpt(**kw):
    c = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=32, use_cache=True)
    return seeded(lambda: T.MptForCausalLM(T.MptConfig(**{**c, **kw})))


def _codegen(**kw):
    c = dict(vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_inner=32, rotary_dim=2, n_positions=32)
    return seeded(lambda: T.CodeGenForCausalLM(T.CodeGenConfig(**{**c, **kw})))


def bloom_mid(model, inputs):
    """Bloom's mid, independently: ``dense``'s output plus the residual its attention adds.

    The residual is the block's input, or (apply_residual_connection_post_layernorm) the
    output of ``input_layernorm``; both are captured here with the test's own hooks.
    """
    bl = list(model.base_model.h)
    post_ln = model.config.apply_residual_connection_post_layernorm
    res_of = [b.input_layernorm if post_ln else b for b in bl]
    dense = [b.self_attention.dense for b in bl]
    with record(bl + res_of + dense) as got:
        model(**inputs)
    out = {}
    for i, (r, a) in enumerate(zip(res_of, dense)):
        x_in, x_out = got[id(r)][0]
        out[i] = (x_out if post_ln else x_in) + got[id(a)][0][1]
    return out


_FALCON_MID = sum_mid(_h, lambda b: b.self_attention)

CASES.update(
    {
        "phi": Case(_phi(), "phi", None, TOK, generate=True),
        "phi (gqa, qk-norm)": Case(_phi(num_key_value_heads=2, qk_layernorm=True), "phi", None, TOK, generate=True),
        "falcon (new, grouped kv)": Case(
            _falcon(new_decoder_architecture=True, num_kv_heads=2), "falcon", None, TOK, generate=True
        ),
        "falcon (new, one norm)": Case(
            _falcon(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
            "falcon",
            None,
            TOK,
            generate=True,
        ),
        "falcon (multi_query, parallel)": Case(
            _falcon(multi_query=True, parallel_attn=True), "falcon", None, TOK, generate=True
        ),
        "falcon (mha, sequential, alibi)": Case(
            _falcon(multi_query=False, parallel_attn=False, alibi=True, bias=True),
            "falcon",
            _FALCON_MID,
            TOK,
            generate=True,
        ),
        "gpt_bigcode (mqa)": Case(
            _bigcode(multi_query=True), "gpt_bigcode", sum_mid(_h, lambda b: b.attn), TOK, generate=True
        ),
        "gpt_bigcode (mha)": Case(
            _bigcode(multi_query=False), "gpt_bigcode", sum_mid(_h, lambda b: b.attn), TOK, generate=True
        ),
        "bloom": Case(_bloom(), "bloom", bloom_mid, TOK, generate=True),
        "bloom (residual post-norm)": Case(
            _bloom(apply_residual_connection_post_layernorm=True), "bloom", bloom_mid, TOK, generate=True
        ),
        "mpt": Case(_mpt(), "mpt", sum_mid(lambda m: m.base_model.blocks, lambda b: b.attn), TOK, generate=True),
        "mpt (clip_qkv)": Case(
            _mpt(attn_config={"clip_qkv": 0.05}),
            "mpt",
            sum_mid(lambda m: m.base_model.blocks, lambda b: b.attn),
            TOK,
            generate=True,
            nonlinear=True,
        ),
        "codegen": Case(_codegen(), "codegen", None, TOK, generate=True),
    }
)
