"""The adapter over a checkpoint folder's attention tensors: what an engine loaded, read without the model.

An engine's own weights are merged, sharded across workers and repacked by its backend, so eigenhooks
reads F = O V (and the norms feeding attention) from the checkpoint the engine loaded: the tensors the
architecture's layout names (``models.vllm_weights.ARCHITECTURES``), from its safetensors files
(``zoo.checkpoint``), in the dtype the engine computes in. ``eh.spectra`` of an engine and the monitor's
plan (in the user's process and the engine's worker) are built from it; no transformers model is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import Adapter
from ..models import vllm_weights as layouts
from ..zoo import checkpoint


def folder_adapter(folder: str | Path, dtype: torch.dtype | None = None, architecture=None, dims=None) -> Adapter:
    """The adapter over the attention weights a checkpoint folder holds (what a vLLM engine reads).

    Args:
        folder: a folder saved with ``save_pretrained`` (config.json and safetensors files).
        dtype: the dtype to read the weights in (the engine's; None: as stored).
        architecture: the vLLM architecture (default: the first of config.json's ``architectures``).
        dims: ``models.vllm_weights.attention_dims`` of the config (default: read from config.json).

    Raises:
        UnsupportedModelError: an architecture ``models.vllm_weights.ARCHITECTURES`` does not know.
        ModelLoadError: no config.json, no safetensors, or a tensor the layout names is missing.
    """
    folder = Path(folder)
    if architecture is None or dims is None:
        cfg = checkpoint.read_config(folder)
        architecture = architecture or layouts.architecture_of(folder, cfg)
        dims = dims or layouts.attention_dims(cfg)
    layout = layouts.layout_for(architecture)
    names = [n for i in range(dims.n_layers) for n in layout.names(i).values()]
    tensors = checkpoint.read_tensors(folder, names, dtype)
    dt = str(dtype or next(iter(tensors.values())).dtype).replace("torch.", "")
    read = lambda name: checkpoint.read_tensors(folder, [name], dtype)[name]
    return layouts.checkpoint_adapter(tensors, layout, dims, f"{folder} ({architecture}, {dt})", read)


def drop_resident(adapter: Adapter) -> int:
    """The adapter's checkpoint tensors that are still maps of their file (``zoo.checkpoint.drop_resident``)
    given back to the kernel once a plan is built; they stay readable. Returns the bytes given back.

    The heap's free memory goes back too (glibc's ``malloc_trim``): building a plan frees far more than it
    keeps (every layer's eigen-decomposition and null draws, in blocks the allocator would otherwise hold,
    ~60 MB of SmolLM2's in a process that builds one plan and then only reads states back)."""
    from ..spectra.memo import layer_parameters

    given = checkpoint.drop_resident([p for i in range(adapter.n_layers) for p in layer_parameters(adapter, i)])
    trim_heap()
    return given


def trim_heap() -> None:
    """Give the heap's free memory back to the kernel (glibc's ``malloc_trim``; elsewhere, nothing)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
        pass


__all__ = ["drop_resident", "folder_adapter", "trim_heap"]
