"""Encoders: BERT, RoBERTa, XLM-R, DistilBERT, ALBERT, ELECTRA, DeBERTa-v2 (post-norm: add, then
norm) and ModernBERT (pre-norm, fused Wqkv)."""

from __future__ import annotations

from torch import nn

from ..linalg.eig import Factors
from .base import LayoutError
from .family import Family, attr, linear, mha_dims, row


def need(obj: nn.Module, path: str) -> nn.Module:
    """``obj.<path>`` (dotted), or a ``LayoutError`` naming what ``obj`` holds instead."""
    cur = obj
    for p in path.split("."):
        nxt = getattr(cur, p, None)
        if not isinstance(nxt, nn.Module):
            found = ", ".join(n for n, _ in cur.named_children()) if isinstance(cur, nn.Module) else type(cur).__name__
            raise LayoutError(
                f"{type(obj).__name__}: expected a submodule {path!r}, found no {p!r} in {type(cur).__name__} "
                f"(children: {found or 'none'}); this layout is not the one transformers' code builds"
            )
        cur = nxt
    return cur


def _bert(base, cfg):
    """BERT layout (also ELECTRA): attention.self.value, attention.output.dense, then the add+LayerNorm."""
    H = cfg.num_attention_heads
    for blk in need(base, "encoder.layer"):
        s, o = need(blk, "attention.self"), need(blk, "attention.output")
        v, dense, ln = need(s, "value"), need(o, "dense"), need(o, "LayerNorm")
        yield row(blk, s, dense, ln, linear(v, dense, H, H), dense)


def _distilbert(base, cfg):
    for blk in base.transformer.layer:
        a = blk.attention
        yield row(blk, a, a, blk.sa_layer_norm, linear(a.v_lin, a.out_lin, cfg.n_heads, cfg.n_heads), a.out_lin)


def _albert(base, cfg):
    groups = base.encoder.albert_layer_groups
    H = cfg.num_attention_heads
    for i in range(cfg.num_hidden_layers):
        g = int(i / (cfg.num_hidden_layers / cfg.num_hidden_groups))
        for blk in groups[g].albert_layers:
            a = blk.attention
            yield row(blk, a, a.dense, a.LayerNorm, linear(a.value, a.dense, H, H), a.dense)


def _deberta_v2(base, cfg):
    """DeBERTa-v2/v3: disentangled attention.

    The relative-position terms (c2p, p2c: ``pos_key_proj``/``pos_query_proj`` of the relative
    embeddings) enter the attention *scores* only; the values are ``value_proj(hidden_states)``,
    so F = output.dense.W @ value_proj.W (biases left out). Post-norm: the add and LayerNorm sit in
    ``attention.output``; ``mid`` is that LayerNorm's output. The optional ConvLayer after layer 0
    acts between layers, so layer 0's ``post`` (layer 1's ``pre``) includes it.
    """
    H = cfg.num_attention_heads
    for blk in need(base, "encoder.layer"):
        s, o = need(blk, "attention.self"), need(blk, "attention.output")
        v, dense, ln = need(s, "value_proj"), need(o, "dense"), need(o, "LayerNorm")
        yield row(blk, s, dense, ln, linear(v, dense, H, H), dense)


def _modernbert(base, cfg):
    """ModernBERT: pre-norm; ``Wqkv`` (3d, d) is viewed per token as (3, H, d_head), so V is the row
    block [2d, 3d). Layer 0's ``attn_norm`` is an ``nn.Identity`` (the embeddings are normed already):
    its ``ov_ln`` equals ``ov``. Global and sliding-window layers differ only in their mask."""
    H = cfg.num_attention_heads
    for blk in need(base, "layers"):
        a = need(blk, "attn")
        qkv, wo = need(a, "Wqkv"), need(a, "Wo")

        def f(qkv=qkv, wo=wo):
            d = wo.weight.shape[0]
            return Factors.from_stacked(wo.weight, qkv.weight[2 * d : 3 * d], H)  # (d, d), (d, d)

        yield row(blk, a, a, need(blk, "attn_norm"), f, wo, mid_in=need(blk, "mlp_norm"))


def _albert_notes(c) -> list[str]:
    n, g = c.num_hidden_layers * c.inner_group_num, c.num_hidden_groups * c.inner_group_num
    return [f"shared weights: {n} attention applications use {g} distinct layer(s)"] if g < n else []


def _modernbert_notes(c) -> list[str]:
    kinds = sorted(set(getattr(c, "layer_types", None) or []))
    return [
        "layer 0 has no attention norm (nn.Identity): its ov_ln equals ov",
        f"layer types {kinds}: sliding-window layers differ from global ones only in their mask, not in F",
    ]


def _deberta_notes(c) -> list[str]:
    return ["disentangled attention: relative positions enter the scores only; F is read from value_proj"]


BERT_DIMS = mha_dims("hidden_size", "num_attention_heads")

FAMILIES = {
    "bert": Family(_bert, "post", dims=BERT_DIMS, head_norm=("cls", "predictions", "transform", "LayerNorm")),
    "roberta": Family(_bert, "post", dims=BERT_DIMS, head_norm=("lm_head", "layer_norm")),
    "xlm-roberta": Family(_bert, "post", dims=BERT_DIMS, head_norm=("lm_head", "layer_norm")),
    "distilbert": Family(_distilbert, "post", dims=mha_dims("dim", "n_heads"), head_norm=("vocab_layer_norm",)),
    "albert": Family(_albert, "post", dims=BERT_DIMS, head_norm=("predictions", "LayerNorm"), notes=_albert_notes),
    "electra": Family(_bert, "post", dims=BERT_DIMS),
    "deberta-v2": Family(_deberta_v2, "post", dims=BERT_DIMS, notes=_deberta_notes),
    "modernbert": Family(_modernbert, "pre", attr("final_norm"), BERT_DIMS, notes=_modernbert_notes),
}
