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
from .readout import _is_int, _real_span, _rounding


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
        specs: from ``eh.spectra(model, ...)`` (one LayerSpectrum is a list of one); with
            ``heads=True`` every head and key/value group gets rows too.
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
        ValueError: directions of the wrong width, a zero or non-finite row, a complex row that is a
            plane (a complex row whose real and imaginary parts are parallel is that real direction,
            its phase dropped, as ``read_tokens`` and the monitor's targets read it), or no spectra.

    Example:
        >>> specs = eh.spectra(model, heads=True)  # doctest: +SKIP
        >>> eh.rank_directions(specs, sae.W_dec).query("above_null")  # doctest: +SKIP
    """
    import pandas as pd

    specs = _as_spectra(specs)
    if not _is_int(null_draws) or null_draws < 0:
        raise ValueError(f"null_draws must be an int >= 0 (0: no null band), got {null_draws!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int (the null's seed), got {seed!r}")
    d = specs[0].basis.shape[0]
    X = _as_rows(directions, d)
    norms = torch.linalg.vector_norm(X, dim=1)
    bad = ~torch.isfinite(X).all(1) | (norms == 0)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()
        raise ValueError(
            f"directions {rows[:10]}{' ...' if len(rows) > 10 else ''} (of {len(X)}) are zero or hold NaN or inf; "
            "pass finite, nonzero rows"
        )
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


def _as_spectra(specs) -> list[LayerSpectrum]:
    """specs as a non-empty list of LayerSpectrum (one is a list of one), or a one-line error naming what came."""
    if isinstance(specs, LayerSpectrum):
        return [specs]
    if specs is None or isinstance(specs, (str, bytes)) or not hasattr(specs, "__iter__"):
        raise ValueError(f"specs: expected eh.spectra(model, ...), a list of LayerSpectrum; got {type(specs).__name__}")
    specs = list(specs)
    if not specs:
        raise ValueError("no spectra given; pass eh.spectra(model, ...)")
    for i, s in enumerate(specs):
        if not isinstance(s, LayerSpectrum):
            raise ValueError(f"specs[{i}] is a {type(s).__name__}, not a LayerSpectrum; pass eh.spectra(model, ...)")
    return specs


def _as_rows(directions, d: int) -> torch.Tensor:
    """directions as real float64 rows (n, d); a complex row whose Re and Im are parallel is that real direction."""
    if directions is None or isinstance(directions, (str, bytes)):
        raise ValueError(f"directions: expected an (n, d={d}) array or tensor of rows, got {type(directions).__name__}")
    try:
        X = torch.as_tensor(np.asarray(directions.detach().cpu() if hasattr(directions, "detach") else directions))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"directions: expected an (n, d={d}) array of numbers, got {type(directions).__name__} ({e})"
        ) from None
    if X.dtype == torch.bool or not (X.is_floating_point() or X.is_complex() or X.dtype in _INTS):
        raise ValueError(f"directions: expected an (n, d={d}) array of numbers, got dtype {X.dtype}")
    if X.dim() == 1:
        X = X[None]
    if X.dim() != 2 or X.shape[1] != d:
        raise ValueError(f"directions must be (n, d={d}), one per row; got {tuple(X.shape)=}")
    if not X.is_complex():
        return X.to(torch.float64)
    noise, rows = _rounding(X.dtype, d), []
    for j, x in enumerate(X.to(torch.complex128)):
        if not bool(torch.isfinite(x).all()):
            rows.append(torch.full((d,), float("nan"), dtype=torch.float64))  # refused below, with the others
            continue
        r = _real_span(x, noise)
        if r.dim() == 2:
            raise ValueError(
                f"directions[{j}] is complex with independent real and imaginary parts: a plane, not a direction; "
                "pass its real and imaginary parts as two rows, or read the plane with eh.read_tokens"
            )
        rows.append(r)
    return torch.stack(rows)


_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
