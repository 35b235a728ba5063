"""The Haar null: K Haar-random k-subspaces per layer, nested over k (``haar_frames``).

Frames: (null_draws, d, k_max), drawn at the layer targets' widest k and widened for head targets
(``head_targets.widen``). Columns: each draw's k_max-wide frame, ``null_draws * frame_width`` columns
of ``Bn64``. State: ``null_up`` (up-counts per k and draw), ``null_pre`` and ``null_mid`` (alignment
sums), and the per-sequence mean up-count over draws (``ubar_sub``, for the lift's interval). Over
the table: ``q_null`` (BH over the table's hypotheses), ``verdict_haar`` (its last column), and the
detectable effects ``detectable_dgamma`` and ``detectable_rho``.
"""

from __future__ import annotations

import torch

from .base import Builtin, row_at


def haar_frames(d: int, k_max: int, K: int, seed: int) -> torch.Tensor:
    """K Haar-random orthonormal frames (K, d, k_max), float64, fixed by the seed.

    The span of the first k columns of each frame is a Haar-random k-subspace for every
    k <= k_max, so one set of draws serves targets of every k.
    """
    g = torch.Generator().manual_seed(int(seed))
    G = torch.randn(K, d, k_max, generator=g, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)
    return Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[:, None, :]  # unique QR: Haar


def prefix_norms(H: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """(..., len(ks)): the norm of each frame's first k columns for k in ks, H (..., k_max).

    Running sums of squares, one add per column: a cumsum over a last axis this short ran at a few
    GB/s on CUDA (docs/scale.md)."""
    if ks == [1]:
        return H[..., :1].abs()
    sq = H * H
    acc, outs = sq[..., 0], []
    for j in range(max(ks)):
        if j:
            acc = acc + sq[..., j]
        if j + 1 in ks:
            outs.append(acc)
    return torch.stack(outs, -1).sqrt()


class Haar(Builtin):
    name = "haar"
    fields = ("null_up", "null_pre", "null_mid")
    settings = ("null_seed", "null_draws", "null_stride")
    null = True
    row_fields = ("ubar_sub",)
    per_k = ("null_up", "null_pre", "null_mid")
    table_columns = ("q_null", "verdict_haar", "detectable_dgamma", "detectable_rho")
    last = ("verdict_haar",)  # a text every row fills

    def fingerprint(self, config) -> dict:
        return {"null_seed": config.null_seed, "null_draws": config.null_draws, "null_stride": config.null_stride}

    def draw(self, at):
        from .. import head_targets as H

        frames = haar_frames(at.adapter.width(at.layer), at.k_draw, at.config.null_draws, at.seed(0))
        return H.widen(frames, at.k_max, at.seed(H.WIDEN_SEED))

    def zero(self, size):
        K = size.draws.get(self.name, 0)
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        return {"null_up": z(size.n_k, K), "null_pre": z(size.n_k, K), "null_mid": z(size.n_k, K)}

    def columns(self, lb, width):
        frames = lb.frames[self.name]
        return [frames.permute(1, 0, 2).reshape(lb.d, frames.shape[0] * lb.frame_width)]  # column j*kw + i

    def constants(self, bases, picks, dev):
        hot = lambda idx, n, dt: torch.nn.functional.one_hot(torch.tensor(idx), n).transpose(1, 2).to(dev, dt)  # noqa: E731
        if len({tuple(k) for k in picks["k_index"]}) > 1:  # picks the float64 per-row means
            return {"k_hot": hot(picks["k_index"], len(bases[0].group_ks), torch.float64)}
        return {}

    def align(self, stk, P, inv):
        bases = stk.bases
        L, N = P.shape[:2]
        H = P.reshape(L, N, bases.frames[self.name].shape[0], bases.frame_width)
        cum = prefix_norms(H, bases.group_ks).transpose(2, 3)  # (L, N, n_k, K) at the group's ks
        return {"haar": cum * inv[..., None, None]}  # (L, N, n_k, K)

    def point_sums(self, stk, null_all, n_points, N):
        h = null_all["haar"]
        return {"haar_sum": h.reshape(stk.L, n_points, N, *h.shape[2:]).nansum(2)}  # (L, P_null, n_k, K)

    def sums(self, stk, aligned, on_null, cols, st):
        st["null_pre"] = on_null["pre"]["haar_sum"]

    def up(self, stk, aligned, on_null, cols, st, scratch):
        zmid, zref = on_null["mid"], scratch["zref"]
        u_h = stk.grew(zmid["haar"], zref["haar"])  # (L, N, n_k, K)
        st["null_up"] = u_h.sum(1, dtype=torch.float32)
        st["null_mid"] = zmid["haar_sum"]
        scratch["u_h"] = u_h

    def no_mid(self, stk, st):
        K = stk.bases.frames[self.name].shape[0]
        st["null_up"] = st["null_mid"] = torch.zeros(stk.L, len(stk.bases.group_ks), K, device=stk.dev)

    def rows(self, stk, scratch):
        K = stk.bases.frames[self.name].shape[0]
        ubar = stk.per_row(scratch["u_h"].sum(-1)) / K  # (L, b, n_k): mean over draws, per k
        k0 = stk.picks["k_index"][0]
        if "k_hot" in stk.consts:  # each layer its targets' own k
            return [torch.bmm(ubar, stk.consts["k_hot"])]
        whole = k0 == list(range(ubar.shape[-1]))  # target ti reads the ti-th k, and there are T of them
        return [ubar if whole else torch.stack([ubar[..., j] for j in k0], -1)]

    def summary(self, row, out: dict) -> dict:
        """The Haar null's band, p_null (Δγ against a t fitted to the draws' Δγ; too few null tokens: NaN),
        today's Monte-Carlo p of rho (p_rho_mc) and its fitted tail (p_rho_tail), percentiles, the lifts and
        the interval of rho's."""
        import numpy as np

        from .. import stats

        t, state, ki, nan = row.t, row.state, row.k_index, float("nan")
        div = lambda a, b: a / b if b > 0 else nan  # noqa: E731
        K = state["null_up"].shape[1]
        # The nulls are measured on a subsample of tokens; the target is compared on the same ones.
        ns, nps = t["n_sub"], t["n_pre_sub"]
        rho_s = div(t["n_up_sub"], ns)
        null_rho = state["null_up"][ki].numpy() / ns if ns > 0 else np.array([])
        nmid = state["null_mid"][ki].numpy() / ns if ns > 0 else np.array([])
        npre = state["null_pre"][ki].numpy() / nps if nps > 0 else np.array([])
        q = lambda x, a: float(np.quantile(x, a)) if x.size else nan  # noqa: E731
        enough = ns >= stats.MIN_NULL_TOKENS
        # the verdict's statistic: Δγ = γ_mid - γ_pre on the null's tokens, the target's and each draw's
        dg = div(t["sum_mid_sub"], ns) - div(t["sum_pre_sub"], nps)
        null_dg = nmid - npre if nmid.size and nmid.size == npre.size else np.array([])
        eps = stats.GROWTH_EPS  # alignments are float32: Δγ's that differ by less are rounding
        col = dict(
            null_tokens=int(ns),
            rho_null_tokens=rho_s,
            null_rho_mean=float(null_rho.mean()) if null_rho.size else nan,
            null_rho_lo=q(null_rho, 0.025),
            null_rho_hi=q(null_rho, 0.975),
            rho_percentile=stats.percentile(rho_s, null_rho),
            p_null=stats.tail_p_value(dg, null_dg, stats.DGAMMA_TAIL_DF, row.tie_seed, eps) if enough else nan,
            p_rho_mc=stats.mc_p_value(rho_s, null_rho, row.tie_seed) if enough else nan,
            p_rho_tail=stats.tail_p_value(rho_s, null_rho, None, row.tie_seed) if enough else nan,
            null_rho_sd=float(null_rho.std(ddof=1)) if null_rho.size > 1 else nan,
            dgamma=dg,
            null_dgamma_mean=float(null_dg.mean()) if null_dg.size else nan,
            null_dgamma_sd=float(null_dg.std(ddof=1)) if null_dg.size > 1 else nan,
            null_dgamma_lo=q(null_dg, 0.025),
            null_dgamma_hi=q(null_dg, 0.975),
            dgamma_percentile=stats.percentile(dg, null_dg, eps),
            null_gamma_pre_mean=float(npre.mean()) if npre.size else nan,
            null_gamma_pre_lo=q(npre, 0.025),
            null_gamma_pre_hi=q(npre, 0.975),
            gamma_pre_percentile=stats.percentile(div(t["sum_pre_sub"], nps), npre),
            null_gamma_mid_mean=float(nmid.mean()) if nmid.size else nan,
            gamma_mid_percentile=stats.percentile(div(t["sum_mid_sub"], ns), nmid),
        )
        col["lift"] = rho_s - col["null_rho_mean"]
        col["dgamma_lift"] = dg - col["null_dgamma_mean"]
        col.update(
            stats.cluster_ci(t, out["rho"], col["lift"], float(null_rho.var(ddof=1)) if null_rho.size > 1 else 0.0, K)
        )
        col["null_draws"] = K
        return col

    def table(self, df, at) -> None:
        """p_null shared by each hypothesis's rows, q_null over the table's, and the Haar test's verdict."""
        from .. import stats

        df["p_null"] = at.shared(df["p_null"].tolist())
        df["q_null"] = at.q(df["p_null"].tolist())
        df["verdict_haar"] = [
            stats.verdict(q, lift, null_tokens=n, read_mid=at.read_mid)
            for q, lift, n in zip(df["q_null"], df["dgamma_lift"], df["null_tokens"])
        ]

    def power(self, df, at) -> None:
        """``detectable_dgamma`` and ``detectable_rho``: the smallest planted Δγ (the Haar test's) and Δρ (rho's
        fitted tail, ``p_rho_tail``) each row would have been called at with 80% power, alone among its family's m
        hypotheses (those with a p), from the run's own sums (``stats.detectable``). Δρ's includes rho's
        cluster-robust error on the null's tokens; Δγ's has no error term (the run keeps no per-sequence Δγ), so
        its power there is about a half; docs/findings.md measures both on planted effects. Δρ's is inf where
        even rho = 1 would not be called."""
        import numpy as np

        from .. import stats

        first, families = at.first, at.families
        ok = df["p_null"].notna().to_numpy()
        m = {f: sum(1 for i, j in enumerate(first) if i == j and families[i] == f and ok[i]) for f in set(families)}
        K = df["null_draws"].to_numpy()
        mf = [m[f] for f in families]
        dg, rho = [], []
        for r, K_, m_ in zip(df.to_dict("records"), K, mf):
            dg.append(
                stats.detectable(r["dgamma"], r["null_dgamma_mean"], r["null_dgamma_sd"], K_, m_, stats.DGAMMA_TAIL_DF)
            )
            se = (r["lift_ci_hi"] - r["lift_ci_lo"]) / (2 * stats.Z95)
            x = stats.detectable(r["rho_null_tokens"], r["null_rho_mean"], r["null_rho_sd"], K_, m_, None, se)
            rho.append(np.inf if x == x and r["rho_null_tokens"] + x > 1 else x)
        df["detectable_dgamma"] = np.where(ok, dg, np.nan)
        df["detectable_rho"] = np.where(ok, rho, np.nan)

    def reference(self, ls, X: dict, Xb, Y: dict, Yr, sub, row) -> None:
        """Plain float64: the Haar sums on one sequence's subsample Y[p] (its reference Yr); ubar into row."""
        from .plain import align_frames, up

        st, lb = ls.state, ls.bases
        K = lb.haar.shape[0]
        ubar = {}  # k -> this sequence's up-counts on the subsample, averaged over the K draws
        for ki, k in enumerate(lb.ks):
            st["null_pre"][ki] += align_frames(Y["pre"], lb.haar, k).sum(0)
            if "mid" in Y:
                a_mid = align_frames(Y["mid"], lb.haar, k)
                st["null_mid"][ki] += a_mid.sum(0)
                ups = up(a_mid, align_frames(Yr, lb.haar, k))  # (n_sub, K)
                st["null_up"][ki] += ups.sum(0)
                ubar[k] = float(ups.sum()) / K
        if "mid" in Y:
            for ti, t in enumerate(lb.targets):
                row[row_at("ubar_sub"), ti] = ubar[t.k]


HAAR = Haar()
