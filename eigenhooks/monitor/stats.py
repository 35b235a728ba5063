"""Alignment statistics: per-token measures, streaming mergeable sums, and their nulls.

Pure torch (plus numpy/scipy for the final summary). Definitions (docs/design.md, "Mathematics"):
a(x) = ||U^T x|| / ||x||; delta = a(mid) - a(base), base = pre (pre-norm) or LN_t(pre)
(post-norm: equal normalisation); rho = P(delta > GROWTH_EPS).

A number means something only next to its null, so every (layer, target) carries:
- K Haar-random subspaces of the same k (nested: the first k columns of one random
  orthonormal (d, k_max) frame, so draws are shared between k = 1 and k = 2; ``measures.haar``);
- F's own top-m eigen-subspaces (``eig_rank``) and directions orth(F g), one power step
  from a Gaussian start (``measures.fnull``): "v_1 is special" must beat these too;
- per-sequence counts for cluster-robust intervals (the sequence is the cluster; under a
  KV cache it spans forwards, so the monitor keeps per-row counters open until it ends).

Everything is a sum or a count, kept as float64 tensors: batches, processes and machines
merge by addition (``merge_states``), and ``torch.distributed.all_reduce`` sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..linalg.subspace import alignment  # noqa: F401  (a(x), shared with dynamics: stats.alignment)

# A token "grows" when delta exceeds this: alignments are computed in float32, so smaller
# differences are rounding (an ablated attention step would otherwise show spurious growth).
GROWTH_EPS = 1e-6
Z95 = 1.959963984540054
# Below this many null tokens the Haar null's 95% band is wider than 0.5 on the zoo's gpt2-tiny (the median
# row; benchmarks/null_band_width.py, docs/concepts.md "Too few tokens"): p_null is NaN and the verdict says so.
MIN_NULL_TOKENS = 64
TOO_FEW = "too few tokens"
NO_MID = "no mid reading"  # rho compares a(mid) with a(pre): with no 'mid' reading point there is nothing to test
SAME_SUBSPACE_TOL = 1e-12  # equal subspaces: same k, every principal cosine >= 1 - this


class TargetError(ValueError):
    """A custom target has the wrong shape or is not orthonormal; the message says which."""


def draw_seed(null_seed: int, layer: int, which: int) -> int:
    """The seed of one layer's null draws of one kind (0: Haar, 1 + j: the j-th F-null variant, 1000: p_null's
    ties): the monitor's (``plan.seed``) and the plain reference's one definition."""
    return (null_seed * 1_000_003 + layer * 101 + which) % (2**63)


def eig_subspaces(eigenvalues: torch.Tensor, eigenvectors: torch.Tensor, m: int) -> list[torch.Tensor]:
    """Orthonormal bases of F's top-m eigen-subspaces, in ranking order.

    A real eigenvalue gives span(v) (k = 1); a complex pair gives span(Re v, Im v) (k = 2).

    Args:
        eigenvalues: (d,) complex, ranked. eigenvectors: (d, top) complex, the same order.
    """
    out: list[torch.Tensor] = []
    i, top = 0, eigenvectors.shape[1]
    while i < top and len(out) < m:
        lam, v = complex(eigenvalues[i]), eigenvectors[:, i]
        if abs(lam.imag) > 1e-9 * max(abs(lam), 1e-300):
            Q, _ = torch.linalg.qr(torch.stack([v.real, v.imag], 1).double())
            out.append(Q)
            i += 2 if i + 1 < top and abs(complex(eigenvalues[i + 1]) - lam.conjugate()) < 1e-9 * abs(lam) else 1
        else:
            out.append((v.real / v.real.norm()).double()[:, None])
            i += 1
    return out


def rounding(dtype: torch.dtype, d: int) -> float:
    """How far rounding to ``dtype`` moves a d-dimensional orthonormal basis (max |U^T U - I|).

    Rounding each entry moves each entry of U^T U by about eps at most, whatever d (float16 and
    bfloat16 unit vectors measure <= 1.01 eps for d = 16..16384, normalised in float64 or in their
    own dtype, whose sums torch accumulates in float32); a normalisation accumulated in the dtype
    itself adds ~sqrt(d) eps (float32: 5 eps at d = 16384). So 4 eps + sqrt(d)/16 eps; 0 for
    integer dtypes (exact).
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point or dtype.is_complex else 0.0
    return eps * (4 + math.sqrt(d) / 16)


def target_tolerance(dtype: torch.dtype, d: int) -> float:
    """How far from orthonormal a target given in ``dtype`` may be: its ``rounding``, and never less
    than 1e-4, the tolerance float32 and float64 targets have always had."""
    return max(1e-4, rounding(dtype, d))


def check_target(name: str, U, d: int) -> torch.Tensor:
    """Validate a custom target and return the orthonormal (d, k) float64 basis of the subspace it spans.

    A real target is a unit vector (d,) or an orthonormal basis (d, k), in any float dtype; it
    must be orthonormal within ``target_tolerance`` of its dtype, and is then replaced by the
    nearest exactly orthonormal basis (the polar factor, u / |u| for a vector), so the monitor
    measures the subspace it spans. A complex target (``LayerSpectrum.v_1`` of a complex pair)
    must be unit (orthonormal columns, U^H U = I) and stands for the real subspace
    span(Re U, Im U), as the monitor's own complex targets do (``eig_subspaces``): k = 2 for a
    complex v, k = 1 for a real vector stored as complex or turned by a phase e^{i theta}
    (then with the sign of its larger part, real or imaginary).

    Raises:
        TargetError: not a tensor, wrong shape, non-finite values, or not orthonormal.
    """
    try:
        given = torch.as_tensor(U).detach().to("cpu")
    except (TypeError, ValueError, RuntimeError) as e:
        raise TargetError(
            f"target {name!r}: expected a unit vector ({d},) or an orthonormal basis ({d}, k) as a tensor, "
            f"got {type(U).__name__} ({e})"
        ) from None
    X = given.to(torch.complex128 if given.is_complex() else torch.float64)
    if X.dim() == 1:
        X = X[:, None]
    if X.dim() != 2 or X.shape[0] != d or not 1 <= X.shape[1] <= d:
        raise TargetError(
            f"target {name!r}: expected a unit vector ({d},) or an orthonormal basis ({d}, k), got shape {tuple(X.shape)}"
        )
    if not torch.isfinite(X).all():
        raise TargetError(f"target {name!r} has non-finite entries")
    tol = target_tolerance(given.dtype, d)
    err = float((X.mH @ X - torch.eye(X.shape[1], dtype=X.dtype)).abs().max())
    if err > tol:
        hint = "divide it by its norm" if X.shape[1] == 1 else "orthonormalise it, e.g. torch.linalg.qr(U).Q"
        raise TargetError(
            f"target {name!r} is not orthonormal (max |U^H U - I| = {err:.2g}, tolerance {tol:.2g} for "
            f"{str(given.dtype).replace('torch.', '')}); {hint}"
        )
    if not X.is_complex():
        W, _, Vh = torch.linalg.svd(X, full_matrices=False)
        return W @ Vh  # the polar factor: the nearest orthonormal basis, each column kept near the given one
    return _real_span(X, rounding(given.dtype, d))


def _real_span(X: torch.Tensor, noise: float) -> torch.Tensor:
    """Orthonormal (d, r) float64 basis of span(Re X, Im X) for a complex (d, k) X; r <= 2k.

    Directions whose singular value is under the rounding of X's dtype (an imaginary part that is
    rounding, not signal) are dropped; one direction left from one vector takes the sign of that
    vector's larger part.
    """
    R = torch.cat([X.real, X.imag], 1)  # (d, 2k)
    W, S, _ = torch.linalg.svd(R, full_matrices=False)
    r = max(1, int((S > noise * S[0]).sum()))
    B = W[:, :r]
    if r == 1 and X.shape[1] == 1:
        ref = X.real[:, 0] if X.real.norm() >= X.imag.norm() else X.imag[:, 0]
        B = B * (1.0 if float(B[:, 0] @ ref) >= 0 else -1.0)
    return B.contiguous()


@dataclass
class TargetSpec:
    """One (layer, target): its basis, its v_1 (k = 1), its eigen-subspaces and the variant of F it is measured under."""

    name: str
    U: torch.Tensor  # (d, k) float64
    v1: torch.Tensor | None = None  # (d,) for the signed cosine, k = 1
    eig: list[torch.Tensor] = field(default_factory=list)  # (d, k_i) each
    variant: str = "ov"  # its F's variant (a custom target's: 'ov'); the F-null draws from that F

    @property
    def k(self) -> int:
        return self.U.shape[1]


def merge_states(a: dict, b: dict) -> dict:
    """Sum two states of the same layout (batches, processes, runs)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        raise ValueError("cannot merge statistics of different layouts (other targets, null draws or eig_top)")
    return {k: a[k] + b[k].to(a[k]) for k in a}


# ---- summaries: from sums to the numbers a user reads ----


def mc_p_value(t: float, draws, tie_seed: int | None = None) -> float:
    """Two-sided Monte-Carlo p-value of t among K null draws, valid at resolution 1/(K+1).

    r is the rank of t among the K draws and t itself; p = min(1, 2 min(r, K + 2 - r) / (K + 1)).
    Alignment shares are counts over tokens, so t often ties with draws. With ``tie_seed``
    the ties are broken uniformly at random (seeded, so reproducible): r is then uniform on
    1..K+1 under the null and p has exact size. Without it ties count against rejection,
    which is valid but conservative.
    """
    import numpy as np

    x = np.asarray(draws, dtype=float)
    x = x[np.isfinite(x)]
    if not math.isfinite(t) or x.size == 0:
        return float("nan")
    below, ties = int(np.sum(x < t)), int(np.sum(x == t))
    if tie_seed is None:
        lo, hi = 1 + below + ties, 1 + int(np.sum(x > t)) + ties
    else:
        r = 1 + below + int(np.random.default_rng(tie_seed).integers(0, ties + 1))
        lo, hi = r, x.size + 2 - r
    return float(min(1.0, 2 * min(lo, hi) / (x.size + 1)))


def percentile(t: float, draws, eps: float = 0.0) -> float:
    """Share of draws below t, ties (within ``eps``: rounding) counted half; NaN without draws."""
    import numpy as np

    x = np.asarray(draws, dtype=float)
    x = x[np.isfinite(x)]
    if not math.isfinite(t) or x.size == 0:
        return float("nan")
    below, tied = np.sum(x < t - eps), np.sum(np.abs(x - t) <= eps)
    return float((below + 0.5 * tied) / x.size)


def bh(p) -> list[float]:
    """Benjamini-Hochberg q-values (NaN entries stay NaN and are not counted)."""
    import numpy as np

    p = np.asarray(p, dtype=float)
    q = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if not ok.any():
        return q.tolist()
    pv = p[ok]
    order = np.argsort(pv)
    n = pv.size
    ranked = pv[order] * n / np.arange(1, n + 1)
    ranked = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty(n)
    out[order] = np.minimum(ranked, 1.0)
    q[ok] = out
    return q.tolist()


def cluster_ci(t: dict, rho: float, lift: float, null_var: float, K: int) -> dict:
    """Cluster-robust 95% intervals for rho and lift, and the design effect.

    var(rho) = C/(C-1) * sum_s (u_s - rho n_s)^2 / N^2, the sequence as the cluster (C clusters,
    N tokens). The lift is measured on the null's tokens (n_s, N there, w_s = u_s - mean over
    draws), and its variance adds the Monte-Carlo variance of the null mean (var/K).
    """
    N, C = t["n_mid"], t["n_clu"]
    nan = float("nan")
    out = {"rho_ci_lo": nan, "rho_ci_hi": nan, "design_effect": nan, "lift_ci_lo": nan, "lift_ci_hi": nan}
    if N <= 0 or C < 2 or not math.isfinite(rho):
        return out
    f = C / (C - 1)
    var = f * max(t["clu_u2"] - 2 * rho * t["clu_un"] + rho * rho * t["clu_n2"], 0.0) / (N * N)
    se = math.sqrt(var)
    out["rho_ci_lo"], out["rho_ci_hi"] = max(0.0, rho - Z95 * se), min(1.0, rho + Z95 * se)
    binom = rho * (1 - rho) / N
    out["design_effect"] = var / binom if binom > 0 else nan
    Ns = t["n_sub"]
    if math.isfinite(lift) and Ns > 0:
        var_l = f * max(t["clu_w2"] - 2 * lift * t["clu_wn"] + lift * lift * t["clu_ns2"], 0.0) / (Ns * Ns)
        se_l = math.sqrt(var_l + (null_var / K if K else 0.0))
        out["lift_ci_lo"], out["lift_ci_hi"] = lift - Z95 * se_l, lift + Z95 * se_l
    return out


def same_subspace(U1: torch.Tensor, U2: torch.Tensor, tol: float = SAME_SUBSPACE_TOL) -> bool:
    """Whether orthonormal bases U1 (d, k1) and U2 (d, k2) span one subspace: k1 == k2 and every principal
    cosine (singular value of U1^T U2) is at least 1 - tol."""
    if U1.shape != U2.shape:
        return False
    return bool(torch.linalg.svdvals(U1.to(torch.float64).T @ U2.to(torch.float64)).min() >= 1 - tol)


def verdict(
    q_null: float, lift: float, alpha: float = 0.05, null_tokens: float | None = None, read_mid: bool = True
) -> str:
    """'toward' / 'away' when q_null < alpha (by the sign of rho - null mean), else 'indistinguishable';
    'too few tokens' when the null saw fewer than ``MIN_NULL_TOKENS`` (its band is then wider than 0.5);
    'no mid reading' when the monitor read no 'mid' (``read_mid`` False), which rho needs, whatever the tokens."""
    if not read_mid:
        return NO_MID
    if null_tokens is not None and null_tokens < MIN_NULL_TOKENS:
        return TOO_FEW
    if not (math.isfinite(q_null) and math.isfinite(lift)) or q_null >= alpha:
        return "indistinguishable"
    return "toward" if lift > 0 else "away"


# The verdict's statistic (docs/concepts.md, "The verdict's test"): Δγ = γ_mid - γ_pre on the null's tokens,
# read against a Student t fitted to the Haar draws' Δγ, with this many degrees of freedom. The Haar draws' Δγ
# has heavier tails than a normal (excess kurtosis 0.5-2.5 on SmolLM2); t_8 keeps the share of random targets
# at p < a at or below a for a from 0.0005 to 0.05 on SmolLM2 and the zoo (benchmarks/power.py calibrate).
DGAMMA_TAIL_DF = 8
Z80 = 0.8416212335729143  # the standard normal's 80% quantile: power 0.8


def tail_p_value(t: float, draws, df: int | None = None, tie_seed: int | None = None, eps: float = 0.0) -> float:
    """Two-sided p of t against a location-scale Student t fitted to K null draws (their mean and sd).

    z = |t - mean| / (sd sqrt(1 + 1/K)) is read on Student's t with ``df`` degrees of freedom (None: K - 1,
    the normal prediction interval's, exact when the draws are normal). Unlike ``mc_p_value`` it has no
    floor, so a lone row can pass Benjamini-Hochberg over m hypotheses at the default K; its calibration
    depends on the draws' tails, measured in docs/findings.md. Draws that spread by no more than ``eps``
    (rounding: an attention step that moves nothing) give p = 1 where t is within eps of them too, else the
    Monte-Carlo p, exact there.
    """
    import numpy as np
    from scipy.stats import t as student

    x = np.asarray(draws, dtype=float)
    x = x[np.isfinite(x)]
    if not math.isfinite(t) or x.size < 3:
        return float("nan")
    sd = float(x.std(ddof=1))
    if not sd > eps:
        return 1.0 if abs(t - float(x.mean())) <= eps else mc_p_value(t, x, tie_seed)
    z = abs(t - float(x.mean())) / (sd * math.sqrt(1 + 1 / x.size))
    nu = x.size - 1 if df is None else min(df, x.size - 1)
    return float(min(1.0, 2 * student.sf(z, nu)))


def detectable(t: float, mean: float, sd: float, K: int, m: int, df: int | None = None, se: float = 0.0,
               alpha: float = 0.05) -> float:  # fmt: skip
    """The smallest increase of a row's statistic t that ``tail_p_value`` would call with 80% power, the row
    alone among m hypotheses.

    Benjamini-Hochberg over m hypotheses calls a lone row when its p <= alpha / m, i.e. when t is beyond
    mean + c sd sqrt(1 + 1/K), c Student's t quantile at alpha / (2m) (``df`` degrees of freedom; None:
    K - 1), mean and sd those of the K draws. ``se``, the statistic's own sampling error (0 where the run's
    sums do not give it), adds z_0.8 se. 0 when t is past that already; NaN without draws or hypotheses.
    More than one real effect makes BH more lenient, so this is what a lone effect needs.
    """
    from scipy.stats import t as student

    if not (math.isfinite(t) and math.isfinite(mean) and math.isfinite(sd)) or K < 3 or m < 1:
        return float("nan")
    nu = K - 1 if df is None else min(df, K - 1)
    c = float(student.isf(alpha / (2 * m), nu))
    need = mean + c * sd * math.sqrt(1 + 1 / K) + Z80 * (se if math.isfinite(se) else 0.0)
    return max(0.0, need - t)
