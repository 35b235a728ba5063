"""Hooks into other libraries' training loops: alignment measured on a probe set while a model trains.

Owns ``AlignmentCallback`` (``trainer``), a ``transformers.TrainerCallback`` that runs the monitor
over a fixed probe set at each evaluation or every n steps and logs the values through the
Trainer's own ``log``, so that ``report_to`` sends them wherever the other metrics go. It sits
beside ``run`` on the ladder and may import ``monitor``, ``spectra``, ``zoo``, ``models`` and
``linalg``. ``import eigenhooks`` does not import it (transformers' Trainer is slow to import):
``eh.integrations`` loads it on first use.
"""

from .trainer import AlignmentCallback

__all__ = ["AlignmentCallback"]
