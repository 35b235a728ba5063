"""Steering: a rank-1 change of a layer's output matrix that makes a chosen direction principal.

Owns ``steer`` / ``Steer`` (``edit``: the reversible weight edit or hook, exact and signed by
default, the paper's construction on request), the rank-1 algebra (``rank1``), and where
directions come from: a vector, a token's unembedding, the mean difference of two prompt sets
(``direction``). It may import ``spectra``, ``zoo``, ``models`` and ``linalg``.
"""

import inspect
import sys
import types

from . import direction, rank1
from .edit import Steer, SteerReport, check_strength, steer

__all__ = ["Steer", "SteerReport", "check_strength", "direction", "rank1", "steer"]


# The wing is callable: ``eh.steer(...)`` (the package's attribute is this wing) calls ``steer``, so the
# name is one thing, a wing whose modules import as any (``import eigenhooks.steer.<module> as m``).
sys.modules[__name__].__class__ = type("CallableWing", (types.ModuleType,), {"__call__": staticmethod(steer)})
__signature__ = inspect.signature(steer)
