"""Your own directions against the spectrum: ``rank_directions``.

An SAE's decoder rows, a probe's weights, steering vectors: each is a direction x in the residual
stream, and the question is which layers' (and heads') principal subspaces it lies in. The
alignment ‖Uᵀx̂‖ of a fixed k-dimensional U with a Haar-random unit x̂ in R^d has a known spread
(‖Uᵀx̂‖² ~ Beta(k/2, (d-k)/2)); the band printed beside each number is that null, by Monte Carlo.
"""

from __future__ import annotations

import numpy as np
import torch

from ..linalg import LayerSpectrum


def null_alignment_band(d: int, k: int, draws: int, seed: int) -> tuple[float, float]:
    """2.5% and 97.5% quantiles of ‖Uᵀx̂‖ for a fixed (d, k) orthonormal U and Haar-random unit x̂.

    By rotation invariance U may be the first k coordinates: ‖x̂[:k]‖ over ``draws`` Gaussian draws.
    """
    if draws < 1 or k < 1:
        return float("nan"), float("nan")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(draws, d, generator=g, dtype=torch.float64)
    a = torch.linalg.vector_norm(x[:, :k], dim=1) / torch.linalg.vector_norm(x, dim=1)
    return float(torch.quantile(a, 0.025)), float(torch.quantile(a, 0.975))


def _subspaces(spec: LayerSpectrum):
    """(part, index, basis) for the layer and, given head spectra, each head and group."""
    yield "layer", -1, spec.basis
    for h in spec.heads or []:
        yield "head", h.head, h.basis
    for g in spec.groups or []:
        yield "group", g.group, g.basis


def rank_directions(specs: list[LayerSpectrum], directions, null_draws: int = 2000, seed: int = 0):
    """How well each of your directions lies in each layer's (and head's) principal subspace.

    Args:
        specs: from ``eh.spectra(model, ...)``; with ``heads=True`` every head and key/value group
            gets rows too.
        directions: (n, d) real, one direction per row (an SAE's decoder rows, probe weights); a
            (d,) vector is one direction. Rows need not be unit; a zero row is an error.
        null_draws: Haar-random unit directions for each null band.
        seed: the null's seed.

    Returns:
        A pandas DataFrame, one row per (layer, part, direction): ``layer``, ``part`` ('layer',
        'head' or 'group'), ``index`` (the head or group, -1 for the layer), ``direction`` (its row),
        ``k``, ``alignment`` ‖Uᵀx̂‖ in [0, 1], ``rank`` (1 = the most aligned of the n directions for
        that subspace), ``null_lo`` / ``null_hi`` (the 95% band of a random direction's alignment
        with a k-dimensional subspace of R^d) and ``above_null`` (alignment > null_hi).

    Raises:
        ValueError: directions of the wrong width, a zero or non-finite row, or no spectra.

    Example:
        >>> specs = eh.spectra(model, heads=True)  # doctest: +SKIP
        >>> eh.rank_directions(specs, sae.W_dec).query("above_null")  # doctest: +SKIP
    """
    import pandas as pd

    if not specs:
        raise ValueError("no spectra given; pass eh.spectra(model, ...)")
    X = torch.as_tensor(np.asarray(directions.detach().cpu() if hasattr(directions, "detach") else directions))
    X = X.to(torch.float64)
    if X.dim() == 1:
        X = X[None]
    d = specs[0].basis.shape[0]
    if X.dim() != 2 or X.shape[1] != d:
        raise ValueError(f"directions must be (n, d={d}), one per row; got {tuple(X.shape)=}")
    norms = torch.linalg.vector_norm(X, dim=1)
    if not torch.isfinite(X).all() or bool((norms == 0).any()):
        raise ValueError(f"directions {torch.nonzero(~(norms > 0)).flatten().tolist()} are zero or non-finite")
    Xn = X / norms[:, None]  # (n, d)
    bands: dict[int, tuple[float, float]] = {}
    rows = []
    for spec in specs:
        for part, index, U in _subspaces(spec):
            k = U.shape[1]
            if k not in bands:
                bands[k] = null_alignment_band(d, k, null_draws, seed)
            a = torch.linalg.vector_norm(Xn @ U.to(torch.float64), dim=1) if k else torch.zeros(len(Xn))
            rank = torch.empty(len(a), dtype=torch.long)
            rank[torch.argsort(a, descending=True, stable=True)] = torch.arange(1, len(a) + 1)
            lo, hi = bands[k]
            for j in range(len(a)):
                aj = float(a[j])
                rows.append((spec.layer, part, index, j, k, aj, int(rank[j]), lo, hi, aj > hi))
    cols = ["layer", "part", "index", "direction", "k", "alignment", "rank", "null_lo", "null_hi", "above_null"]
    return pd.DataFrame(rows, columns=cols)
