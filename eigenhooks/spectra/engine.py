"""Spectra of a serving engine (``vllm.LLM``): F read from the checkpoint the engine loaded.

The engine's own weights are merged, sharded across workers and, on the CPU backend, repacked (a
worker's parameters show shape ``(0,)``), so ``spectra(llm)`` reads the checkpoint instead: the folder
from the engine's model config, the tensors its architecture's layout names (``models.vllm_weights``), cast to
the dtype the engine computes in. ``verify(llm)`` cannot run the identical-token probe through the
engine (its attention runs only inside a scheduled forward, with the engine's batch metadata) and
says so in one line, naming the check that can be run: ``verify`` on the transformers model loaded
from the same folder.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import torch

from ..models import Adapter, get_adapter
from ..models import vllm_weights as layouts
from ..zoo import checkpoint

_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its checkpoint adapter
_lock = threading.Lock()


class EngineVerifyError(TypeError):
    """``verify`` on an engine: the probe cannot run there; the message names the check that can."""


def adapter_of(model) -> Adapter:
    """``get_adapter(model)``, or for a ``vllm.LLM`` the adapter over its checkpoint's attention weights."""
    if layouts.is_vllm_engine(model):
        return engine_adapter(model)
    return get_adapter(model)


def engine_adapter(llm) -> Adapter:
    """The checkpoint adapter of a ``vllm.LLM``, read once per engine.

    Raises:
        UnsupportedModelError: an architecture eigenhooks does not know for vLLM, or a quantized engine.
        ModelLoadError: the checkpoint cannot be found locally, or lacks a tensor its layout names.
    """
    with _lock:
        try:
            found = _ADAPTERS.get(llm)
        except TypeError:  # not weak-referenceable: read every time
            found = None
        if found is None:
            src = layouts.engine_source(llm)
            folder = checkpoint.checkpoint_folder(src.model, src.revision, src.download_dir)
            found = folder_adapter(folder, src.dtype, src.architecture, src.config)
            try:
                _ADAPTERS[llm] = found
            except TypeError:
                pass
        return found


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


def refuse_verify(llm) -> EngineVerifyError:
    """The one-line error ``verify(llm)`` raises: what cannot be checked, and the check that can."""
    try:
        where = layouts.engine_source(llm).model
    except Exception:  # an unknown architecture etc.: still say what verify cannot do
        where = "/path/to/checkpoint"
    return EngineVerifyError(
        "eh.verify cannot probe a vllm.LLM (its attention runs only inside the engine's scheduled forward, and "
        "its weights are repacked); eh.spectra(llm) reads F from the checkpoint, so verify that checkpoint: "
        f"eh.verify(AutoModelForCausalLM.from_pretrained({where!r}, dtype=torch.float32))"
    )
