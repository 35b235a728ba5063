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


# Serving engines whose models this wing cannot hook (their forwards run in a process of their own, compiled):
# (is_engine(model) -> bool, factory(model, *args, **kw) -> a monitor), registered by a wing above the monitor
# (eigenhooks.engines), so that nothing here names an engine.
ENGINES: list = []


def register_engine(is_engine, factory) -> None:
    """Make ``eh.monitor(model, ...)`` return ``factory(model, ...)`` for a model ``is_engine`` knows."""
    if (is_engine, factory) not in ENGINES:
        ENGINES.append((is_engine, factory))


def _monitor(model, *args, **kw):
    for is_engine, factory in ENGINES:
        if is_engine(model):
            return factory(model, *args, **kw)
    return monitor(model, *args, **kw)


_monitor.__doc__, _monitor.__signature__ = monitor.__doc__, inspect.signature(monitor)

# The wing is callable: ``eh.monitor(...)`` (the package's attribute is this wing) calls ``monitor`` (or a
# registered engine's), so the name is one thing, a wing whose modules import as any
# (``import eigenhooks.monitor.<module> as m``).
sys.modules[__name__].__class__ = type("CallableWing", (types.ModuleType,), {"__call__": staticmethod(_monitor)})
__signature__ = inspect.signature(monitor)
