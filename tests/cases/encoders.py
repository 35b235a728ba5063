"""Encoder cases (eigenhooks/models/encoders.py)."""

import transformers as T
from harness import Case, family_model, seeded, sum_mid, token_inputs

TOK = token_inputs()
BERT = dict(
    num_hidden_layers=2,
    num_attention_heads=2,
    hidden_size=16,
    intermediate_size=32,
    vocab_size=64,
    max_position_embeddings=40,
)


def _bert_layers(m):
    return m.base_model.encoder.layer


def _albert_layers(m):
    enc, c = m.base_model.encoder, m.config
    per = c.num_hidden_layers / c.num_hidden_groups
    return [b for i in range(c.num_hidden_layers) for b in enc.albert_layer_groups[int(i / per)].albert_layers]


BERT_MID = sum_mid(_bert_layers, lambda b: b.attention.output.dense, then=lambda b, x: b.attention.output.LayerNorm(x))
SMALL = dict(BERT, initializer_range=0.2)  # F of order 0.1, not 1e-3


def _electra():
    # embedding_size < hidden_size: embeddings_project sits before layer 0, so layer 0's pre is its output
    return T.ElectraForMaskedLM(T.ElectraConfig(**SMALL, embedding_size=8))


def _deberta_v2():
    # relative attention with both disentangled terms and the ConvLayer after layer 0
    cfg = T.DebertaV2Config(
        **SMALL,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=16,
        conv_kernel_size=3,
        type_vocab_size=0,
    )
    return T.DebertaV2ForMaskedLM(cfg)


def _modernbert():
    # layer 0 global (its attn_norm an Identity), layer 1 sliding-window
    cfg = T.ModernBertConfig(
        **SMALL,
        global_attn_every_n_layers=2,
        local_attention=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        sep_token_id=2,
        cls_token_id=1,
    )
    return T.ModernBertForMaskedLM(cfg)


DEBERTA_MID = sum_mid(
    _bert_layers, lambda b: b.attention.output.dense, then=lambda b, x: b.attention.output.LayerNorm(x)
)
MODERNBERT_MID = sum_mid(lambda m: m.base_model.layers, lambda b: b.attn)

CASES = {
    "bert": Case(seeded(lambda: family_model("bert", max_position_embeddings=40)), "bert", BERT_MID, TOK),
    "roberta": Case(seeded(lambda: family_model("roberta")), "roberta", BERT_MID, TOK),
    "xlm-roberta": Case(
        seeded(lambda: T.XLMRobertaForMaskedLM(T.XLMRobertaConfig(**BERT))), "xlm-roberta", BERT_MID, TOK
    ),
    "distilbert": Case(
        seeded(lambda: family_model("distilbert")),
        "distilbert",
        sum_mid(lambda m: m.base_model.transformer.layer, lambda b: b.attention, then=lambda b, x: b.sa_layer_norm(x)),
        TOK,
    ),
    "albert (shared)": Case(
        seeded(lambda: family_model("albert")),
        "albert",
        sum_mid(_albert_layers, lambda b: b.attention.dense, then=lambda b, x: b.attention.LayerNorm(x)),
        TOK,
    ),
    "electra": Case(seeded(_electra), "electra", BERT_MID, TOK),
    "deberta-v2": Case(seeded(_deberta_v2), "deberta-v2", DEBERTA_MID, TOK),
    "modernbert": Case(seeded(_modernbert), "modernbert", MODERNBERT_MID, TOK),
}
