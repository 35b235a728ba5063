"""Serving engines: the glue that puts the monitor inside an engine that runs the model itself.

Owns the engine-neutral parts at its root: ``requests`` (an engine's flat batches as sequences: each
token's request and position, each (request, position) counted once, requests ended by the engine's
scheduler) and ``checkpoint`` (the adapter over the checkpoint an engine loaded, read without loading the
model); and each engine's glue in a folder of its own, ``vllm`` (the opt-in plugin, the taps placed
before vLLM compiles, the worker extension, the monitor on an engine, the served sink). Each engine is
one ``models.engines.register`` line below, the registration ``eh.monitor``, ``eh.Monitor``,
``eh.spectra`` and ``eh.verify`` consult. It sits above ``monitor`` on the ladder and may import
``monitor``, ``spectra``, ``models`` and below. Nothing here imports an engine until an engine calls it:
``import eigenhooks`` never imports vLLM.
"""

from ..models.engines import Engine, register
from ..models.vllm_weights import is_vllm_engine


def _vllm_monitor(llm, *args, **kw):
    from .vllm.monitor import EngineMonitor

    return EngineMonitor(llm, *args, **kw)


def _vllm_adapter(llm):
    from .vllm.checkpoint import engine_adapter

    return engine_adapter(llm)


def _vllm_verify_error(llm):
    from .vllm.checkpoint import refuse_verify

    return refuse_verify(llm)


register(Engine("vllm", is_vllm_engine, _vllm_monitor, _vllm_adapter, _vllm_verify_error))
