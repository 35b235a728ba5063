"""The verdict's null family: random directions drawn from the residual stream's own covariance at the layer.

A direction the stream already favours is what "v_1 is special" must beat: residual streams are anisotropic, so an
isotropic (Haar) direction is no comparison (docs/concepts.md, "The verdict"). A draw is u = Σ^{1/2} g / ||Σ^{1/2} g||,
g ~ N(0, I_d), Σ the uncentred covariance of x̂, the unit baseline reading (pre, or LN_t(pre) on a post-norm layer),
so the mean direction counts as a direction the stream favours. A k-dimensional draw is k such columns,
orthonormalised.

Σ is estimated on the estimation half's sequences, and a target drawn by the same rule from other text must be
exchangeable with the draws. It is not, if every draw shares one estimate: the target's Σ carries its own text's
sampling error, the draws' do not, and the test is liberal where the estimate is noisy (on SmolLM2, a k = 2 layer
called 6.2% of such targets at p < 0.05 from 12,800 estimation tokens; benchmarks/verdict_null.py). So each draw
takes its own Σ from a bootstrap resample of the estimation half's sequences: Σ_j = Xᵀ diag(w_j) X / n, w_j each
token's sequence's multiplicity, and u = Xᵀ (√w_j ⊙ z) with z ~ N(0, I_n) is a draw from N(0, Σ_j) (no d x d
matrix is formed).

One file, one registration (``NULLS`` in ``verdict/__init__.py``): a null family is this module's ``fit`` (what it
keeps of the estimation half) and ``draws`` (K frames of k columns from it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Fitted(NamedTuple):
    """The estimation half: X (n, d) float64 unit readings, seq (n,) each token's sequence in 0..n_seq-1."""

    X: torch.Tensor
    seq: torch.Tensor
    n_seq: int


def fit(X: torch.Tensor, seq: torch.Tensor, n_seq: int) -> Fitted:
    """What the draws need of the estimation half: its readings and their sequences."""
    return Fitted(X, seq, n_seq)


def draws(fitted: Fitted, K: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """K orthonormal (d, k) frames, each from its own bootstrap resample of the estimation half's sequences.

    Args:
        fitted: ``fit``'s result. K: draws. k: their dimension. gen: the seeded generator (CPU).

    Returns:
        (K, d, k) float32: a direction needs no more (its scores are float32 projections, ``per_sequence``), and
        the draws are most of the verdict's time.
    """
    X, seq, S = fitted
    pick = torch.randint(S, (K, S), generator=gen)  # each draw's resample of the sequences
    mult = torch.zeros(K, S).scatter_add_(1, pick, torch.ones(K, S))
    w = mult[:, seq].sqrt().T  # (n, K): √(each token's sequence's multiplicity)
    z = torch.randn(X.shape[0], K, k, generator=gen) * w[:, :, None]
    out = (X.float().T @ z.reshape(X.shape[0], K * k)).reshape(X.shape[1], K, k).permute(1, 0, 2)  # (K, d, k)
    return orthonormal(out)


def orthonormal(A: torch.Tensor) -> torch.Tensor:
    """(K, d, k) frames with orthonormal columns, by Gram-Schmidt over the k columns (k is 1 or 2 here: a batched
    QR of K thin matrices is far slower)."""
    cols = []
    for j in range(A.shape[2]):
        c = A[:, :, j]
        for q in cols:
            c = c - (q * c).sum(1, keepdim=True) * q
        cols.append(c / c.norm(dim=1, keepdim=True))
    return torch.stack(cols, 2)
