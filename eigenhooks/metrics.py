"""Alignment statistics: per-token measures and streaming, mergeable per-layer sums.

Pure torch (plus scipy for the binomial test). Definitions (DESIGN.md §1):
a(x) = ||U^T x|| / ||x||; delta = a(mid) - a(pre); rho = P(delta > 0) (above float32
rounding, GROWTH_EPS) with a two-sided
binomial test of rho = 0.5; a null baseline from a random subspace of the same k;
consensus = mean pairwise cosine within a sequence, (||sum x̂||^2 - n) / (n (n - 1)).
Every statistic is a sum or a count, so batches, processes and runs merge exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

POINTS = ("pre", "mid", "post")
# A token "grows" when delta exceeds this: alignments are computed in float32, so smaller
# differences are rounding (an ablated attention step would otherwise show spurious growth).
GROWTH_EPS = 1e-6


def alignment(X: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """a(x) = ||U^T x|| / ||x|| for each row of X (..., d) with U (d, k) orthonormal; (...,)."""
    return torch.linalg.vector_norm(X @ U, dim=-1) / torch.linalg.vector_norm(X, dim=-1).clamp_min(1e-30)


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

    @classmethod
    def from_vector(cls, v) -> LayerStats:
        """Build from a row of ``LayerReducer`` sums (order of FIELDS); counts become ints."""
        vals = [float(x) for x in v]
        return cls(**{f: (round(x) if f in _COUNTS else x) for f, x in zip(FIELDS, vals)})

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


FIELDS = tuple(f.name for f in fields(LayerStats))
_COUNTS = {"n", "n_nonfinite", "n_up", "null_n_up", "n_seq"}
_F = {name: i for i, name in enumerate(FIELDS)}


class LayerReducer:
    """Reduces one layer's (pre, mid, post) to per-target sums in a few batched ops.

    All targets of a layer share one projection X @ B, with B = [U_1, N_1, U_2, N_2, ..., v1s]
    (principal and null bases side by side), and one consensus computation. Sums stay on
    the activations' device (no host sync per forward).

    Args:
        bases: per target (U (d, k), U_null (d, k), v1 (d,) or None), float64.
    """

    def __init__(self, bases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]):
        cols, seg, v1_cols, v1_rows = [], [], [], []
        for t, (U, N, _) in enumerate(bases):
            for j, M in enumerate((U, N)):
                seg += [2 * t + j] * M.shape[1]
                cols.append(M)
        n_seg = 2 * len(bases)
        for t, (_, _, v1) in enumerate(bases):
            if v1 is not None:
                v1_cols.append(len(seg) + len(v1_cols))
                v1_rows.append(t)
                cols.append(v1[:, None])
        self.B64 = torch.cat(cols, 1)  # (d, K)
        S = torch.zeros(len(seg), n_seg, dtype=torch.float64)
        S[torch.arange(len(seg)), torch.tensor(seg)] = 1.0
        self.S64 = S  # (K_sub, n_seg) sums squared projections per subspace
        self.n_sub = len(seg)
        self.v1_cols = torch.tensor(v1_cols, dtype=torch.long)
        self.v1_rows = torch.tensor(v1_rows, dtype=torch.long)
        self.T = len(bases)
        self._dev: dict = {}

    def _on(self, device):
        key = str(device)
        if key not in self._dev:
            self._dev[key] = (
                self.B64.to(device, torch.float32),
                self.S64.to(device, torch.float32),
                self.v1_cols.to(device),
                self.v1_rows.to(device),
            )
        return self._dev[key]

    def __call__(self, points: dict[str, torch.Tensor | None], mask: torch.Tensor) -> torch.Tensor:
        """Sums for every target: (T, len(FIELDS)) float64 on the activations' device.

        Args:
            points: {'pre': (b, n, d), 'mid': ... or None, 'post': ... or None}, float32.
            mask: (b, n) bool, the valid (non-padding) tokens.
        """
        names = [p for p in POINTS if points.get(p) is not None]
        pre = points["pre"]
        B, S, v1_cols, v1_rows = self._on(pre.device)
        raw_norm = {p: torch.linalg.vector_norm(points[p], dim=-1) for p in names}  # (b, n) each
        finite = torch.ones_like(mask)
        for nrm in raw_norm.values():
            finite &= torch.isfinite(nrm)  # a norm is non-finite iff some entry is
        m = mask & finite
        # Zero the non-finite tokens so they cannot leak into sums (NaN * 0 = NaN). On the CPU
        # a check is free and skips the copy; on an accelerator it would force a sync.
        clean = pre.device.type == "cpu" and bool(finite.all())
        n = m.sum(1).to(pre.dtype)  # (b,) valid tokens per sequence
        defined = n >= 2
        A, cos, cons = [], [], []
        for p in names:  # one point at a time: no stacked copy of the activations
            X = points[p] if clean else torch.nan_to_num(points[p], nan=0.0, posinf=0.0, neginf=0.0)
            norm = raw_norm[p].nan_to_num(0.0, 0.0, 0.0).clamp_min(1e-30)[..., None]  # (b, n, 1)
            P = X @ B  # (b, n, K)
            sub = P[..., : self.n_sub]
            A.append(torch.where(m[..., None], torch.sqrt((sub * sub) @ S) / norm, 0))  # (b, n, 2T)
            if len(v1_cols):
                cos.append(torch.where(m[..., None], P[..., v1_cols] / norm, 0).sum((0, 1)))
            # consensus per sequence: (||sum x̂||^2 - n) / (n (n - 1)); target-independent
            s = torch.einsum("bn,bnd->bd", torch.where(m, 1.0 / norm[..., 0], 0), X)  # sum of unit vectors
            cons.append(torch.where(defined, (s.pow(2).sum(-1) - n) / (n * (n - 1)).clamp_min(1), 0).sum())
        A = torch.stack(A)  # (p, b, n, 2T): small
        sums = A.sum((1, 2)).double()  # (p, 2T)
        cons = torch.stack(cons).double()  # (p,)
        cos = torch.stack(cos).double() if cos else None  # (p, n_v1)

        T = self.T
        cols = {
            "n": m.sum().double().expand(T),
            "n_nonfinite": (mask & ~finite).sum().double().expand(T),
            "n_seq": defined.sum().double().expand(T),
        }
        for i, p in enumerate(names):
            cols[f"sum_{p}"] = sums[i, 0::2]
            cols[f"null_sum_{p}"] = sums[i, 1::2]
            cols[f"cons_sum_{p}"] = cons[i].expand(T)
        if cos is not None:
            for i, p in enumerate(names):
                col = torch.zeros(T, dtype=torch.float64, device=pre.device)
                cols[f"cos_sum_{p}"] = col.index_copy(0, v1_rows, cos[i])
        if "mid" in names:
            d = A[names.index("mid")] - A[0]  # (b, n, 2T); zero at invalid tokens
            up = (d > GROWTH_EPS).sum((0, 1)).double()
            cols["sum_delta"] = d[..., 0::2].sum((0, 1)).double()
            cols["n_up"], cols["null_n_up"] = up[0::2], up[1::2]
        zero = torch.zeros(T, dtype=torch.float64, device=pre.device)
        return torch.stack([cols.get(f, zero) for f in FIELDS], 1)
