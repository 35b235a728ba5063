"""Target projection: a(x) = ||U^T x|| / ||x|| of every token onto each target, and what follows.

Columns: the targets' bases, ``Bt64`` (every token); the null measures compare against these
alignments on the null's tokens. State: ``tgt`` (T, ``TGT_FIELDS``): counts, alignment sums per
reading point, up-counts and deltas of mid against its baseline, signed cosines with v_1, the
within-sequence consensus, and the cluster sums; per-sequence counters n, u, n_sub, u_sub (the cluster
sums' terms) and s_pre, s_mid, s_post (each sequence's own gamma: an engine's per-request rows).
"""

from __future__ import annotations

import functools

import torch

from .base import POINTS, Builtin, row_at

# Per-target sums; the cluster sums use u_s (tokens up in sequence s), n_s (tokens with a
# delta in s) and w_s = u_s - mean over Haar draws of their u_s (for the lift's interval).
TGT_FIELDS = (
    "n",  # valid, finite tokens
    "n_nonfinite",  # valid tokens skipped for non-finite activations
    "n_mid",  # tokens with a mid reading (and an attention step that ran)
    "n_post",
    "sum_pre",
    "sum_mid",
    "sum_post",
    "sum_delta",
    "n_up",
    "n_norm_up",  # post-norm: a(LN_t(pre)) > a(pre)  (rho_norm_only)
    "cos_sum_pre",  # signed cosine with v_1 (k = 1 only)
    "cos_sum_mid",
    "cos_sum_post",
    "cons_sum_pre",
    "cons_sum_mid",
    "cons_sum_post",
    "n_seq",  # sequences with >= 2 valid tokens, none non-finite, in one forward (consensus)
    "n_clu",  # clusters (sequences) with at least one delta
    "clu_u2",
    "clu_un",
    "clu_n2",
    "clu_w2",  # w_s = u_s - ubar_s on the null's tokens, n_s there: the lift's interval
    "clu_wn",
    "clu_ns2",
    "n_sub",  # tokens in the null subsample with a delta (p_null and its kin compare these)
    "n_up_sub",
    "n_pre_sub",
    "sum_pre_sub",
    "sum_mid_sub",
)
_T = {name: i for i, name in enumerate(TGT_FIELDS)}

_CLU = ("n_clu", "clu_u2", "clu_un", "clu_n2", "clu_w2", "clu_wn", "clu_ns2")
_CLU_SLICE = slice(_T[_CLU[0]], _T[_CLU[-1]] + 1)
assert [_T[f] for f in _CLU] == list(range(_CLU_SLICE.start, _CLU_SLICE.stop)), "the cluster fields must be adjacent"


_CLOSING = ("n", "u", "n_sub", "u_sub", "ubar_sub")  # the counters the cluster sums are made of


@functools.cache
def _closing() -> tuple[int, ...]:
    """Where the counters ``_CLOSING`` sit in a row (``measures.ROW``)."""
    return tuple(row_at(f) for f in _CLOSING)


def close_rows(tgt: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Add finished sequences' counters (..., b, R, T) (R: ``measures.ROW``, its order) to the cluster sums of ``tgt`` (..., T, F); new tgt.

    Leading dimensions are layers closed together (one op each for all of them).
    """
    n, u, ns, us, ubar = (rows.select(-2, i) for i in _closing())  # (..., b, T) each
    w = us - ubar
    add = torch.stack([(n > 0).double(), u * u, u * n, n * n, w * w, w * ns, ns * ns], -1).sum(-3)  # (..., T, 7)
    tgt = tgt.clone()
    tgt[..., _CLU_SLICE] += add  # a slice, not a list: no index tensor made on the host each time
    return tgt


def reference_close(tgt: torch.Tensor, rows: torch.Tensor) -> None:
    """Plain: add ended sequences' counters rows (b, R, T) (``measures.ROW``) to the cluster sums of tgt (T, F), in place.

    Per sequence s and target: n_s its counted tokens, u_s those up, ns_s and us_s the same on
    the null subsample, w_s = us_s - ubar_s (ubar_s: its up-counts there averaged over the draws).
    """
    at = _closing()
    for r in rows:
        for ti in range(tgt.shape[0]):
            n, u, ns, us, ubar = (float(r[i, ti]) for i in at)
            w, c = us - ubar, tgt[ti]
            c[_T["n_clu"]] += float(n > 0)
            c[_T["clu_u2"]] += u * u
            c[_T["clu_un"]] += u * n
            c[_T["clu_n2"]] += n * n
            c[_T["clu_w2"]] += w * w
            c[_T["clu_wn"]] += w * ns
            c[_T["clu_ns2"]] += ns * ns


# The sums that may be negative; every other field counts or adds up non-negative terms.
SIGNED = frozenset({"sum_delta", "cos_sum_pre", "cos_sum_mid", "cos_sum_post", "cons_sum_pre", "cons_sum_mid",
                    "cons_sum_post", "clu_wn"})  # fmt: skip


class Target(Builtin):
    name = "target"
    fields = ("tgt",)
    # per sequence: its tokens, those up, the same on the null's tokens, and its sums of a(pre), a(mid),
    # a(post) (an engine's per-request rows read them; the cluster sums do not)
    row_fields = ("n", "u", "n_sub", "u_sub", "s_pre", "s_mid", "s_post")

    def damaged(self, key, t):
        if t.dim() != 2:
            return super().damaged(key, t)
        signed = torch.tensor([f in SIGNED for f in TGT_FIELDS][: t.shape[1]])
        return ~torch.isfinite(t) | ((t < 0) & ~signed)

    def entry(self, key, at, targets):
        if len(at) != 2:
            return super().entry(key, at, targets)
        row = f"target {targets[at[0]]!r}" if at[0] < len(targets) else f"row {at[0]}"
        return f"field {TGT_FIELDS[at[1]]!r} of {row}"

    def sums_of(self, state: dict, ti: int) -> dict[str, float]:
        """One target's sums by name (``TGT_FIELDS``), from a layer's state (on the host)."""
        return self.named(state["tgt"][ti].tolist())

    @staticmethod
    def named(row) -> dict[str, float]:
        """A row of ``tgt`` (one target's sums, in ``TGT_FIELDS`` order) by name."""
        return dict(zip(TGT_FIELDS, row))

    @staticmethod
    def running(t: dict[str, float]) -> dict[str, float]:
        """The running statistics the sinks log, from one target's sums by name: gamma at each point, rho
        and the tokens counted (the summary's own definitions, ``summary``)."""
        div = lambda a, b: a / b if b > 0 else float("nan")  # noqa: E731
        n, n_mid = t["n"], t["n_mid"]
        return {
            "gamma_pre": div(t["sum_pre"], n),
            "gamma_mid": div(t["sum_mid"], n_mid),
            "gamma_post": div(t["sum_post"], t["n_post"]),
            "rho": div(t["n_up"], n_mid),
            "n_tokens": float(n),
        }

    def zero(self, size):
        return {"tgt": torch.zeros(size.T, len(TGT_FIELDS), dtype=torch.float64)}

    def constants(self, bases, picks, dev):
        if len({tuple(x) for x in picks["cos"]}) > 1:
            return {"cos": torch.tensor(picks["cos"], dtype=torch.float32)[:, None].to(dev)}
        return {}

    def tokens(self, stk, aligned):
        """Targets on every token (L, P, b, n, T)."""
        bases = stk.bases
        Pt = torch.where(stk.valid[:, None, ..., None], stk.Pt, 0.0)  # (L, P, b, n, C); where() drops NaN rows
        tgt = torch.stack([torch.linalg.vector_norm(Pt[..., s], dim=-1) for s in bases.g_slices], -1)
        tgt = tgt * stk.inv[..., None]  # (L, P, b, n, T)
        stk._tgt, stk._Pt = tgt, Pt
        for j, p in enumerate(stk.pts):
            aligned[p]["tgt"], aligned[p]["P"] = tgt[:, j], Pt[:, j]

    def null_tokens(self, stk, on_null, nulls):
        tgt_s = stk.sub_points(stk._tgt)  # (L, P, N, T): the targets on the null's tokens
        for j in nulls:
            on_null[stk.pts[j]]["tgt"] = tgt_s[:, j]

    def sums(self, stk, aligned, on_null, cols, st):
        L, T = stk.L, stk.bases.T
        f32 = torch.float32  # sums of 0/1 straight in float32: exact below 2**24, as int64 then float was
        cols["n"] = stk.valid.sum((1, 2), dtype=f32)[:, None].expand(L, T)
        cols["n_nonfinite"] = stk.bad.sum((1, 2), dtype=f32)[:, None].expand(L, T)
        cols["n_pre_sub"] = stk.null_valid.sum(1, dtype=f32)[:, None].expand(L, T)
        cols["sum_pre_sub"] = on_null["pre"]["tgt"].sum(1)
        # every reading point at once: (L, P, T) sums of alignments and of cosines with v_1
        sums = stk._tgt.sum((2, 3))
        zero = torch.zeros(L, len(stk.pts), device=stk.dev)
        cos = [zero] * T
        for ti in sorted({ti for r in stk.layer_bases for ti in r.cos_targets}):  # a unit target's cosine: its one
            cos[ti] = (stk._Pt[..., stk.bases.g_slices[ti].start] * stk.inv).sum((2, 3))  # column over ||x||
        cos = torch.stack(cos, -1)
        if "cos" in stk.consts:  # layers where that target is 2-dimensional have no cosine: 0 there
            cos = cos * stk.consts["cos"]
        for j, p in enumerate(stk.pts):
            if p == "base":
                continue
            cols[f"sum_{p}"] = sums[:, j]
            if p != "pre":
                cols[f"n_{p}"] = cols["n"]
            cols[f"cos_sum_{p}"] = cos[:, j]

    def up(self, stk, aligned, on_null, cols, st, scratch):
        """Up-counts of mid against its baseline: on every token, and on the null's tokens."""
        L, up = stk.L, stk.grew
        # off the valid tokens both alignments are 0 (inv is 0), or NaN on a non-finite token: never "up"
        ref = aligned["base"] if "base" in aligned else aligned["pre"]
        mid, zmid, zref = aligned["mid"], on_null["mid"], scratch["zref"]
        u_t = up(mid["tgt"], ref["tgt"])  # (L, b, n, T)
        f32 = torch.float32
        cols["n_up"] = u_t.sum((1, 2), dtype=f32)
        cols["sum_delta"] = (mid["tgt"] - ref["tgt"]).sum((1, 2))
        if "base" in aligned:
            cols["n_norm_up"] = up(aligned["base"]["tgt"], aligned["pre"]["tgt"]).sum((1, 2), dtype=f32)
        null_count = stk.null_valid.float()
        u_s = up(zmid["tgt"], zref["tgt"])  # (L, N, T): the targets on the null's tokens
        cols["n_sub"] = null_count.sum(1)[:, None].expand(L, stk.bases.T)
        cols["n_up_sub"] = u_s.sum(1, dtype=f32)
        cols["sum_mid_sub"] = zmid["tgt"].sum(1)
        scratch.update(u_t=u_t, null_count=null_count, u_s=u_s)

    def rows(self, stk, scratch):
        f64 = torch.float64
        per_point = stk._tgt.sum(3, dtype=f64)  # (L, P, b, T): each row's sums of its tokens' alignments
        zero = per_point.new_zeros(per_point[:, 0].shape)
        return [
            stk.valid.sum(2, dtype=f64)[..., None],
            scratch["u_t"].sum(2, dtype=f64),
            stk.per_row(scratch["null_count"])[..., None],
            stk.per_row(scratch["u_s"]),
            *(per_point[:, stk.pts.index(p)] if p in stk.pts else zero for p in POINTS),
        ]

    def finish(self, stk, cols, st):
        if stk.consensus:
            self._consensus(stk, cols)
        zero = torch.zeros(stk.L, stk.bases.T, device=stk.dev)
        st["tgt"] = torch.stack([cols.get(f, zero) for f in TGT_FIELDS], -1)  # (L, T, F)

    def summary(self, row, out: dict) -> dict:
        """Counts, the mean alignments, delta and rho, p_binom, rho_norm_only, cosines and consensus."""
        from scipy.stats import binomtest

        t, nan = row.t, float("nan")
        div = lambda a, b: a / b if b > 0 else nan  # noqa: E731
        n, n_mid = t["n"], t["n_mid"]
        run = self.running(t)
        col = {
            "n_tokens": int(n),
            "n_nonfinite": int(t["n_nonfinite"]),
            "n_sequences": int(t["n_clu"]),
            "gamma_pre": run["gamma_pre"],
            "gamma_mid": run["gamma_mid"],
            "gamma_post": run["gamma_post"],
            "delta_mean": div(t["sum_delta"], n_mid),
            "rho": run["rho"],
        }
        col["p_binom"] = binomtest(int(t["n_up"]), int(n_mid), 0.5).pvalue if n_mid > 0 else nan
        col["rho_norm_only"] = div(t["n_norm_up"], n_mid) if row.post_norm else nan
        for p in POINTS:
            cnt = n if p == "pre" else t[f"n_{p}"]
            col[f"cos_{p}"] = div(t[f"cos_sum_{p}"], cnt) if row.k == 1 else nan
            col[f"consensus_{p}"] = div(t[f"cons_sum_{p}"], t["n_seq"])
        return col

    def reference(self, ls, X: dict, Xb, Y: dict, Yr, sub: torch.Tensor, row: torch.Tensor) -> None:
        """Plain float64: the per-target sums of one sequence's counted tokens X[p] (n, d); its counters
        into row (``measures.ROW``, T)."""
        from .plain import align, up

        tgt = ls.state["tgt"]
        n = X["pre"].shape[0]
        for ti, t in enumerate(ls.bases.targets):
            c = tgt[ti]
            a = {p: align(x, t.U) for p, x in X.items()}
            c[_T["n"]] += n
            c[_T["n_pre_sub"]] += float(sub.sum())
            c[_T["sum_pre_sub"]] += float(a["pre"][sub].sum())
            for p, x in X.items():
                c[_T[f"sum_{p}"]] += float(a[p].sum())
                if p != "pre":
                    c[_T[f"n_{p}"]] += n
                if t.k == 1:  # the signed cosine with v_1, the one column of U
                    c[_T[f"cos_sum_{p}"]] += float((x @ t.U[:, 0] / torch.linalg.vector_norm(x, dim=-1)).sum())
            if "mid" not in X:
                continue
            ref = align(Xb, t.U) if Xb is not None else a["pre"]
            u = up(a["mid"], ref)
            c[_T["n_up"]] += float(u.sum())
            c[_T["sum_delta"]] += float((a["mid"] - ref).sum())
            if Xb is not None:
                c[_T["n_norm_up"]] += float(up(ref, a["pre"]).sum())
            c[_T["n_sub"]] += float(sub.sum())
            c[_T["n_up_sub"]] += float(u[sub].sum())
            c[_T["sum_mid_sub"]] += float(a["mid"][sub].sum())
            for f, v in (("n", n), ("u", u.sum()), ("n_sub", sub.sum()), ("u_sub", u[sub].sum())):
                row[row_at(f), ti] = float(v)
            for p, x in a.items():
                row[row_at(f"s_{p}"), ti] = float(x.sum())

    @staticmethod
    def reference_close(state: dict, rows: torch.Tensor) -> None:
        """Plain: ended sequences' counters (b, R, T) into a layer state's cluster sums, in place."""
        reference_close(state["tgt"], rows)

    @staticmethod
    def reference_skipped(state: dict, n: float) -> None:
        """Plain: n valid tokens of one sequence skipped for a non-finite reading, in place."""
        state["tgt"][:, _T["n_nonfinite"]] += n

    @staticmethod
    def reference_consensus(state: dict, pts: dict[str, torch.Tensor]) -> None:
        """Plain: mean pairwise cosine of one sequence's valid tokens at each point,
        (||sum x_hat||^2 - n) / (n (n - 1)), into a layer state, in place."""
        tgt = state["tgt"]
        for p, X in pts.items():
            n = X.shape[0]
            sv = (X / torch.linalg.vector_norm(X, dim=-1, keepdim=True)).sum(0)
            tgt[:, _T[f"cons_sum_{p}"]] += (float(sv @ sv) - n) / (n * (n - 1))
        tgt[:, _T["n_seq"]] += 1

    @staticmethod
    def _consensus(stk, cols) -> None:
        """Within-sequence consensus: mean pairwise cosine of valid tokens, per reading point.

        A sequence with a valid token that is non-finite at any of the layer's reading points is
        left out at all of them (where that reading is non-finite its sum of unit vectors is NaN;
        elsewhere ``bad`` says so); so is one with fewer than 2 valid tokens.
        """
        n_s = stk.valid.sum(2, dtype=torch.float32)[:, None]  # (L, 1, b)
        clean = ~stk.bad.any(2)[:, None]  # (L, 1, b)
        q = (stk.sv * stk.sv).sum(-1)  # (L, P_c, b): every point at once
        defined = (n_s >= 2) & torch.isfinite(q) & clean
        c = torch.where(defined, (q - n_s) / (n_s * (n_s - 1)).clamp_min(1), 0.0).sum(2)  # (L, P_c)
        T, L = stk.bases.T, stk.L
        for j, p in enumerate(name for name in stk.pts if name != "base"):
            cols[f"cons_sum_{p}"] = c[:, j, None].expand(L, T)
            if p == "pre":
                cols["n_seq"] = defined[:, j].sum(1, dtype=torch.float32)[:, None].expand(L, T)


TARGET = Target()
