"""Decoders with unusual attention: MoE/MLA/sinks (gpt_oss, deepseek_v3, llama4) and the attention layers of hybrids.

Three of these value paths are not linear in x, so the identical-token probe is not F
there (docs/design.md, "Mathematics"). In each, F is the linear map of the weights with the nonlinear
factor at its neutral value, stated exactly in the rule's docstring and in the notes:

- gpt_oss, attention sinks: a learned logit per head joins each softmax row and is
  dropped after it, so the rows sum to s_h(x) = 1 - p_sink < 1 and the output for
  identical tokens is sum_h s_h(x) O_h V_h x. F = sum_h O_h V_h (the sink at -inf).
- deepseek_v3, MLA: the values are W_kv_b,v RMSNorm(W_kv_a x), so the output for
  identical tokens is F x / rms(W_kv_a x). F = O W_kv_b,v diag(g) W_kv_a (rms = 1).
- qwen3_next, gated full attention: q_proj also yields a gate, the output is
  O (sigmoid(W_g x) * V x). F = O V (the gate open, sigmoid = 1).

Hybrids (jamba, qwen3_next) interleave attention with Mamba or linear-attention blocks.
Only the softmax-attention blocks are layers for eigenhooks; ``post`` of each is the
input of the next block of any kind (``post_in``), so it is never the next attention
layer's ``pre`` when a Mamba or linear-attention block sits between them.
"""

from __future__ import annotations

from ..linalg.eig import Factors
from .base import UnsupportedModelError
from .family import Family, attr, gqa_dims, linear, row


def _next_input(base, blocks, j: int, final: str):
    """The module that first receives block j's output: the next block's input norm, or the final norm."""
    if j + 1 < len(blocks):
        return blocks[j + 1].input_layernorm
    return getattr(base, final)


def _llama4_text(base):
    """The Llama4TextModel: ``Llama4ForCausalLM`` names its prefix 'language_model' but keeps it as ``.model``."""
    return base if hasattr(base, "layers") else base.model


def _llama4(base, cfg):
    """Llama 4 text: Llama attention (chunked, NoPE and temperature-tuned layers change only the scores)."""
    d, H, G = gqa_dims(cfg)
    for blk in _llama4_text(base).layers:
        a = blk.self_attn
        f = linear(a.v_proj, a.o_proj, H, G)
        yield row(blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=blk.post_attention_layernorm)


def _gpt_oss(base, cfg):
    """gpt-oss: Llama attention plus one sink logit per head; ``factors`` is F = sum_h O_h V_h.

    With identical tokens the attention output is sum_h s_h(x) O_h V_h x + c, where
    s_h(x) = sum_j softmax([scores_h(x), sink_h])_j < 1 depends on x through the scores,
    so the path is marked nonlinear and the probe is only a local linearisation.
    """
    d, H, G = gqa_dims(cfg)
    for blk in base.layers:
        a = blk.self_attn
        f = linear(a.v_proj, a.o_proj, H, G)
        yield row(blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=blk.post_attention_layernorm, linear=False)


def mla_factors(a, cfg):
    """MLA's value path, linear part: F = O W_kv_b,v diag(g) W_kv_a,latent.

    ``kv_a_proj_with_mqa.weight`` is (r + d_rope, d): rows [0, r) give the latent, the
    rest the shared rotary key. ``kv_b_proj.weight`` is (H (d_nope + d_v), r), per head
    the key rows [0, d_nope) then the value rows [d_nope, d_nope + d_v). g is
    ``kv_a_layernorm.weight`` (r,). The model divides the latent by its rms
    (sqrt(mean((W_kv_a x + b)^2) + eps)) before g; F leaves that division out.

    Returns:
        () -> Factors with V (H d_v, d) in float64 and O = ``o_proj.weight`` (d, H d_v).
    """
    H, r, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim

    def f():
        Wb = a.kv_b_proj.weight.detach().double().view(H, dn + dv, r)[:, dn:, :]  # (H, dv, r)
        g = a.kv_a_layernorm.weight.detach().double()  # (r,)
        Wa = a.kv_a_proj_with_mqa.weight.detach().double()[:r]  # (r, d)
        V = (Wb * g).reshape(H * dv, r) @ Wa  # (H dv, d)
        return Factors.from_stacked(a.o_proj.weight, V, H)

    return f


def _deepseek_v3(base, cfg):
    """DeepSeek-V3 with multi-head latent attention: a norm inside the value path (nonlinear)."""
    for blk in base.layers:
        a = blk.self_attn
        f = mla_factors(a, cfg)
        yield row(blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=blk.post_attention_layernorm, linear=False)


def _attention_blocks(base, family: str, other: str) -> list:
    """A hybrid's block list, refused when no block holds softmax attention (nothing to measure)."""
    blocks = list(base.layers)
    if not any(hasattr(b, "self_attn") for b in blocks):
        raise UnsupportedModelError(
            f"{family}: none of the {len(blocks)} blocks holds softmax attention (all are {other} blocks); "
            "eigenhooks measures attention layers only"
        )
    return blocks


def _jamba(base, cfg):
    """Jamba: the attention blocks among Mamba blocks; ``post`` is the next block's input, Mamba or not."""
    d, H, G = gqa_dims(cfg)
    blocks = _attention_blocks(base, "jamba", "Mamba")
    for j, blk in enumerate(blocks):
        a = getattr(blk, "self_attn", None)
        if a is None:
            continue  # a Mamba block
        f = linear(a.v_proj, a.o_proj, H, G)
        post = _next_input(base, blocks, j, "final_layernorm")
        yield row(blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=blk.pre_ff_layernorm, post_in=post)


def _qwen3_next(base, cfg):
    """Qwen3-Next: the gated full-attention blocks among gated-delta-net blocks.

    ``q_proj`` yields (query, gate) per head; the output is O (sigmoid(gate) * V x), so
    the path is marked nonlinear and ``factors`` is F = O V (the gate open). The block
    norms scale by (1 + weight): the family's ``norm_offset``.
    """
    d, H, G = gqa_dims(cfg)
    blocks = _attention_blocks(base, "qwen3_next", "linear-attention")
    for j, blk in enumerate(blocks):
        a = getattr(blk, "self_attn", None)
        if a is None:
            continue  # a linear-attention (gated delta net) block
        f = linear(a.v_proj, a.o_proj, H, G)
        post = _next_input(base, blocks, j, "norm")
        yield row(
            blk, a, a, blk.input_layernorm, f, a.o_proj, mid_in=blk.post_attention_layernorm, post_in=post, linear=False
        )


def _sink_note(c) -> list[str]:
    return [
        "gpt_oss attention sinks: F = sum_h O_h V_h, the linear map of the weights (sink logit at -inf); "
        "the model's output for identical tokens is sum_h s_h(x) O_h V_h x with s_h(x) = 1 - p_sink(x) < 1"
    ]


def _mla_note(c) -> list[str]:
    return [
        "deepseek_v3 MLA: F = O W_kv_b,v diag(kv_a_layernorm.weight) W_kv_a,latent, the value path without "
        "the RMS division of the latent; the model's output for identical tokens is F x / rms(W_kv_a x + b)"
    ]


def _hybrid_note(kind: str) -> list[str]:
    return [
        f"hybrid: only the softmax-attention blocks are layers; {kind} blocks between them are not, and "
        "'post' is the next block's input (not the next attention layer's 'pre')"
    ]


def _qwen3_next_note(c) -> list[str]:
    return [
        *_hybrid_note("gated delta net"),
        "qwen3_next gated attention: F = O V (gate open); the model's output for identical tokens is "
        "O (sigmoid(W_gate x) * V x), near x = 0 about F x / 2; norms scale by 1 + weight",
    ]


FAMILIES = {
    "llama4_text": Family(
        _llama4,
        "pre",
        lambda base: _llama4_text(base).norm,
        notes=lambda c: ["llama4: MoE MLP; chunked, NoPE and temperature-tuned layers change only the scores"],
    ),
    "gpt_oss": Family(_gpt_oss, "pre", attr("norm"), notes=_sink_note),
    "deepseek_v3": Family(_deepseek_v3, "pre", attr("norm"), notes=_mla_note),
    "jamba": Family(_jamba, "pre", attr("final_layernorm"), notes=lambda c: _hybrid_note("Mamba")),
    "qwen3_next": Family(_qwen3_next, "pre", attr("norm"), notes=_qwen3_next_note, norm_offset=1.0),
}
