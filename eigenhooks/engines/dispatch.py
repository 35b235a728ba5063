"""``eh.monitor`` on a serving engine: the engine monitors this wing registers with the monitor's wing.

The one place that tells an engine from a model for ``eh.monitor`` (``models.vllm_weights.is_vllm_engine``
recognises a ``vllm.LLM`` by its class, importing no vLLM), so that ``eigenhooks/monitor/`` holds no engine
branch: ``monitor.register_engine`` keeps the pair, and calling the wing asks it first.
"""

from __future__ import annotations

from ..models.vllm_weights import is_vllm_engine
from ..monitor import register_engine


def _vllm_monitor(model, *args, **kw):
    from .vllm.monitor import EngineMonitor

    return EngineMonitor(model, *args, **kw)


def register() -> None:
    """Register the engines this wing knows (idempotent)."""
    register_engine(is_vllm_engine, _vllm_monitor)
