"""``eh.monitor``: a serving engine gets its engine monitor, any other model the monitor's own.

The one place that tells an engine from a model for ``eh.monitor`` (``models.vllm_weights.is_vllm_engine``
recognises a ``vllm.LLM`` by its class, importing no vLLM), so that ``eigenhooks/monitor/`` holds no engine
branch. Its signature and docstring are ``monitor.monitor``'s.
"""

from __future__ import annotations

from ..models.vllm_weights import is_vllm_engine
from ..monitor import facade


def monitor(model, *args, **kw):
    if is_vllm_engine(model):
        from .vllm.monitor import EngineMonitor

        return EngineMonitor(model, *args, **kw)
    return facade.monitor(model, *args, **kw)


monitor.__doc__ = facade.monitor.__doc__ + (
    "\n    On a ``vllm.LLM`` built with ``additional_config={'eigenhooks': {}}`` it returns an "
    "``engines.vllm.monitor.EngineMonitor`` (docs/vllm.md).\n"
)
monitor.__signature__ = facade.monitor.__signature__

__all__ = ["monitor"]
