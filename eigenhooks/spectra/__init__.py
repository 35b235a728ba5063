"""Spectra of a whole model: ``spectra()`` and ``verify()``, adapters in, cached spectra out.

Owns the model-level entry points (``compute``): reading each layer's factors through its adapter
(offloaded weights one layer at a time), the per-process memo keyed by the weights' content, the
disk cache, and ``verify`` (F from the weights against F from the model's own forward, the
identical-token probe). It may import ``zoo``, ``models`` and ``linalg``.
"""

from .compute import Verification, clear_memo, layer_factors, layer_stacked, spectra, verify, weights_digest

__all__ = ["Verification", "clear_memo", "layer_factors", "layer_stacked", "spectra", "verify", "weights_digest"]
