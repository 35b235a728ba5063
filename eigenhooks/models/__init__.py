"""Adapters: the only place that knows model layouts. ``get_adapter(model)`` picks one."""

from __future__ import annotations

import torch

from .base import Adapter, Layer, ReadingPoints, Tap, UnsupportedModelError
from .hf import generic_adapter, hf_adapter, is_hf_model, supported_families
from .lens import is_lens_model, lens_adapter

__all__ = [
    "Adapter",
    "Layer",
    "ReadingPoints",
    "Tap",
    "UnsupportedModelError",
    "get_adapter",
    "supported_families",
]


def _unsupported(model) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"eigenhooks cannot find the attention layers of {type(model).__name__}. Supported: "
        f"HuggingFace families {', '.join(supported_families())} (bare or with heads), any other HF "
        "model whose blocks hold an attention module (generic probe), and TransformerLens "
        "TransformerBridge / HookedTransformer models. Pass one of these, or an Adapter you built."
    )


def get_adapter(model) -> Adapter:
    """Return the adapter for ``model`` (an Adapter passes through).

    Raises:
        UnsupportedModelError: no family fits and no attention blocks can be found.
        ValueError: the model's weights are on the meta device (not materialised).
    """
    if isinstance(model, Adapter):
        return model
    if not isinstance(model, torch.nn.Module):
        raise _unsupported(model)
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"{type(model).__name__} has {len(meta)} parameter(s) on the meta device (e.g. {meta[0]!r}); "
            "eigenhooks needs real weights. Load the model with its weights (not under init_empty_weights) "
            "or call model.to_empty(...) and load a state dict first."
        )
    if is_lens_model(model):
        return lens_adapter(model)
    if is_hf_model(model):
        try:
            return hf_adapter(model)
        except UnsupportedModelError:
            pass
        try:
            return generic_adapter(model)
        except UnsupportedModelError as e:
            raise _unsupported(model) from e
    raise _unsupported(model)
