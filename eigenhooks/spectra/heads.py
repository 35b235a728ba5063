"""What ``spectra(heads=True)`` adds to a model's layers: the OV circuit's embedding side, and factor copies.

The heads' and groups' spectra are computed in ``linalg.heads`` from a layer's factors; what needs
the model is the full OV circuit W_U F_h W_Eᵀ, whose eigenvalues come from V_h (W_Eᵀ W_U) O_h. Here
C = W_Eᵀ W_U (d x d, float64) is formed once per call (W_U with the final norm's scale folded in,
``readout.scaled_unembedding``), and its digest keys the cached spectra.
"""

from __future__ import annotations

import logging
import threading

import torch

from ..linalg import cache as disk
from ..linalg.eig import Factors
from ..models import Adapter
from .readout import embedding, embedding_weight, scaled_unembedding

log = logging.getLogger(__name__)
_lock = threading.Lock()  # layers are read in a thread pool: C is formed once


def _missing(adapter: Adapter) -> str | None:
    """Why the model has no full OV circuit W_U F W_Eᵀ (one line), or None."""
    W_E, W_U = embedding_weight(adapter), adapter.unembedding()
    if W_E is None or W_U is None:
        return f"{adapter.family}: the model has no {'unembedding (LM head)' if W_U is None else 'token embedding'}"
    if W_E.dim() != 2 or tuple(W_E.shape) != tuple(W_U.shape) or W_E.shape[1] != adapter.d_model:
        return f"{adapter.family}: embedding {tuple(W_E.shape)} and unembedding {tuple(W_U.shape)} do not match"
    return None


def _rows(adapter: Adapter) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(W_E, W_U') float64 copies, or None (one log line) for a model with no full OV circuit."""
    why = _missing(adapter)
    if why is not None:
        log.warning("circuit copying is NaN: %s", why)
        return None
    return embedding(adapter, torch.float64), scaled_unembedding(adapter, torch.float64)


def circuit_digest(adapter: Adapter) -> str | None:
    """Hash of W_E, W_U and the final norm's scale (what ``circuit_matrix`` is made of), or None."""
    if any(p.device.type == "meta" for p in adapter.model.parameters()):
        log.warning("circuit copying is NaN: the model's weights are offloaded (its embeddings are not loaded whole)")
        return None
    if _missing(adapter) is not None:
        return None
    scale = adapter.final_norm_scale()  # (d,) float64: the weight plus the family's offset
    raw = [embedding_weight(adapter), adapter.unembedding()] + ([scale] if scale is not None else [])
    return disk.tensors_digest([t.detach() for t in raw], {"circuit": "W_E^T W_U diag(s_final)"})  # hashed in place


def circuit_matrix(adapter: Adapter) -> torch.Tensor | None:
    """C = W_Eᵀ W_U' (d, d) float64, formed once per adapter (a vocab x d product: ~2 s on SmolLM2)."""
    with _lock:
        return _circuit_matrix(adapter)


def _circuit_matrix(adapter: Adapter) -> torch.Tensor | None:
    C = getattr(adapter, "_eigenhooks_circuit", None)
    if C is None:
        rows = None if any(p.device.type == "meta" for p in adapter.model.parameters()) else _rows(adapter)
        C = torch.zeros(0) if rows is None else rows[0].T @ rows[1]  # (d, vocab) @ (vocab, d)
        adapter._eigenhooks_circuit = C  # type: ignore[attr-defined]
    return C if C.numel() else None


def copy_out(factors: Factors, heads: bool) -> Factors:
    """A float64 CPU copy that outlives the onloaded weights: the stacked Ô (d, G d_head) and
    V, one factor pair per kv group (same F), unless per-head spectra need every O_h."""
    if heads:
        return Factors(
            factors.O_heads.detach().to("cpu", torch.float64, copy=True),
            factors.V_groups.detach().to("cpu", torch.float64, copy=True),
            factors.group_of_head.clone(),
        )
    O, V = factors.stacked(torch.float64)  # (d, G*dh), (G*dh, d): fresh tensors
    G = factors.V_groups.shape[0]
    return Factors.from_stacked(O, V, G, G)
