"""GPT-lineage decoders: GPT-2, GPT-Neo, GPT-NeoX, GPT-J, OPT (fused or legacy layouts)."""

from __future__ import annotations

from ..spectrum import Factors
from .family import Family, attr, linear, mha_dims, row


def _gpt2(base, cfg):
    d = cfg.n_embd
    for blk in base.h:
        c_attn, c_proj = blk.attn.c_attn, blk.attn.c_proj

        # Conv1D stores (in, out): value columns are [2d, 3d); transpose to (out, in).
        def f(c_attn=c_attn, c_proj=c_proj):
            return Factors.from_stacked(c_proj.weight.T, c_attn.weight[:, 2 * d : 3 * d].T, cfg.n_head)

        yield row(blk, blk.attn, blk.attn, blk.ln_1, f, c_proj, mid_in=blk.ln_2)


def _gpt_neo(base, cfg):
    for blk in base.h:
        a = blk.attn.attention
        f = linear(a.v_proj, a.out_proj, cfg.num_heads, cfg.num_heads)
        yield row(blk, blk.attn, blk.attn, blk.ln_1, f, a.out_proj, mid_in=blk.ln_2)


def _gpt_neox(base, cfg):
    H = cfg.num_attention_heads
    parallel = bool(getattr(cfg, "use_parallel_residual", False))
    for blk in base.layers:
        qkv, dense = blk.attention.query_key_value, blk.attention.dense

        # Fused per head: output feature h*3*d_head + j, with q, k, v at j in [0, dh), [dh, 2dh), [2dh, 3dh).
        def f(qkv=qkv, dense=dense):
            d = qkv.weight.shape[1]
            dh = d // H
            V = qkv.weight.view(H, 3 * dh, d)[:, 2 * dh :, :].reshape(H * dh, d)
            return Factors.from_stacked(dense.weight, V, H)

        mid = None if parallel else blk.post_attention_layernorm
        yield row(blk, blk.attention, blk.attention, blk.input_layernorm, f, dense, mid_in=mid, parallel=parallel)


def _gptj(base, cfg):
    for blk in base.h:
        a = blk.attn
        yield row(blk, a, a, blk.ln_1, linear(a.v_proj, a.out_proj, cfg.n_head, cfg.n_head), a.out_proj, parallel=True)


def _opt(base, cfg):
    pre = cfg.do_layer_norm_before
    for blk in base.decoder.layers:
        a = blk.self_attn
        f = linear(a.v_proj, a.out_proj, cfg.num_attention_heads, cfg.num_attention_heads)
        yield row(blk, a, a, blk.self_attn_layer_norm, f, a.out_proj, mid_in=blk.final_layer_norm if pre else None)


def _parallel_note(c) -> list[str]:
    return ["parallel attention/MLP block: 'mid' = pre + attention output, not a state the model forms"]


FAMILIES = {
    "gpt2": Family(_gpt2, "pre", attr("ln_f"), mha_dims("n_embd", "n_head")),
    "gpt_neo": Family(_gpt_neo, "pre", attr("ln_f"), mha_dims("hidden_size", "num_heads")),
    "gpt_neox": Family(
        _gpt_neox,
        "pre",
        attr("final_layer_norm"),
        mha_dims("hidden_size", "num_attention_heads"),
        notes=lambda c: _parallel_note(c) if getattr(c, "use_parallel_residual", False) else [],
    ),
    "gptj": Family(_gptj, "pre", attr("ln_f"), mha_dims("n_embd", "n_head"), notes=_parallel_note),
    "opt": Family(
        _opt,
        lambda c: "pre" if c.do_layer_norm_before else "post",
        attr("decoder", "final_layer_norm"),
        mha_dims("hidden_size", "num_attention_heads"),
    ),
}
