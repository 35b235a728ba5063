"""Llama-style decoders: separate q/k/v/o projections, a norm before attention and one before the MLP."""

from __future__ import annotations

from .family import Family, attr, gqa_dims, linear, row


def _llama(base, cfg):
    d, H, G = gqa_dims(cfg)
    for blk in base.layers:
        a = blk.self_attn
        yield row(
            blk,
            a,
            a,
            blk.input_layernorm,
            linear(a.v_proj, a.o_proj, H, G),
            a.o_proj,
            mid_in=blk.post_attention_layernorm,
        )


LLAMA = Family(_llama, "pre", attr("norm"))

FAMILIES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
}
