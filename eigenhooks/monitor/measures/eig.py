"""Eig rank: each target ranked among F's own top eigen-subspaces (``stats.eig_subspaces``).

Columns: the distinct eigen-subspaces of the layer's targets, each projected once, zero-padded to
the group's width. State: ``eig_up`` (T, eig_top), the up-counts of each target's j-th subspace
(NaN where F has no j-th subspace within the spectrum kept).
"""

from __future__ import annotations

import torch

from .base import Builtin


def eig_columns(lb) -> tuple[list[torch.Tensor], list[list[int]]]:
    """F's eigen-subspaces over all targets, each projected once; seg: the (target, j) slots it fills."""
    cols: list[torch.Tensor] = []
    seg: list[list[int]] = []
    for ti, t in enumerate(lb.targets):
        for j, E in enumerate(t.eig):
            hit = next((c for c, C in enumerate(cols) if C.shape == E.shape and torch.equal(C, E)), None)
            if hit is None:
                cols.append(E)
                seg.append([])
                hit = len(cols) - 1
            seg[hit].append(ti * lb.eig_slots + j)
    return cols, seg


class Eig(Builtin):
    name = "eig"
    fields = ("eig_up",)
    settings = ("eig_top",)
    null = True

    def zero(self, size):
        return {"eig_up": torch.zeros(size.T, size.m, dtype=torch.float64)}

    def damaged(self, key, t):
        """NaN marks the slots of eigen-subspaces a layer does not have; no sum is ever infinite or negative."""
        return torch.isinf(t) | (t < 0)

    def columns(self, lb, width):
        """[eig columns, zero padding to ``width``]; sets ``lb.S_eig``."""
        S = torch.zeros(width, max(lb.T * lb.eig_slots, 1), dtype=torch.float64)
        at = 0
        for E, owners in zip(lb._eig_cols, lb._seg):
            S[at : at + E.shape[1], owners] = 1.0
            at += E.shape[1]
        lb.S_eig = S  # (eig columns, T * eig_slots): which columns make each (target, j) subspace
        return list(lb._eig_cols) + [torch.zeros(lb.d, width - at, dtype=torch.float64)]

    def constants(self, bases, picks, dev):
        if not bases[0].eig_slots:
            return {}
        return {
            "S": torch.stack([r.S_eig for r in bases]).to(dev, torch.float32),
            "valid": torch.stack([r.eig_valid for r in bases]).to(dev),
        }

    def align(self, stk, P, inv):
        if not stk.bases.eig_slots:
            return {}
        return {"eig": torch.sqrt(torch.bmm(P * P, stk.consts["S"])) * inv[..., None]}  # (L, N, T*eig_slots)

    def up(self, stk, aligned, on_null, cols, st, scratch):
        bases, L = stk.bases, stk.L
        zmid, zref = on_null["mid"], scratch["zref"]
        if bases.eig_slots:
            e = stk.grew(zmid["eig"], zref["eig"]).sum(1, dtype=torch.float32).reshape(L, bases.T, bases.eig_slots)
            st["eig_up"] = torch.where(stk.consts["valid"], e, float("nan"))
        else:
            st["eig_up"] = torch.zeros(L, bases.T, 0, device=stk.dev)

    def no_mid(self, stk, st):
        st["eig_up"] = torch.zeros(stk.L, stk.bases.T, stk.bases.eig_slots, device=stk.dev)

    def summary(self, row, out: dict) -> dict:
        """eig_rank: 1 + the eigen-subspaces whose up-rate beats the target's; their median up-rate."""
        import math

        import numpy as np

        ns, rho_s, nan = row.t["n_sub"], out["rho_null_tokens"], float("nan")
        eig = row.state["eig_up"][row.ti].numpy() / ns if ns > 0 else np.array([])
        eig = eig[np.isfinite(eig)]
        return {
            "eig_rank": int(1 + np.sum(eig > rho_s)) if eig.size and math.isfinite(rho_s) else nan,
            "eig_rho_median": float(np.median(eig)) if eig.size else nan,
        }

    def reference(self, ls, X: dict, Xb, Y: dict, Yr, sub, row) -> None:
        """Plain float64: each target's eigen-subspaces' up-counts on one sequence's subsample."""
        from .plain import align, up

        st, lb = ls.state, ls.bases
        if "mid" not in Y:
            return
        for ti, t in enumerate(lb.targets):
            for j in range(lb.m):
                if j >= len(t.eig):  # F has no j-th subspace within the spectrum kept: NaN, as the fast path
                    st["eig_up"][ti, j] = float("nan")
                    continue
                E = t.eig[j]
                st["eig_up"][ti, j] += float(up(align(Y["mid"], E), align(Yr, E)).sum())


EIG = Eig()
