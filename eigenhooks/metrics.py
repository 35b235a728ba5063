"""Alignment statistics: per-token measures and streaming, mergeable per-layer sums.

Pure torch (plus scipy for the binomial test). Definitions (DESIGN.md §1):
a(x) = ||U^T x|| / ||x||; delta = a(mid) - a(pre); rho = P(delta > 0) with a two-sided
binomial test of rho = 0.5; a null baseline from a random subspace of the same k;
consensus = mean pairwise cosine within a sequence, (||sum x̂||^2 - n) / (n (n - 1)).
Every statistic is a sum or a count, so batches, processes and runs merge exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

POINTS = ("pre", "mid", "post")


def alignment(X: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """a(x) = ||U^T x|| / ||x|| for each row of X (..., d) with U (d, k) orthonormal; (...,)."""
    return torch.linalg.vector_norm(X @ U, dim=-1) / torch.linalg.vector_norm(X, dim=-1).clamp_min(1e-30)


def signed_cosine(X: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """<x, v> / ||x|| for each row of X (..., d), v (d,) unit; (...,)."""
    return (X @ v) / torch.linalg.vector_norm(X, dim=-1).clamp_min(1e-30)


def consensus(X: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean pairwise cosine per sequence, without an n x n matrix.

    Args:
        X: (b, n, d) tokens. mask: (b, n) bool, the valid tokens.

    Returns:
        (values (b,), defined (b,) bool): defined where a sequence has >= 2 valid tokens.
    """
    Xh = X / torch.linalg.vector_norm(X, dim=-1, keepdim=True).clamp_min(1e-30)
    s = (Xh * mask[..., None]).sum(1)  # (b, d)
    n = mask.sum(1).to(X.dtype)
    defined = n >= 2
    val = (s.pow(2).sum(-1) - n) / (n * (n - 1)).clamp_min(1)
    return torch.where(defined, val, torch.zeros_like(val)), defined


def null_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """A random orthonormal (d, k) basis, fixed by the seed (the null baseline's subspace)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return Q


@dataclass
class LayerStats:
    """Streaming sums for one (layer, target). Add two to merge; state_dict to persist."""

    n: int = 0  # valid, finite tokens
    n_nonfinite: int = 0  # valid tokens skipped for non-finite activations
    sum_pre: float = 0.0
    sum_mid: float = 0.0
    sum_post: float = 0.0
    sum_delta: float = 0.0
    n_up: int = 0  # delta > 0
    null_sum_pre: float = 0.0
    null_sum_mid: float = 0.0
    null_sum_post: float = 0.0
    null_n_up: int = 0
    cos_sum_pre: float = 0.0  # signed cosine with v_1 (k = 1 only)
    cos_sum_mid: float = 0.0
    cos_sum_post: float = 0.0
    cons_sum_pre: float = 0.0
    cons_sum_mid: float = 0.0
    cons_sum_post: float = 0.0
    n_seq: int = 0  # sequences with >= 2 valid tokens in one forward

    def __add__(self, other: LayerStats) -> LayerStats:
        return LayerStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - {f.name for f in fields(self)}
        if unknown:
            raise KeyError(f"unknown LayerStats keys: {sorted(unknown)}")
        for k, v in state.items():
            setattr(self, k, v)

    def update(self, pre, mid, post, U, U_null, v1, mask) -> None:
        """Add one forward's tokens.

        Args:
            pre, mid, post: (b, n, d) float32 residuals (mid/post may be None).
            U, U_null: (d, k) principal and null bases. v1: (d,) or None (k = 2).
            mask: (b, n) bool, valid (non-padding) tokens.
        """
        finite = torch.isfinite(pre).all(-1)
        for X in (mid, post):
            if X is not None:
                finite &= torch.isfinite(X).all(-1)
        self.n_nonfinite += int((mask & ~finite).sum())
        m = mask & finite
        self.n += int(m.sum())
        sel = lambda t: t[m]  # (tokens,)
        a = {"pre": alignment(pre, U)}
        a0 = {"pre": alignment(pre, U_null)}
        for name, X in (("mid", mid), ("post", post)):
            if X is not None:
                a[name], a0[name] = alignment(X, U), alignment(X, U_null)
        for name in a:
            setattr(self, f"sum_{name}", getattr(self, f"sum_{name}") + float(sel(a[name]).sum()))
            setattr(self, f"null_sum_{name}", getattr(self, f"null_sum_{name}") + float(sel(a0[name]).sum()))
        if "mid" in a:
            delta = sel(a["mid"] - a["pre"])
            self.sum_delta += float(delta.sum())
            self.n_up += int((delta > 0).sum())
            self.null_n_up += int((sel(a0["mid"] - a0["pre"]) > 0).sum())
        if v1 is not None:
            for name, X in (("pre", pre), ("mid", mid), ("post", post)):
                if X is not None:
                    c = signed_cosine(X, v1)
                    setattr(self, f"cos_sum_{name}", getattr(self, f"cos_sum_{name}") + float(sel(c).sum()))
        counted = None
        for name, X in (("pre", pre), ("mid", mid), ("post", post)):
            if X is not None:
                val, defined = consensus(torch.where(m[..., None], X, torch.zeros_like(X)), m)
                setattr(self, f"cons_sum_{name}", getattr(self, f"cons_sum_{name}") + float(val[defined].sum()))
                counted = int(defined.sum())
        self.n_seq += counted or 0

    def summary(self, k: int) -> dict:
        """Means, rho and its two-sided binomial p-value, the null baseline and counts."""
        from scipy.stats import binomtest

        n = self.n
        mean = lambda s: s / n if n else float("nan")
        out = {
            "n_tokens": n,
            "n_nonfinite": self.n_nonfinite,
            "gamma_pre": mean(self.sum_pre),
            "gamma_mid": mean(self.sum_mid),
            "gamma_post": mean(self.sum_post),
            "delta_mean": mean(self.sum_delta),
            "rho": mean(self.n_up),
            "p_value": binomtest(self.n_up, n, 0.5).pvalue if n else float("nan"),
            "null_gamma_pre": mean(self.null_sum_pre),
            "null_gamma_mid": mean(self.null_sum_mid),
            "null_gamma_post": mean(self.null_sum_post),
            "null_rho": mean(self.null_n_up),
            "null_p_value": binomtest(self.null_n_up, n, 0.5).pvalue if n else float("nan"),
        }
        for p in POINTS:
            out[f"cos_{p}"] = mean(getattr(self, f"cos_sum_{p}")) if k == 1 else float("nan")
        for p in POINTS:
            out[f"consensus_{p}"] = getattr(self, f"cons_sum_{p}") / self.n_seq if self.n_seq else float("nan")
        out["n_sequences"] = self.n_seq
        return out
