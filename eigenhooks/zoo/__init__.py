"""Where models come from: zoo names, GGUF files, local folders and hub ids.

Owns ``load_model`` (``loading``: the one dispatcher among all sources), GGUF conversion
(``gguf``; the header check that makes a bad file one line, ``gguf_file``), the model cache that
keeps converted models and verifies them on every load (``store``, ``digest``: SHA-256 of model
files, remembered by stat stamp), the tiny models shipped in the wheel and the registry of names
(``registry``: ``load``, ``path``, ``card``), and real models fetched on request, pinned and
checksummed (``real``). It may import ``models`` and ``linalg``, never a wing above it.
"""

from . import real
from .errors import ModelLoadError
from .gguf import load_gguf
from .gguf_file import check_gguf
from .loading import UNTRAINED_HEAD, LoadWarning, load_model, to_bridge
from .real import REAL, FetchError, fetch, is_fetched
from .registry import DEFAULT, NAMES, TINY, ZOO_DIR, card, load, path
from .store import ModelCacheWarning

__all__ = [
    "DEFAULT",
    "NAMES",
    "REAL",
    "TINY",
    "UNTRAINED_HEAD",
    "ZOO_DIR",
    "FetchError",
    "LoadWarning",
    "ModelCacheWarning",
    "ModelLoadError",
    "card",
    "check_gguf",
    "fetch",
    "is_fetched",
    "load",
    "load_gguf",
    "load_model",
    "path",
    "real",
    "to_bridge",
]
