"""HuggingFace models: the family table, and the adapter built from it.

Family knowledge lives in one table of small functions, split by kind: ``gpt`` (GPT
lineage), ``decoders`` (Llama style), ``special`` (MoE, MLA, sinks, hybrids), ``encoders``,
``seq2seq`` and ``vision``. Each maps ``model_type`` to a ``Family`` (``family.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from . import decoders, encoders, gpt, seq2seq, special, vision
from .base import Adapter, Layer, NormPosition, UnsupportedModelError
from .family import Family, attr
from .probe import input_embeddings

FAMILIES: dict[str, Family] = {
    **gpt.FAMILIES,
    **decoders.FAMILIES,
    **special.FAMILIES,
    **encoders.FAMILIES,
    **seq2seq.FAMILIES,
    **vision.FAMILIES,
}


def _unembedding_of(model):
    """The LM head's weight (vocab, d), or None for a bare model."""

    def get():
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return None if out is None else out.weight.detach()

    return get


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def _group_ids(modules: list[nn.Module]) -> list[int]:
    seen: dict[int, int] = {}
    return [seen.setdefault(id(m), len(seen)) for m in modules]


def hf_adapter(model: nn.Module) -> Adapter:
    """Build the adapter for a HuggingFace model (bare or with a head)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(f"no HF family rule for model_type={model_type!r}")
    fam = FAMILIES[model_type]
    base = getattr(model, "base_model", model)
    norm_position: NormPosition = fam.norm(cfg) if callable(fam.norm) else fam.norm
    rows = list(fam.rows(base, cfg))
    if not rows:
        raise UnsupportedModelError(f"{model_type}: no attention layers found in {type(model).__name__}")
    groups = _group_ids([r["attn_out"] for r in rows])
    names = _names(model)
    layers = [
        Layer(index=i, group=g, name=names.get(id(r["attn_in"]), ""), **{"norm_offset": fam.norm_offset, **r})
        for i, (r, g) in enumerate(zip(rows, groups))
    ]
    d, H, G = fam.dims(cfg)
    final = fam.final(base)
    if final is None and fam.head_norm:
        final = attr(*fam.head_norm)(model)
    notes = list(fam.notes(cfg))
    if any(not ly.linear for ly in layers):
        notes.append(
            "nonlinear value path: F is the linear map read from the weights; the probe is only a local "
            "linearisation and is never reported as F"
        )
    return Adapter(
        model=model,
        family=model_type,
        backend="hf",
        layers=layers,
        norm_position=norm_position,
        d_model=d,
        n_heads=H,
        n_kv_heads=G,
        final_norm_module=final,
        final_norm_offset=fam.norm_offset,
        unembed_weight=_unembedding_of(model),
        notes=notes,
        probe_inputs=fam.inputs,
        probe_separately=fam.probe_separately,
        final_in=fam.final_in,
        stacks=fam.stacks(base),
    )


def _names(model: nn.Module) -> dict[int, str]:
    """Each module's dotted name by its id (the first name of a module registered twice), walked once."""
    names: dict[int, str] = {}
    for n, m in model.named_modules():
        names.setdefault(id(m), n)
    return names


# ---- generic fallback: find the attention blocks, then read F from the probe ----

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "attn_layer")


def generic_adapter(model: nn.Module) -> Adapter:
    """Fallback for other HF models: locate the block list and each block's attention module.

    F then comes from the identical-token probe alone (no weight rule). Norm position is
    assumed 'pre' (the common case for current decoders); this is recorded in the notes.
    """
    blocks = _find_block_list(model)
    if blocks is None:
        raise UnsupportedModelError(
            f"could not find a list of attention blocks in {type(model).__name__}; "
            f"supported families: {', '.join(supported_families())}, TransformerLens models"
        )
    layers, names = [], _names(model)
    for i, blk in enumerate(blocks):
        attn = next(getattr(blk, n) for n in _ATTN_NAMES if isinstance(getattr(blk, n, None), nn.Module))
        layers.append(
            Layer(
                index=i,
                block=blk,
                attn_in=attn,
                attn_out=attn,
                norm=None,
                factors=None,
                group=i,
                name=names.get(id(attn), ""),
            )
        )
    d = _guess_width(model)
    cfg = getattr(model, "config", None)
    H = getattr(cfg, "num_attention_heads", 0) or 0
    G = getattr(cfg, "num_key_value_heads", None) or H
    base = getattr(model, "base_model", model)
    final = next((getattr(base, n) for n in ("norm", "ln_f", "final_layer_norm") if hasattr(base, n)), None)

    return Adapter(
        model=model,
        family=f"generic:{getattr(cfg, 'model_type', type(model).__name__)}",
        backend="hf",
        layers=layers,
        norm_position="pre",
        d_model=d,
        n_heads=H,
        n_kv_heads=G,
        final_norm_module=final,
        unembed_weight=_unembedding_of(model),
        notes=["generic adapter: F from the identical-token probe; norm position assumed 'pre'"],
    )


def _find_block_list(model: nn.Module) -> nn.ModuleList | None:
    best = None
    for _, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        if all(any(isinstance(getattr(m, n, None), nn.Module) for n in _ATTN_NAMES) for m in mod):
            if best is None or len(mod) > len(best):
                best = mod
    return best


def _guess_width(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    w = getattr(input_embeddings(model), "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return w.shape[1]
    raise UnsupportedModelError(f"cannot tell the residual width of {type(model).__name__}")


def is_hf_model(model) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type") and isinstance(model, nn.Module)


__all__ = ["FAMILIES", "generic_adapter", "hf_adapter", "is_hf_model", "supported_families"]
