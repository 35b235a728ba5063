"""Spectra of a whole model: ``spectra()`` and ``verify()``, adapters in, cached spectra out.

Owns the model-level entry points (``compute``): reading each layer's factors through its adapter
(offloaded weights one layer at a time), the per-process memo keyed by the weights' content, the
disk cache, and ``verify`` (F from the weights against F from the model's own forward, the
identical-token probe, ``verify``), what the heads' full OV circuits need from the model (``heads``),
token readouts of a direction with their null (``readout``), and a user's own directions
ranked against the principal subspaces (``directions``). It may import ``zoo``, ``models`` and ``linalg``.
"""

import inspect
import sys
import types

from .compute import clear_memo, layer_factors, layer_stacked, spectra, weights_digest
from .directions import rank_directions
from .pool import parallel_map
from .readout import TokenReadout, read_tokens
from .verify import Verification, verify

__all__ = [
    "TokenReadout",
    "Verification",
    "clear_memo",
    "layer_factors",
    "layer_stacked",
    "parallel_map",
    "rank_directions",
    "read_tokens",
    "spectra",
    "verify",
    "weights_digest",
]


# The wing is callable: ``eh.spectra(...)`` (the package's attribute is this wing) calls ``spectra``, so the
# name is one thing, a wing whose modules import as any (``import eigenhooks.spectra.<module> as m``).
sys.modules[__name__].__class__ = type("CallableWing", (types.ModuleType,), {"__call__": staticmethod(spectra)})
__signature__ = inspect.signature(spectra)
