"""Vision and multimodal towers: ViT, CLIP (text tower, vision tower, both towers).

Vision towers take ``pixel_values`` (batch, channels, height, width), not token ids: their
``Family.inputs`` builds a blank image of the configured size for the probe, which then
replaces each layer's attention input by identical tokens stretched to the tower's real
length (patches + CLS). They have no attention mask: every patch token counts.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import UnsupportedModelError
from .encoders import need
from .family import Family, attr, linear, mha_dims, row, token_inputs


def _image_size(cfg) -> tuple[int, int, int]:
    """(channels, height, width) of a vision config, or an error naming the missing key."""
    size, ch = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", 3)
    if isinstance(size, int):
        return ch, size, size
    if isinstance(size, (tuple, list)) and len(size) == 2:
        return ch, int(size[0]), int(size[1])
    raise UnsupportedModelError(
        f"{type(cfg).__name__}: cannot build probe pixel_values, image_size={size!r} "
        "(expected an int or (height, width))"
    )


def _dtype(model: nn.Module) -> torch.dtype:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return p.dtype if p is not None else torch.float32


def _pixels(model: nn.Module, cfg, b: int, device: torch.device) -> torch.Tensor:
    """A blank image batch (b, C, H, W): its content is irrelevant, the probe replaces the tokens."""
    return torch.zeros(b, *_image_size(cfg), dtype=_dtype(model), device=device)


def pixel_inputs(model: nn.Module, b: int, n: int, device: torch.device) -> dict:
    """The probe's forward inputs for a vision tower: ``pixel_values`` (b, C, H, W); n is not used
    (the tower's length is its patch count, and the probe stretches its tokens to it)."""
    return {"pixel_values": _pixels(model, model.config, b, device)}


def clip_inputs(model: nn.Module, b: int, n: int, device: torch.device) -> dict:
    """Both towers' inputs for ``CLIPModel``: token ids (b, n) and pixel_values (b, C, H, W)."""
    kw = token_inputs(model, b, n, device)
    kw["pixel_values"] = _pixels(model, model.config.vision_config, b, device)
    return kw


def _vit(base, cfg):
    """ViT (transformers 5 layout): pre-norm, ``attention.v_proj`` and ``attention.o_proj``."""
    H = cfg.num_attention_heads
    for blk in need(base, "layers"):
        a = need(blk, "attention")
        v, o = need(a, "v_proj"), need(a, "o_proj")
        yield row(blk, a, a, need(blk, "layernorm_before"), linear(v, o, H, H), o, mid_in=need(blk, "layernorm_after"))


def _clip_stack(encoder: nn.Module, cfg, stack: str, masked: bool, width: int | None = None):
    """One CLIP tower's ``CLIPEncoderLayer`` list: pre-norm, layer_norm1 -> self_attn -> add -> layer_norm2.

    ``width`` marks the tower's residual width on its layers (CLIPModel's towers differ: 512 and 768
    in openai/clip-vit-base-patch32); each layer's F is (width, width)."""
    H = cfg.num_attention_heads
    for blk in need(encoder, "layers"):
        a = need(blk, "self_attn")
        v, o = need(a, "v_proj"), need(a, "out_proj")
        f = linear(v, o, H, H)
        ln1, ln2 = need(blk, "layer_norm1"), need(blk, "layer_norm2")
        yield row(blk, a, a, ln1, f, o, mid_in=ln2, stack=stack, masked=masked, d_model=width)


def _clip_text(base, cfg):
    yield from _clip_stack(need(base, "encoder"), cfg, "", True)


def _clip_vision(base, cfg):
    yield from _clip_stack(need(base, "encoder"), cfg, "", False)


def _clip(base, cfg):
    """Both towers, in forward order (``CLIPModel.forward`` runs the vision tower first); each
    layer carries its tower's width, ``Adapter.d_model`` is the text tower's."""
    t, v = cfg.text_config, cfg.vision_config
    yield from _clip_stack(need(base, "vision_model.encoder"), v, "vision", False, v.hidden_size)
    yield from _clip_stack(need(base, "text_model.encoder"), t, "text", True, t.hidden_size)


def _clip_dims(c) -> tuple[int, int, int]:
    t = c.text_config
    return t.hidden_size, t.num_attention_heads, t.num_attention_heads


def _no_mask_note(c) -> list[str]:
    return ["vision tower: no attention mask, every patch token (and CLS) counts"]


def _clip_notes(c) -> list[str]:
    t, v = c.text_config.hidden_size, c.vision_config.hidden_size
    return [
        f"residual widths: vision {v}, text {t} (adapter.d_model is the text width; adapter.width(layer) "
        "per layer: a direction to steer or a custom target has its layer's width)",
        "two stacks: 'vision' (no mask, every patch token counts) then 'text' (the attention_mask applies); "
        "post never crosses a stack",
        "the text tower's final_layer_norm and the vision tower's post_layernorm (on the pooled CLS only) are not read",
    ]


DIMS = mha_dims("hidden_size", "num_attention_heads")

FAMILIES = {
    "vit": Family(_vit, "pre", attr("layernorm"), DIMS, notes=_no_mask_note, inputs=pixel_inputs),
    "clip_text_model": Family(_clip_text, "pre", attr("final_layer_norm"), DIMS),
    "clip_vision_model": Family(_clip_vision, "pre", dims=DIMS, notes=_no_mask_note, inputs=pixel_inputs),
    "clip": Family(_clip, "pre", dims=_clip_dims, notes=_clip_notes, inputs=clip_inputs),
}
