"""vLLM: opt-in at build (``plugin``), taps in the compiled graph (``capture``), the worker side
(``worker``, ``session``), the monitor on an engine (``monitor``) and the served sink (``serve``).

docs/vllm.md, "Monitoring a vLLM engine", walks it. Importing this package imports no vLLM.
"""
