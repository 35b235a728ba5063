"""Encoders: BERT, RoBERTa, XLM-R, DistilBERT, ALBERT (post-norm: add, then norm)."""

from __future__ import annotations

from .family import Family, linear, mha_dims, row


def _bert(base, cfg):
    H = cfg.num_attention_heads
    for blk in base.encoder.layer:
        s, o = blk.attention.self, blk.attention.output
        yield row(blk, s, o.dense, o.LayerNorm, linear(s.value, o.dense, H, H), o.dense)


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


def _albert_notes(c) -> list[str]:
    n, g = c.num_hidden_layers * c.inner_group_num, c.num_hidden_groups * c.inner_group_num
    return [f"shared weights: {n} attention applications use {g} distinct layer(s)"] if g < n else []


BERT_DIMS = mha_dims("hidden_size", "num_attention_heads")

FAMILIES = {
    "bert": Family(_bert, "post", dims=BERT_DIMS, head_norm=("cls", "predictions", "transform", "LayerNorm")),
    "roberta": Family(_bert, "post", dims=BERT_DIMS, head_norm=("lm_head", "layer_norm")),
    "xlm-roberta": Family(_bert, "post", dims=BERT_DIMS, head_norm=("lm_head", "layer_norm")),
    "distilbert": Family(_distilbert, "post", dims=mha_dims("dim", "n_heads"), head_norm=("vocab_layer_norm",)),
    "albert": Family(_albert, "post", dims=BERT_DIMS, head_norm=("predictions", "LayerNorm"), notes=_albert_notes),
}
