"""Serving engines: the glue that puts the monitor inside an engine that runs the model itself.

Owns ``requests`` (an engine's flat batches as sequences: each token's request and position, each
(request, position) counted once, requests ended by the engine's scheduler) and ``vllm`` (the opt-in
plugin, the taps placed before vLLM compiles, the worker extension, the monitor on an engine, the served
sink). It sits above ``monitor`` on the ladder and may import ``monitor``, ``spectra``, ``models`` and
below. Nothing here imports an engine until an engine calls it: ``import eigenhooks`` never imports vLLM.
"""

from .dispatch import register

register()
