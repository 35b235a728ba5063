"""Dynamics: one real layer iterated far past its depth, and the limit its spectrum predicts.

Owns ``iterate`` (the real block, or the paper's idealised step on its weights),
``predict_limit``, ``classify_limit`` and ``agree`` (``trajectory``), and layers with planted spectra whose
limit is known in advance (``planted``). It imports ``spectra``, ``zoo``,
``models`` and ``linalg`` (the alignment measure is ``linalg.subspace``'s), never the monitor.
"""

from . import planted
from .trajectory import LIMITS, Limit, Trajectory, agree, classify_limit, iterate, predict_limit

__all__ = ["LIMITS", "Limit", "Trajectory", "agree", "classify_limit", "iterate", "planted", "predict_limit"]
