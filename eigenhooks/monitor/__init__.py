"""Hooks at run time: attach, capture (pre, mid, post), reduce to streaming sums, detach.

Owns ``Monitor`` and ``monitor()`` (``facade``), a small facade over the parts a forward flows
through, one way: ``config`` (every setting and default, frozen), ``plan`` (per-layer bases and
facts, built once at entry), ``record`` (what the adapter's attachment tells of each forward, one way:
``models.attach``; the hooks themselves are the adapter's), ``forward`` (one forward's scratch), ``accumulate`` (the running sums, open
sequences, the decoding-step buffer), ``logs`` and ``sinks`` (where the numbers go), ``summary``
(the table). ``reduce`` is the two-stage reduction on the device, ``reference`` its plain float64
twin, ``measures`` what is measured (one file a measure: target projection, the Haar null, eig rank,
the F-null; ``Measure`` for a researcher's own, on plain per-layer tensors, ``measures.own``), ``stats``
the shared statistics, ``fingerprint`` what a state's sums mean. The wing is callable: ``eh.monitor(...)``
calls ``monitor()``. It may import ``spectra``, ``zoo``, ``models`` and ``linalg``. docs/api.md, "A
forward's life", walks it.
"""

import inspect
import sys
import types

from ..models.attach import MeasurementWarning
from ..models.engines import engine_of
from .config import DEFAULTS, MonitorConfig, check_nulls
from .facade import Monitor, monitor
from .measures import Measure
from .sinks import SinkError
from .stats import TargetError

__all__ = [
    "DEFAULTS",
    "MeasurementWarning",
    "Measure",
    "Monitor",
    "MonitorConfig",
    "SinkError",
    "TargetError",
    "check_nulls",
    "monitor",
]


def _monitor(model, *args, **kw):
    engine = engine_of(model)  # a serving engine registered in models.engines: its own monitor
    if engine is not None:
        return engine.monitor(model, *args, **kw)
    return monitor(model, *args, **kw)


_monitor.__doc__, _monitor.__signature__ = monitor.__doc__, inspect.signature(monitor)

# The wing is callable: ``eh.monitor(...)`` (the package's attribute is this wing) calls ``monitor`` (or a
# registered engine's, ``models.engines``), so the name is one thing, a wing whose modules import as any
# (``import eigenhooks.monitor.<module> as m``).
sys.modules[__name__].__class__ = type("CallableWing", (types.ModuleType,), {"__call__": staticmethod(_monitor)})
__signature__ = inspect.signature(monitor)
