"""Encoder-decoder cases (eigenhooks/models/seq2seq.py): the T5 line, the BART line (post- and pre-norm), Whisper.

Rows run encoder self-attention first, then per decoder layer its self- and cross-attention.
The ``mid`` reference is the model's own add, read with the test's own hooks: the sublayer's
residual input plus its attention output (then BART's post-attention norm).
"""

import torch
import transformers as T
from harness import Case, nth_calls, record, seeded

B, N_ENC, N_DEC = 2, 7, 5
ENC_PAD, DEC_PAD = 3, 2  # left padding of row 0 (encoder) and row 1 (decoder) in the padded batch
TOKENS = {"encoder": B * N_ENC - ENC_PAD, "decoder": B * N_DEC - DEC_PAD}


def _decoder_ids(g, padded: bool) -> dict:
    ids = torch.randint(3, 64, (B, N_DEC), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :DEC_PAD] = 0
    return {"decoder_input_ids": ids, "decoder_attention_mask": mask}


def text_inputs(model, padded: bool) -> dict:
    """input_ids/attention_mask (B, N_ENC) and decoder_input_ids/decoder_attention_mask (B, N_DEC)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (B, N_ENC), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :ENC_PAD] = 0
    return {"input_ids": ids, "attention_mask": mask, **_decoder_ids(g, padded)}


def _frames(model) -> int:
    c = model.config
    return c.max_source_positions * 2  # conv1 stride 1, conv2 stride 2 (modeling_whisper.py)


def whisper_inputs(model, padded: bool) -> dict:
    """input_features (B, n_mels, frames), decoder ids/mask (B, N_DEC); the encoder has no mask."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(B, model.config.num_mel_bins, _frames(model), generator=g)
    return {"input_features": feats, **_decoder_ids(g, padded)}


def adds(rows):
    """An independent mid: per row (residual-input module, attention, then) -> then(input + attention output).

    Args:
        rows: model -> [(module whose first input is the residual, attention module, then | None)], in the
            order the model applies its attentions.
    """

    def mid(model, inputs):
        rs = rows(model)
        ins, ats = [r[0] for r in rs], [r[1] for r in rs]
        with record(ins + ats) as got:
            model(**inputs)
        res = {}
        for i, ((x, _), (_, a), r) in enumerate(zip(nth_calls(got, ins), nth_calls(got, ats), rs)):
            res[i] = x + a if r[2] is None else r[2](x + a)
        return res

    return mid


def _t5_rows(model):
    out = []
    for blk in model.encoder.block:
        out.append((blk.layer[0], blk.layer[0].SelfAttention, None))
    for blk in model.decoder.block:
        out.append((blk.layer[0], blk.layer[0].SelfAttention, None))
        out.append((blk.layer[1], blk.layer[1].EncDecAttention, None))
    return out


def _bart_rows(post_norm: bool):
    def rows(model):
        base, out = model.base_model, []
        for blk in base.encoder.layers:
            first = blk.self_attn if post_norm else blk.self_attn_layer_norm
            out.append((first, blk.self_attn, blk.self_attn_layer_norm if post_norm else None))
        for blk in base.decoder.layers:
            first = blk.self_attn if post_norm else blk.self_attn_layer_norm
            out.append((first, blk.self_attn, blk.self_attn_layer_norm if post_norm else None))
            first = blk.encoder_attn if post_norm else blk.encoder_attn_layer_norm
            out.append((first, blk.encoder_attn, blk.encoder_attn_layer_norm if post_norm else None))
        return out

    return rows


def text_generate(model):
    """generate on one encoder row: the encoder runs once (N_ENC tokens), the decoder once per step."""
    ids = text_inputs(model, False)["input_ids"][:1]
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4)
    return kwargs, lambda seq: {"encoder": N_ENC, "decoder": seq.shape[1] - 1}


def whisper_generate(model):
    feats = whisper_inputs(model, False)["input_features"][:1]
    kwargs = dict(input_features=feats, max_new_tokens=4, min_new_tokens=4)
    # Whisper's generate returns the new tokens without the decoder start token: the start token and all
    # new tokens but the last are fed, seq.shape[1] in all (checked with a hook on the decoder's input_ids).
    return kwargs, lambda seq: {"encoder": model.config.max_source_positions, "decoder": seq.shape[1]}


def _calibration(inputs):
    return lambda model: inputs(model, False)


def _extra(gen, inputs, tokens):
    return {"tokens": tokens, "generate": gen, "calibration": _calibration(inputs)}


SMALL = dict(vocab_size=64, d_model=16, max_position_embeddings=32, pad_token_id=1, bos_token_id=0)
BART = dict(
    SMALL,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=4,  # another head count per stack: each row reads its own
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    eos_token_id=2,
    decoder_start_token_id=2,
    init_std=0.2,
)
WHISPER = dict(
    vocab_size=64,
    num_mel_bins=8,
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=4,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_source_positions=8,
    max_target_positions=32,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=3,
    init_std=0.2,
)
T5CFG = dict(
    vocab_size=64,
    d_model=16,
    d_kv=4,  # H * d_kv = 8 != d_model: the inner width is its own
    d_ff=32,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=2,
    relative_attention_num_buckets=8,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
TEXT = _extra(text_generate, text_inputs, TOKENS)


def t5_case(model_cls, cfg_cls, family: str) -> Case:
    return Case(
        seeded(lambda: model_cls(cfg_cls(**T5CFG))),
        family,
        adds(_t5_rows),
        text_inputs,
        generate=True,
        stacks=("encoder", "decoder"),
        extra={**TEXT, "layout": "t5"},
    )


def bart_case(model_cls, cfg_cls, family: str, post_norm: bool) -> Case:
    return Case(
        seeded(lambda: model_cls(cfg_cls(**BART))),
        family,
        adds(_bart_rows(post_norm=post_norm)),
        text_inputs,
        generate=True,
        stacks=("encoder", "decoder"),
        extra={**TEXT, "layout": "post" if post_norm else "pre"},
    )


CASES = {
    "t5": t5_case(T.T5ForConditionalGeneration, T.T5Config, "t5"),
    "mt5": t5_case(T.MT5ForConditionalGeneration, T.MT5Config, "mt5"),
    "umt5": t5_case(T.UMT5ForConditionalGeneration, T.UMT5Config, "umt5"),
    "bart (post-norm)": bart_case(T.BartForConditionalGeneration, T.BartConfig, "bart", True),
    "marian (post-norm)": bart_case(T.MarianMTModel, T.MarianConfig, "marian", True),
    "plbart (post-norm)": bart_case(T.PLBartForConditionalGeneration, T.PLBartConfig, "plbart", True),
    "blenderbot-small (post-norm)": bart_case(
        T.BlenderbotSmallForConditionalGeneration, T.BlenderbotSmallConfig, "blenderbot-small", True
    ),
    "mbart": bart_case(T.MBartForConditionalGeneration, T.MBartConfig, "mbart", False),
    "pegasus": bart_case(T.PegasusForConditionalGeneration, T.PegasusConfig, "pegasus", False),
    "m2m_100": bart_case(T.M2M100ForConditionalGeneration, T.M2M100Config, "m2m_100", False),
    "blenderbot": bart_case(T.BlenderbotForConditionalGeneration, T.BlenderbotConfig, "blenderbot", False),
    "whisper": Case(
        seeded(lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(**WHISPER))),
        "whisper",
        adds(_bart_rows(post_norm=False)),
        whisper_inputs,
        generate=True,
        stacks=("encoder", "decoder"),
        extra={
            **_extra(
                whisper_generate,
                whisper_inputs,
                {"encoder": B * WHISPER["max_source_positions"], "decoder": TOKENS["decoder"]},
            ),
            "layout": "pre",
        },
    ),
}
