"""Encoder-decoders (encoder self-attention, decoder self- and cross-attention).

T5, mT5, UMT5; BART, Marian, PLBart, BlenderbotSmall (post-norm); mBART, Pegasus, M2M100,
Blenderbot (pre-norm); Whisper (speech encoder on ``input_features``).

One row per attention application, in forward order: every encoder layer's self-attention
(``stack='encoder'``), then per decoder layer its self-attention and its cross-attention
(``stack='decoder'``, ``kind='self'`` / ``'cross'``). All projections are ``nn.Linear``
(out, in), one head count per stack: F = o.weight @ v.weight, split into heads.

Reading points (values are read where they are consumed):

- pre-norm (T5, mBART, Whisper): ``pre`` = input of the norm before the attention; ``mid`` =
  input of the next sublayer's norm (the cross-attention's norm after decoder self-attention,
  the FFN's norm otherwise).
- post-norm (BART): ``pre`` = the attention's input; ``mid`` = the output of the norm after
  the add (``self_attn_layer_norm`` / ``encoder_attn_layer_norm``).
- ``post`` = what the next block of the same stack receives (its first norm's or attention's
  input), the stack's final norm's input, or (BART's last decoder layer) the layer's output.
  Both rows of one decoder layer share that ``post``: it is read after the whole block, so
  the self row's ``post`` is not its ``mid`` (the cross-attention's input).

Cross-attention: the values are the encoder's final states, so F_cross = O V acts on the
encoder's residual space, and its update is added to the decoder's residual. ``pre``/``mid``
are decoder states: ρ says whether adding the cross-attention update tilts the decoder
residual toward v1(F_cross). There is no power-step reading (the layer does not map a
state to F times itself). The probe replaces ``key_value_states`` by identical tokens, so it
returns F_cross x + c whatever the queries.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import UnsupportedModelError
from .family import Family, attr, linear, row

CROSS_NOTE = (
    "cross-attention rows (kind='cross'): F = O V acts on the encoder's final states, the update is added to "
    "the decoder residual; rho says whether that update tilts the decoder residual toward v1(F_cross) "
    "(pre/mid are decoder states); there is no power-step reading"
)
POST_NOTE = (
    "decoder layers: both rows (self, cross) read 'post' after the whole block; 'mid' of the self row is the "
    "cross-attention's input"
)


def _stack_posts(layers: list[nn.Module], first_in, final: nn.Module | None) -> list[dict]:
    """Per layer of one stack: how 'post' is read (the next layer's consumer, the final norm, or its output)."""
    out = []
    for k, blk in enumerate(layers):
        if k + 1 < len(layers):
            out.append({"post_in": first_in(layers[k + 1])})
        elif final is not None:
            out.append({"post_in": final})
        else:
            out.append({"post_out": blk})
    return out


# ---- T5 ----


def _t5_attn(sub, n_heads: int) -> dict:
    """One T5 sublayer (T5LayerSelfAttention / T5LayerCrossAttention): pre-norm ``layer_norm``, then q/k/v/o.

    F = o.weight (d, H d_kv) @ v.weight (H d_kv, d); H d_kv need not equal d.
    """
    a = getattr(sub, "SelfAttention", None) or getattr(sub, "EncDecAttention", None)
    return dict(attn=a, norm=sub.layer_norm, factors=linear(a.v, a.o, n_heads, n_heads), o_proj=a.o)


def _t5_stack(stack, name: str, cfg, probe_arg: str):
    """Rows of one T5Stack: block.layer = [self-attention, (cross-attention,) FF], each with its own norm."""
    H = cfg.num_heads
    blocks = list(stack.block)
    posts = _stack_posts(blocks, lambda b: b.layer[0].layer_norm, stack.final_layer_norm)
    for blk, post in zip(blocks, posts):
        s = _t5_attn(blk.layer[0], H)
        if not getattr(blk, "is_decoder", False):
            yield _row(blk, s, mid_in=blk.layer[-1].layer_norm, stack=name, **post)
            continue
        c = _t5_attn(blk.layer[1], H)
        yield _row(blk, s, mid_in=blk.layer[1].layer_norm, stack=name, **post)
        yield _row(blk, c, mid_in=blk.layer[2].layer_norm, stack=name, kind="cross", probe_arg=probe_arg, **post)


def _t5_like(probe_arg: str):
    """T5 / mT5 (cross-attention values in ``key_value_states``), UMT5 (in ``encoder_hidden_states``)."""

    def rows(base, cfg):
        for name in ("encoder", "decoder"):
            stack = getattr(base, name, None)
            if stack is not None:
                yield from _t5_stack(stack, name, cfg, probe_arg)

    return rows


def _row(blk, a: dict, **extra) -> dict:
    a = dict(a)
    attn = a.pop("attn")
    return row(blk, attn, attn, a.pop("norm"), a.pop("factors"), a.pop("o_proj"), **a, **extra)


# ---- BART, mBART, Whisper: self_attn / encoder_attn with v_proj / out_proj ----


def _bart_attn(a, n_heads: int, norm) -> dict:
    return dict(attn=a, norm=norm, factors=linear(a.v_proj, a.out_proj, n_heads, n_heads), o_proj=a.out_proj)


def _bart_stack(stack, name: str, H: int, pre_norm: bool):
    """Rows of one BART-style stack (``layers``; self_attn, encoder_attn in decoder layers, v_proj/out_proj)."""
    layers = list(stack.layers)
    final = getattr(stack, "layer_norm", None) if pre_norm else None
    first = (lambda b: b.self_attn_layer_norm) if pre_norm else (lambda b: b.self_attn)
    for blk, post in zip(layers, _stack_posts(layers, first, final)):
        s = _bart_attn(blk.self_attn, H, blk.self_attn_layer_norm)
        cross = getattr(blk, "encoder_attn", None)
        if cross is None:
            yield _row(blk, s, mid_in=blk.final_layer_norm if pre_norm else None, stack=name, **post)
            continue
        c = _bart_attn(cross, H, blk.encoder_attn_layer_norm)
        yield _row(blk, s, mid_in=blk.encoder_attn_layer_norm if pre_norm else None, stack=name, **post)
        yield _row(
            blk,
            c,
            mid_in=blk.final_layer_norm if pre_norm else None,
            stack=name,
            kind="cross",
            probe_arg="key_value_states",
            **post,
        )


def _bart_like(pre_norm: bool):
    def rows(base, cfg):
        for name, H in (("encoder", cfg.encoder_attention_heads), ("decoder", cfg.decoder_attention_heads)):
            stack = getattr(base, name, None)
            if stack is not None:
                yield from _bart_stack(stack, name, H, pre_norm)

    return rows


def _dims(c) -> tuple[int, int, int]:
    H = getattr(c, "encoder_attention_heads", None) or c.num_heads
    return c.d_model, H, H


# ---- probe inputs ----


def _token_ids(model, b: int, n: int, device) -> torch.Tensor:
    cfg = model.config
    pad = getattr(cfg, "pad_token_id", None)
    tok = int(pad) if isinstance(pad, int) and pad >= 0 else 0
    return torch.full((b, n), tok, dtype=torch.long, device=device)


def seq2seq_inputs(model: nn.Module, b: int, n: int, device: torch.device) -> dict:
    """Probe inputs of a text encoder-decoder: input_ids, attention_mask, decoder_input_ids (b, n) each.

    An encoder-only model (T5EncoderModel) gets no decoder inputs.
    """
    ids = _token_ids(model, b, n, device)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    base = getattr(model, "base_model", model)
    if getattr(base, "decoder", None) is not None:
        out["decoder_input_ids"] = ids.clone()
    return out


def whisper_inputs(model: nn.Module, b: int, n: int, device: torch.device) -> dict:
    """Probe inputs of Whisper: zero ``input_features`` (b, n_mels, 2 * max_source_positions), decoder ids (b, n).

    The encoder only accepts its full frame count; the probe repeats its identical token to that length.
    """
    cfg = model.config
    frames = _whisper_frames(model)
    p = next(model.parameters())
    feats = torch.zeros(b, cfg.num_mel_bins, frames, dtype=p.dtype, device=device)
    out = {"input_features": feats}
    base = getattr(model, "base_model", model)
    if getattr(base, "decoder", None) is not None:
        out["decoder_input_ids"] = _token_ids(model, b, n, device)
    return out


def _whisper_frames(model) -> int:
    base = getattr(model, "base_model", model)
    enc = getattr(base, "encoder", None)
    if enc is None or not hasattr(enc, "conv1"):
        raise UnsupportedModelError(
            f"whisper: {type(model).__name__} has no encoder with conv1/conv2; probe inputs cannot be built"
        )
    return model.config.max_source_positions * enc.conv1.stride[0] * enc.conv2.stride[0]


def _stacks(mask_kw: dict[str, str | None]):
    """base -> {stack name: (the stack's module, the kwarg carrying its padding mask, or None)}."""

    def get(base):
        return {n: (getattr(base, n), kw) for n, kw in mask_kw.items() if getattr(base, n, None) is not None}

    return get


def _notes(extra: list[str]):
    def notes(cfg) -> list[str]:
        return [CROSS_NOTE, POST_NOTE, *extra] if getattr(cfg, "is_encoder_decoder", True) else list(extra)

    return notes


TEXT_STACKS = _stacks({"encoder": "attention_mask", "decoder": "attention_mask"})
WHISPER_NOTE = (
    "whisper encoder: it does not mask its frames, so every frame (max_source_positions per row) counts; "
    "the probe feeds zero input_features"
)

T5_NOTE = "t5: relative position bias enters the scores only; F = o.weight @ v.weight (no attention scaling)"


def _t5_family(probe_arg: str) -> Family:
    return Family(
        _t5_like(probe_arg),
        "pre",
        attr("decoder", "final_layer_norm"),
        lambda c: (c.d_model, c.num_heads, c.num_heads),
        notes=_notes([T5_NOTE]),
        inputs=seq2seq_inputs,
        stacks=TEXT_STACKS,
    )


def _bart_family(pre_norm: bool) -> Family:
    """BART-style text encoder-decoders: post-norm (BART, Marian, PLBart, BlenderbotSmall) or pre-norm with
    a final ``layer_norm`` per stack (mBART, Pegasus, M2M100, Blenderbot)."""
    return Family(
        _bart_like(pre_norm=pre_norm),
        "pre" if pre_norm else "post",
        attr("decoder", "layer_norm"),
        _dims,
        notes=_notes([]),
        inputs=seq2seq_inputs,
        stacks=TEXT_STACKS,
    )


FAMILIES = {
    "t5": _t5_family("key_value_states"),
    "mt5": _t5_family("key_value_states"),
    "umt5": _t5_family("encoder_hidden_states"),
    "bart": _bart_family(pre_norm=False),
    "marian": _bart_family(pre_norm=False),
    "plbart": _bart_family(pre_norm=False),
    "blenderbot-small": _bart_family(pre_norm=False),
    "mbart": _bart_family(pre_norm=True),
    "pegasus": _bart_family(pre_norm=True),
    "m2m_100": _bart_family(pre_norm=True),
    "blenderbot": _bart_family(pre_norm=True),
    "whisper": Family(
        _bart_like(pre_norm=True),
        "pre",
        attr("decoder", "layer_norm"),
        _dims,
        notes=_notes([WHISPER_NOTE]),
        inputs=whisper_inputs,
        stacks=_stacks({"encoder": None, "decoder": "attention_mask"}),
    ),
}
