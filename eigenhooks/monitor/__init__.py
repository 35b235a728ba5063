"""Hooks at run time: attach, capture (pre, mid, post), reduce to streaming sums, detach.

Owns ``Monitor`` and ``monitor()`` (``hooks``), the TransformerLens side of the hooks (``lens``),
the state that persists across forwards with ``state_dict`` / merge / ``all_reduce`` (``state``),
the fingerprint of what its sums mean, compared before any merge (``fingerprint``),
the sinks (.jsonl, TensorBoard, W&B, MLflow, a callable: ``sinks``) and when they are written (``logs``),
the two-stage reduction of a forward's readings to sums on the device (``reduce``), and the
statistics with their nulls: alignment, Haar and structured null frames, Monte-Carlo p-values,
BH, cluster-robust intervals, verdicts (``stats``). It may import ``spectra``, ``zoo``,
``models`` and ``linalg``. ``from eigenhooks.monitor import Monitor`` works as it did when this
was one module.
"""

from .hooks import MeasurementWarning, Monitor, check_nulls, monitor
from .sinks import SinkError
from .state import MonitorState
from .stats import TargetError

__all__ = ["MeasurementWarning", "Monitor", "MonitorState", "SinkError", "TargetError", "check_nulls", "monitor"]
