"""The verdict: is the layer's target special among the directions its residual stream already favours?

Owns the verdict's kept tokens (``sample``: a bounded sample of unit (baseline, mid) readings, merged exactly), its
null families (``NULLS``: one file each; ``covariance``, the default), and the inference (``layer_columns``): on each
layer, the kept tokens' sequences are split by a seeded hash into an estimation half E and a scoring half S; the
null's ``verdict_draws`` frames are drawn from E; the target and every draw are scored on S.

Two questions, each with an effect, its interval over sequences, the null's band, p and (over the table) q:
- the tilt, Δγ = mean over S's tokens of a(mid) − a(baseline): does attention move tokens toward the target more
  than toward directions the stream favours? It decides ``verdict``;
- static alignment, γ = mean of a(baseline): does the stream already point along the target more than along such
  directions? It decides ``verdict_static``.
p is the target's two-sided rank among the draws (exact under exchangeability, resolution 2/(K + 1)); the
interval is a cluster bootstrap over S's sequences (the sequence is the unit: its tokens are not independent).
docs/concepts.md, "The verdict", says why this null and this unit.
"""

from __future__ import annotations

import math

import torch

from . import covariance
from .sample import Candidates, Sample, halves

NULLS = {"covariance": covariance}  # a null family: a module with fit(X_E, seq_E, n_E) and draws(fitted, K, k, gen)
MIN_SEQUENCES = 10  # in each half: fewer and the bootstrap's interval (and Σ's estimate) mean little
BOOT = 2000  # cluster-bootstrap resamples of S's sequences
TOO_FEW_SEQ = "too few sequences"
CHUNK = 1024  # frames projected at a time (memory bound)
BLOCK_SEED = 1_000_003  # a block's stream: seed + 7919 k + BLOCK_SEED b
# Where a call hangs on the draws, the layer is scored again on EXTEND x K draws, so that another null_seed rarely
# moves a call (docs/concepts.md, "The verdict"; benchmarks/verdict_seeds.py). A p rests on r = p (K + 1) / 2 draws
# past the target, a relative error of about 1 / sqrt(r) (a p near 0.005 at K = 4,999: ~30%); a call hangs on the
# draws when its q is within UNSURE such errors of 0.05 (``unsure``).
UNSURE, EXTEND = 3.0, 10


def unsure(p: float, q: float, K: int, alpha: float = 0.05) -> bool:
    """Whether a call at q (from p on K draws) could go the other way on other draws: |ln(q / alpha)| within
    ``UNSURE`` relative Monte-Carlo errors of p."""
    if not (math.isfinite(p) and math.isfinite(q)) or q <= 0:
        return False
    r = max(p * (K + 1) / 2, 1.0)
    return abs(math.log(q / alpha)) < UNSURE / math.sqrt(r)


# every column ``layer_columns`` gives, in the table's order
COLUMNS = (
    "tilt", "tilt_ci_lo", "tilt_ci_hi", "p_tilt", "tilt_null_lo", "tilt_null_median", "tilt_null_hi", "tilt_lift",
    "tilt_se", "static", "static_ci_lo", "static_ci_hi", "p_static", "static_null_lo", "static_null_median",
    "static_null_hi", "eig_tilt_percentile", "verdict_sequences", "verdict_tokens", "verdict_draws",
)  # fmt: skip


# every summary column that comes from the kept tokens (``COLUMNS`` and what the table derives from them)
SAMPLE_COLUMNS = COLUMNS + ("q_tilt", "q_static", "verdict", "verdict_static", "static_lift", "detectable_tilt")


def split(h: dict, seed: int):
    """A layer's kept tokens split by sequence: Xb_E (nE_tok, d) and seq_E (its tokens' sequences as 0..n_E-1),
    Xb_S, Xm_S (nS_tok, d) and seq_S (as 0..n_S-1), n_E and n_S sequences; float64."""
    X, seq = h["X"].to(torch.float64), h["seq"]
    est = halves(seed, seq)
    uE, seq_E = torch.unique(seq[est], return_inverse=True)
    uS, seq_S = torch.unique(seq[~est], return_inverse=True)
    return X[est, 0], seq_E, X[~est, 0], X[~est, 1], seq_S, int(uE.numel()), int(uS.numel())


def per_sequence(U: torch.Tensor, Xb: torch.Tensor, Xm: torch.Tensor, seq: torch.Tensor, n_seq: int):
    """Per-sequence sums of a(baseline) and a(mid), a(x) = ||Uᵀx|| (unit x), for frames U (M, d, k): (M, n_seq) each."""
    M, d, k = U.shape
    out = []
    for X in (Xb, Xm):
        X32 = X.float()
        sums = torch.zeros(n_seq, M, dtype=torch.float32)
        for c in range(0, M, CHUNK):
            Uc = U[c : c + CHUNK].float().permute(1, 0, 2).reshape(d, -1)  # (d, chunk * k)
            P = X32 @ Uc  # (N, chunk * k)
            a = P.abs_() if k == 1 else P.reshape(len(X), -1, k).square().sum(-1).sqrt()  # (N, chunk)
            sums[:, c : c + CHUNK].index_add_(0, seq, a)  # a sequence's few hundred terms: float32 is exact enough
        out.append(sums.T.double())
    return out[0], out[1]


def rank_p(t: torch.Tensor, null: torch.Tensor, u: float) -> torch.Tensor:
    """Two-sided Monte-Carlo p of each t (T,) among the null's K values; ties with draws broken by u in [0, 1)
    (one u per layer: equal subspaces get equal p). p = min(1, 2 min(r, K + 2 − r) / (K + 1)), r t's rank."""
    K = null.numel()
    below = (null[None, :] < t[:, None]).sum(1)
    ties = (null[None, :] == t[:, None]).sum(1)
    r = below + 1 + torch.floor(u * (ties + 1))
    return torch.clamp(2 * torch.minimum(r, K + 2 - r) / (K + 1), max=1.0)


def nan_columns(n_seq: int = 0, n_tok: int = 0, K: int = 0) -> dict:
    out = {c: math.nan for c in COLUMNS}
    out.update(verdict_sequences=n_seq, verdict_tokens=n_tok, verdict_draws=K)
    return out


def layer_columns(
    h: dict | None,
    targets: list,
    config,
    seed: int,
    null: str = "covariance",
    blocks: int = 1,
    first: dict | None = None,
) -> list[dict]:
    """Every target's verdict columns at one layer (``COLUMNS``), from its kept tokens ``h`` (``Sample.host``).

    Args:
        h: the layer's kept tokens on the CPU, or None (none kept). targets: the layer's ``TargetSpec`` list.
        config: the monitor's settings (verdict_draws, sample_seed). seed: this layer's draw seed.
        null: the null family (``NULLS``). blocks: the draws are ``blocks`` x verdict_draws, in blocks of
            verdict_draws, each its own seeded stream (the first block is the same whatever ``blocks``:
            ``EXTEND`` adds blocks where a call hangs on the draws).
        first: {k: the first block's (tilts, statics)}, kept by the caller for this layer, sample and settings:
            a block computed before is not computed again when the layer is extended (filled here).
    """
    K = config.verdict_draws * blocks
    if h is None or not len(h["seq"]):
        return [nan_columns(K=K) for _ in targets]
    Xb_E, seq_E, Xb_S, Xm_S, seq_S, n_E, n_S = split(h, config.sample_seed)
    if min(n_E, n_S) < MIN_SEQUENCES:
        return [nan_columns(min(n_E, n_S), len(seq_S), K) for _ in targets]
    gen = torch.Generator().manual_seed(seed)
    u_tie = float(torch.rand(1, generator=gen))
    pick = torch.randint(n_S, (BOOT, n_S), generator=gen)  # BOOT resamples of S's sequences, one for every target
    W = torch.zeros(BOOT, n_S, dtype=torch.float64).scatter_add_(1, pick, torch.ones(BOOT, n_S, dtype=torch.float64))
    n = torch.bincount(seq_S, minlength=n_S).double()
    frames: dict[int, tuple] = {}
    family = NULLS[null]
    fitted = family.fit(Xb_E, seq_E, n_E)
    out = []
    for t in targets:
        k = t.k
        if k not in frames:  # one seeded stream a (k, block): a subspace's draws do not depend on the other targets
            tilts, statics = [], []
            for b in range(blocks):  # a block's frames are dropped once scored: memory is one block's
                if b == 0 and first is not None and k in first:
                    tilts.append(first[k][0])
                    statics.append(first[k][1])
                    continue
                gen_b = torch.Generator().manual_seed(seed + 7919 * k + BLOCK_SEED * b)
                sp, sm = per_sequence(family.draws(fitted, config.verdict_draws, k, gen_b), Xb_S, Xm_S, seq_S, n_S)
                tilts.append((sm - sp).sum(1) / n.sum())
                statics.append(sp.sum(1) / n.sum())
                if b == 0 and first is not None:
                    first[k] = (tilts[0], statics[0])
            frames[k] = (torch.cat(tilts), torch.cat(statics))
        tilt_null, static_null = frames[k]
        sp, sm = per_sequence(t.U.to(torch.float64)[None], Xb_S, Xm_S, seq_S, n_S)
        tilt, static = float((sm - sp).sum() / n.sum()), float(sp.sum() / n.sum())
        bt = (W @ (sm - sp)[0]) / (W @ n)  # (B,) the tilt on resampled sequences
        bs = (W @ sp[0]) / (W @ n)
        q = torch.tensor([0.025, 0.5, 0.975], dtype=torch.float64)
        tq, sq = torch.quantile(tilt_null, q), torch.quantile(static_null, q)
        row = dict(
            tilt=tilt, tilt_ci_lo=float(torch.quantile(bt, 0.025)), tilt_ci_hi=float(torch.quantile(bt, 0.975)),
            p_tilt=float(rank_p(torch.tensor([tilt]), tilt_null, u_tie)[0]),
            tilt_null_lo=float(tq[0]), tilt_null_median=float(tq[1]), tilt_null_hi=float(tq[2]),
            tilt_lift=tilt - float(tq[1]), tilt_se=float(bt.std()),
            static=static, static_ci_lo=float(torch.quantile(bs, 0.025)), static_ci_hi=float(torch.quantile(bs, 0.975)),
            p_static=float(rank_p(torch.tensor([static]), static_null, u_tie)[0]),
            static_null_lo=float(sq[0]), static_null_median=float(sq[1]), static_null_hi=float(sq[2]),
            eig_tilt_percentile=eig_percentile(t, tilt, Xb_S, Xm_S, seq_S, n_S, n),
            verdict_sequences=n_S, verdict_tokens=len(seq_S), verdict_draws=K,
        )  # fmt: skip
        row["_null"] = tilt_null  # for the table's detectable_tilt (dropped there)
        out.append(row)
    return out


def eig_percentile(t, tilt: float, Xb, Xm, seq, n_seq: int, n: torch.Tensor) -> float:
    """The target's tilt's percentile among F's own other top eigen-subspaces (ties half); NaN without them."""
    from ..stats import same_subspace

    others = [E.to(torch.float64) for E in t.eig if not same_subspace(E.to(torch.float64), t.U.to(torch.float64))]
    if not others:
        return math.nan
    vals = []
    for k in sorted({E.shape[1] for E in others}):  # the subspaces of one k in one projection
        sp, sm = per_sequence(torch.stack([E for E in others if E.shape[1] == k]), Xb, Xm, seq, n_seq)
        vals.append((sm - sp).sum(1) / n.sum())
    v = torch.cat(vals)
    return float(((v < tilt).sum() + 0.5 * (v == tilt).sum()) / len(v))


def verdict(q: float, lift: float, n_sequences: float, read_mid: bool = True, alpha: float = 0.05) -> str:
    """'toward' / 'away' (by the lift's sign) at q < alpha; else 'indistinguishable'; 'too few sequences' below
    ``MIN_SEQUENCES`` in either half; 'no mid reading' when the monitor read no 'mid' (no verdict sample is kept)."""
    from ..stats import NO_MID

    if not read_mid:
        return NO_MID
    if not n_sequences == n_sequences or n_sequences < MIN_SEQUENCES:  # NaN: nothing kept
        return TOO_FEW_SEQ
    if not (math.isfinite(q) and math.isfinite(lift)) or q >= alpha:
        return "indistinguishable"
    return "toward" if lift > 0 else "away"


def detectable(null: torch.Tensor, se: float, m: int, alpha: float = 0.05) -> float:
    """The smallest lift above the null's median a row would be called at with 80% power, alone among m hypotheses:
    BH then needs p <= alpha / m, so the tilt must pass the draws' 1 − alpha / (2m) quantile; the row's own error
    across sequences (``se``, the bootstrap's) adds z_0.8 se. inf when the draws cannot resolve alpha / m."""
    from ..stats import Z80

    K = null.numel()
    if m < 1 or 2 / (K + 1) > alpha / m:
        return math.inf
    hi = float(torch.quantile(null, 1 - alpha / (2 * m)))
    return hi - float(torch.quantile(null, 0.5)) + Z80 * se


__all__ = [
    "BOOT",
    "COLUMNS",
    "SAMPLE_COLUMNS",
    "Candidates",
    "MIN_SEQUENCES",
    "NULLS",
    "Sample",
    "TOO_FEW_SEQ",
    "layer_columns",
    "unsure",
]
