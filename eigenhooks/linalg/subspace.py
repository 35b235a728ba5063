"""How much of a vector lies in a subspace: the alignment a(x) = ||U^T x|| / ||x||.

The one measure every wing above shares: the monitor's statistics (``monitor.stats``) and the
shared-weight iteration (``dynamics``) both read tokens against a layer's principal subspace
with it. Pure torch.
"""

from __future__ import annotations

import torch


def alignment(X: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """a(x) = ||U^T x|| / ||x|| for each row of X (..., d) with U (d, k) orthonormal; (...,).

    Example:
        >>> U = torch.eye(3)[:, :1]  # the first axis
        >>> alignment(torch.tensor([[3.0, 4.0, 0.0]]), U)
        tensor([0.6000])
    """
    return torch.linalg.vector_norm(X @ U, dim=-1) / torch.linalg.vector_norm(X, dim=-1).clamp_min(1e-30)
