"""Data shipped in the wheel: the bundled sample text that `eigenhooks run` reads by default.

Holds no code and is read with importlib.resources by run.texts; it imports nothing.
"""

__version__ = "0.1.0"  # the package's version, in one place: eigenhooks.__version__ and run folders read it
