"""Adapters: the only place that knows model layouts. ``get_adapter(model)`` picks one.

Owns the ``Adapter`` interface (where the layers are, which linear is V, which is O, which norm
feeds attention, where the reading points are), the HF families by kind, the TransformerLens
adapter, the identical-token probe that is their ground truth, and offload maps. It may import
only ``linalg`` (for ``Factors``); it never loads a model (that is ``zoo``).
"""

from __future__ import annotations

import torch

from .base import (
    Adapter,
    Layer,
    LayoutError,
    ReadingPoints,
    Tap,
    UnsupportedConfigError,
    UnsupportedModelError,
    layer_index,
)
from .hf import FAMILIES, generic_adapter, hf_adapter, is_hf_model, supported_families
from .lens import is_lens_model, lens_adapter
from .offload import empty_meta_parameters

__all__ = [
    "Adapter",
    "Layer",
    "LayoutError",
    "ReadingPoints",
    "Tap",
    "UnsupportedConfigError",
    "UnsupportedModelError",
    "get_adapter",
    "layer_index",
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
        ValueError: some weights are on the meta device and no accelerate offload map holds them.
    """
    if isinstance(model, Adapter):
        return model
    if not isinstance(model, torch.nn.Module):
        raise _unsupported(model)
    # Offloaded weights (accelerate) are meta in the module but live in an offload map; only
    # meta parameters that no map holds are empty.
    empty = empty_meta_parameters(model)
    if empty:
        raise ValueError(
            f"{type(model).__name__} has {len(empty)} parameter(s) on the meta device that no offload map "
            f"holds (e.g. {empty[0]!r}): the model has no weights (built under init_empty_weights?). "
            "Load its weights first: accelerate's load_checkpoint_and_dispatch(model, checkpoint, "
            "device_map='auto') (CPU/disk offload is fine), from_pretrained(..., device_map=...), or "
            "model.to_empty(device='cpu') then model.load_state_dict(...)."
        )
    if is_lens_model(model):
        return lens_adapter(model)
    if is_hf_model(model):
        try:
            return hf_adapter(model)
        except UnsupportedModelError:
            if getattr(model.config, "model_type", None) in FAMILIES:
                raise  # the family knows this model and says why; the generic probe would guess wrong
        try:
            return generic_adapter(model)
        except UnsupportedModelError as e:
            raise _unsupported(model) from e
    raise _unsupported(model)
