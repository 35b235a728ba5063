"""GPT-lineage and fused-qkv decoders: GPT-2, GPT-Neo, GPT-NeoX, GPT-J, OPT, Phi, Falcon, GPTBigCode,
BLOOM, MPT, CodeGen.

Most of these fuse Q, K and V into one projection. Each fused layout stores V's rows
differently, so each gets a slicer below that says which rows of the fused (out, in)
weight are V, in the order the model's forward reshapes them into heads:

- per head ``[q_h; k_h; v_h]`` (GPT-NeoX, BLOOM, Falcon's old multi-head layout, GPTBigCode
  without MQA): ``W.view(H, 3, dh, d)[:, 2]``;
- per kv group ``[q_1 .. q_{H/G}; k_g; v_g]`` (Falcon's new decoder architecture):
  ``W.view(G, H/G + 2, dh, d)[:, -1]``;
- ``[Q; K; V]`` blocks (MPT, and the multi-query layouts, whose K and V are one head each);
- CodeGen's ``mp_num`` shards, each ``[q; v; k]`` (value in the middle).
"""

from __future__ import annotations

import torch

from ..linalg.eig import Factors
from .base import UnsupportedConfigError
from .family import Family, attr, gqa_dims, linear, mha_dims, row


def _no_cross_attention(cfg) -> None:
    """GPT-2 and GPTBigCode blocks with ``add_cross_attention`` put a second attention between the
    self-attention and the MLP: neither its F nor the mid state it changes is read here."""
    if getattr(cfg, "add_cross_attention", False):
        raise UnsupportedConfigError(
            f"{cfg.model_type} with add_cross_attention=True: the cross-attention blocks (and the 'mid' state "
            "they change) are not covered; load the model with add_cross_attention=False to monitor its "
            "self-attention alone"
        )


def _gpt2(base, cfg):
    _no_cross_attention(cfg)
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


# ---- fused-qkv slicers: (out, in) fused weight -> V (G*dh, d), rows in the forward's head order ----


def v_per_head(W: torch.Tensor, H: int) -> torch.Tensor:
    """V of a per-head interleaved ``[q_h; k_h; v_h]`` fused weight.

    Args:
        W: (H*3*dh, d) fused query_key_value weight, head-major.

    Returns:
        (H*dh, d): head h's value rows are W[h*3*dh + 2*dh : (h+1)*3*dh].
    """
    d = W.shape[1]
    return W.view(H, 3, W.shape[0] // (3 * H), d)[:, 2].reshape(-1, d)  # (H, dh, d) -> (H*dh, d)


def v_per_group(W: torch.Tensor, H: int, G: int) -> torch.Tensor:
    """V of Falcon's new layout: per kv group ``[q_1 .. q_{H/G}; k_g; v_g]``.

    Args:
        W: (G*(H/G + 2)*dh, d) fused weight.

    Returns:
        (G*dh, d): group g's value rows are the last dh of its block.
    """
    d = W.shape[1]
    return W.view(G, H // G + 2, W.shape[0] // (H + 2 * G), d)[:, -1].reshape(-1, d)


def v_last_block(W: torch.Tensor, kv_dim: int) -> torch.Tensor:
    """V of a ``[Q; K; V]`` fused weight whose V is its last ``kv_dim`` rows (MPT; multi-query layouts).

    Args:
        W: (d + 2*kv_dim, d) fused weight.

    Returns:
        (kv_dim, d).
    """
    return W[W.shape[0] - kv_dim :]


def v_codegen(W: torch.Tensor, mp_num: int) -> torch.Tensor:
    """V of CodeGen's ``qkv_proj``: ``mp_num`` shards of ``[q; v; k]``, each part d/mp_num rows.

    The forward views the output as (mp_num, 3*local) and splits each shard into q, v, k, then
    concatenates the shards' values: value feature m*local + j is row m*3*local + local + j.

    Args:
        W: (3*d, d) fused weight.

    Returns:
        (d, d), rows in value-feature order (head h = rows h*dh .. (h+1)*dh).
    """
    d = W.shape[1]
    return W.view(mp_num, 3, d // mp_num, d)[:, 1].reshape(d, d)


def fused(qkv, o, V, n_heads: int, n_kv: int):
    """(O, V) factors from a fused projection ``qkv`` (nn.Linear) via the slicer ``V(weight)``."""
    return lambda: Factors.from_stacked(o.weight, V(qkv.weight), n_heads, n_kv)


# ---- families ----


def _phi(base, cfg):
    """Phi-1/2: one LayerNorm feeds attention and MLP in parallel; ``dense`` is the output projection."""
    d, H, G = gqa_dims(cfg)
    for blk in base.layers:
        a = blk.self_attn
        yield row(blk, a, a, blk.input_layernorm, linear(a.v_proj, a.dense, H, G), a.dense, parallel=True)


def falcon_kv(c) -> int:
    """Falcon's kv heads as its attention builds them: new layout ``num_kv_heads``, old MQA 1, else H."""
    if c.new_decoder_architecture:
        return c.num_kv_heads
    return 1 if c.multi_query else c.num_attention_heads


def _falcon_norm(blk, cfg, i: int):
    """The norm Falcon's forward applies before attention, checked to exist on the block."""
    two = cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2
    name = "ln_attn" if two else "input_layernorm"
    norm = getattr(blk, name, None)
    if norm is None:
        found = [n for n in ("ln_attn", "ln_mlp", "input_layernorm", "post_attention_layernorm") if hasattr(blk, n)]
        raise UnsupportedConfigError(
            f"falcon layer {i}: its forward applies {name!r}, but the block has only {found} "
            f"(new_decoder_architecture={cfg.new_decoder_architecture}, parallel_attn={cfg.parallel_attn}, "
            f"num_ln_in_parallel_attn={cfg.num_ln_in_parallel_attn}); this config cannot run in transformers "
            "either: fix the config"
        )
    return norm


def _falcon(base, cfg):
    """Falcon, both layouts. New (40B/180B): grouped kv, always parallel. Old (7B/RW): MQA or per-head
    MHA, parallel when ``parallel_attn``, else sequential with ``post_attention_layernorm`` before the MLP."""
    H, G = cfg.num_attention_heads, falcon_kv(cfg)
    if cfg.new_decoder_architecture:
        V = lambda W: v_per_group(W, H, G)  # noqa: E731
    elif cfg.multi_query:
        V = lambda W: v_last_block(W, W.shape[1] // H)  # noqa: E731
    else:
        V = lambda W: v_per_head(W, H)  # noqa: E731
    parallel = bool(cfg.new_decoder_architecture or cfg.parallel_attn)
    for i, blk in enumerate(base.h):
        a = blk.self_attention
        mid = None if parallel else blk.post_attention_layernorm
        f = fused(a.query_key_value, a.dense, V, H, G)
        yield row(blk, a, a, _falcon_norm(blk, cfg, i), f, a.dense, mid_in=mid, parallel=parallel)


def _gpt_bigcode(base, cfg):
    """GPTBigCode (SantaCoder/StarCoder): fused ``c_attn`` (nn.Linear); MQA: ``[Q; k; v]``, else per head."""
    _no_cross_attention(cfg)
    H = cfg.num_attention_heads
    G = 1 if cfg.multi_query else H
    V = (lambda W: v_last_block(W, W.shape[1] // H)) if cfg.multi_query else (lambda W: v_per_head(W, H))
    for blk in base.h:
        a = blk.attn
        yield row(blk, a, a, blk.ln_1, fused(a.c_attn, a.c_proj, V, H, G), a.c_proj, mid_in=blk.ln_2)


def _bloom(base, cfg):
    """BLOOM: per-head fused qkv. Its attention module adds the residual itself, so the pure attention
    update is the output of ``dense``; the probe reads that (layers then cannot interact)."""
    H = cfg.num_attention_heads
    if cfg.pretraining_tp > 1 and cfg.slow_but_exact:
        raise UnsupportedConfigError(
            f"bloom with pretraining_tp={cfg.pretraining_tp} and slow_but_exact=True applies its output "
            "projection slice by slice outside the `dense` module (and without its bias), so no module's "
            "output is the attention update; set config.slow_but_exact=False (same weights)"
        )
    for blk in base.h:
        a = blk.self_attention
        f = fused(a.query_key_value, a.dense, lambda W: v_per_head(W, H), H, H)
        yield row(blk, a, a.dense, blk.input_layernorm, f, a.dense, mid_in=blk.post_attention_layernorm)


def _mpt_clip(cfg) -> float | None:
    return getattr(cfg.attn_config, "clip_qkv", None)


def _mpt(base, cfg):
    """MPT: ``Wqkv`` = [Q; K; V] blocks, ``out_proj``. With ``clip_qkv`` the values are clamped to
    [-clip, clip]: the path is then nonlinear and F is the unclamped linear map O W_V."""
    H = cfg.num_attention_heads
    lin = not _mpt_clip(cfg)
    for blk in base.blocks:
        a = blk.attn
        f = fused(a.Wqkv, a.out_proj, lambda W: v_last_block(W, W.shape[1]), H, H)
        yield row(blk, a, a, blk.norm_1, f, a.out_proj, mid_in=blk.norm_2, linear=lin)


def _codegen(base, cfg):
    """CodeGen: GPT-J-like parallel block, ``qkv_proj`` in ``mp_num`` shards of [q; v; k]."""
    H = cfg.num_attention_heads
    for i, blk in enumerate(base.h):
        a = blk.attn
        mp = getattr(a, "mp_num", None)
        d = a.qkv_proj.weight.shape[1]
        if not isinstance(mp, int) or mp < 1 or d % mp:
            raise UnsupportedConfigError(
                f"codegen layer {i}: qkv_proj is split into mp_num={mp!r} shards, which does not divide "
                f"hidden_size={d}; transformers cannot run it either: use a hidden_size divisible by it"
            )
        f = fused(a.qkv_proj, a.out_proj, lambda W, mp=mp: v_codegen(W, mp), H, H)
        yield row(blk, a, a, blk.ln_1, f, a.out_proj, parallel=True)


def _parallel_note(c) -> list[str]:
    return ["parallel attention/MLP block: 'mid' = pre + attention output, not a state the model forms"]


def _falcon_notes(c) -> list[str]:
    parallel = c.new_decoder_architecture or c.parallel_attn
    return _parallel_note(c) if parallel else []


def _bloom_notes(c) -> list[str]:
    notes = ["bloom: the attention module adds the residual itself; the attention update is read at `dense`"]
    if c.apply_residual_connection_post_layernorm:
        notes.append(
            "apply_residual_connection_post_layernorm: the residual carried past attention is LN(pre), not pre, "
            "so 'mid' = LN(pre) + attention output (the state the MLP's norm receives)"
        )
    return notes


def _mpt_notes(c) -> list[str]:
    clip = _mpt_clip(c)
    if not clip:
        return []
    return [
        f"clip_qkv={clip}: values are clamped to [-{clip}, {clip}], so the value path is nonlinear; F is the "
        "unclamped O W_V (exact while |W_V x| <= clip), the probe only a local linearisation"
    ]


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
    "phi": Family(_phi, "pre", attr("final_layernorm"), notes=_parallel_note),
    "falcon": Family(
        _falcon,
        "pre",
        attr("ln_f"),
        lambda c: (c.hidden_size, c.num_attention_heads, falcon_kv(c)),
        notes=_falcon_notes,
    ),
    "gpt_bigcode": Family(
        _gpt_bigcode,
        "pre",
        attr("ln_f"),
        lambda c: (c.hidden_size, c.num_attention_heads, 1 if c.multi_query else c.num_attention_heads),
    ),
    "bloom": Family(_bloom, "pre", attr("ln_f"), mha_dims("hidden_size", "num_attention_heads"), notes=_bloom_notes),
    "mpt": Family(_mpt, "pre", attr("norm_f"), mha_dims("hidden_size", "num_attention_heads"), notes=_mpt_notes),
    "codegen": Family(
        _codegen, "pre", attr("ln_f"), mha_dims("hidden_size", "num_attention_heads"), notes=_parallel_note
    ),
}
