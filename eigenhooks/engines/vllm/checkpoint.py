"""A ``vllm.LLM``'s checkpoint: the adapter ``eh.spectra(llm)`` and the monitor read, and ``eh.verify``'s refusal.

The folder, revision, dtype and architecture come from the engine's model config
(``models.vllm_weights.engine_source``); the tensors are read once per engine (``engines.checkpoint``).
``verify(llm)`` cannot run the identical-token probe through the engine (its attention runs only inside a
scheduled forward, with the engine's batch metadata) and says so in one line, naming the check that can
run: ``verify`` on the transformers model loaded from the same folder. Imports no vLLM.
"""

from __future__ import annotations

import threading
import weakref

from ...models import Adapter
from ...models import vllm_weights as layouts
from ...models.engines import EngineVerifyError
from ...zoo import checkpoint
from ..checkpoint import folder_adapter

_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its checkpoint adapter
_lock = threading.Lock()


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


__all__ = ["engine_adapter", "refuse_verify"]
