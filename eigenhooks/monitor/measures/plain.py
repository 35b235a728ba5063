"""The plain float64 helpers the measures' reference sums share (``monitor/reference.py``)."""

from __future__ import annotations

import torch

from ..stats import GROWTH_EPS


def align(X: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """a(x) = ||U^T x|| / ||x|| for each row of X (n, d), U (d, k); (n,), float64."""
    return torch.linalg.vector_norm(X @ U, dim=-1) / torch.linalg.vector_norm(X, dim=-1)


def align_frames(X: torch.Tensor, frames: torch.Tensor, k: int) -> torch.Tensor:
    """a(x) against each frame's first k columns: X (n, d), frames (K, d, k_max); (n, K)."""
    P = torch.einsum("nd,jdk->njk", X, frames[:, :, :k])
    return torch.linalg.vector_norm(P, dim=-1) / torch.linalg.vector_norm(X, dim=-1)[:, None]


def up(a_to: torch.Tensor, a_from: torch.Tensor) -> torch.Tensor:
    """Which tokens grew: a_to - a_from > GROWTH_EPS."""
    return (a_to - a_from) > GROWTH_EPS
