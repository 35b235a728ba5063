"""Data shipped in the wheel: the bundled sample text that `eigenhooks run` reads by default.

Holds no code and is read with importlib.resources by run.texts; it imports nothing.
"""
