"""Spectra of a serving engine: the adapter over the checkpoint it loaded, from the engine's registration.

An engine (``models.engines``: registered by ``eigenhooks.engines``) cannot be read like a model; its
registration gives the adapter over its checkpoint's attention tensors, which ``spectra`` reads as any.
"""

from __future__ import annotations

from ..models import Adapter, get_adapter
from ..models.engines import engine_of


def adapter_of(model) -> Adapter:
    """``get_adapter(model)``, or for a registered serving engine the adapter over its checkpoint."""
    engine = engine_of(model)
    return engine.adapter(model) if engine is not None else get_adapter(model)


__all__ = ["adapter_of"]
