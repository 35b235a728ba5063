"""Hooks at run time: attach, capture (pre, mid, post), reduce to streaming sums, detach.

Owns ``Monitor`` and ``monitor()`` (``facade``), a small facade over the parts a forward flows
through, one way: ``config`` (every setting and default, frozen), ``plan`` (per-layer bases and
facts, built once at entry), ``record`` (what the adapter's attachment tells of each forward, one way:
``models.attach``; the hooks themselves are the adapter's), ``forward`` (one forward's scratch), ``accumulate`` (the running sums, open
sequences, the decoding-step buffer), ``logs`` and ``sinks`` (where the numbers go), ``summary``
(the table). ``reduce`` is the two-stage reduction on the device, ``reference`` its plain float64
twin, ``measures`` what is measured (one file a measure: target projection, the Haar null, eig rank,
the F-null; ``Measure`` for a researcher's own), ``stats`` the shared statistics, ``fingerprint`` what a
state's sums mean. It may
import ``spectra``, ``zoo``, ``models`` and ``linalg``. docs/api.md, "A forward's life", walks it.
"""

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
