"""Stage 2 of the reduction, once the forward ends: ``reduce_many``, every layer at once.

Layers of the same layout and shapes are reduced together (alignments, up-counts, null draws,
per-row counters) straight from their arena's buffers, so the many small element-wise steps cost
one op per forward instead of one per layer. Its output is per layer, in the layout
``stats.zero_state`` describes. ``monitor/reference.py`` computes the same sums with plain loops.
"""

from __future__ import annotations

import torch

from ..stats import _ROW, GROWTH_EPS, TGT_FIELDS
from .arena import group_constants
from .bases import LayerBases
from .projection import Projection


def reduce_many(items: list[tuple[LayerBases, Projection]]) -> list[tuple[dict, torch.Tensor]]:
    """``(bases, projection)`` pairs to ``(sums, rows)``, in the same order.

    Pairs of the same layout, shapes, points and device are stacked and reduced together;
    the rows of an Arena they were projected into are given back.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (red, pr) in enumerate(items):
        key = (red.layout, pr.shape, pr.names, pr.consensus, pr.halves, pr.grid.mask.device)
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(items)
    for idx in groups.values():
        if all(items[i][1].slot for i in idx):  # in row order: the stack may be the arena's own buffers
            idx = sorted(idx, key=lambda i: items[i][1].slot.row)
        for i, res in zip(idx, Stacked([items[i] for i in idx]).run()):
            out[i] = res
    for _, pr in items:
        if pr.slot is not None:
            pr.slot.give_back()
    return out


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


class Stacked:
    """The stacked reduction of L layers of one layout: every tensor has a leading L."""

    def __init__(self, items: list[tuple[LayerBases, Projection]]):
        self.red = items[0][0]  # the layout's representative (shared fields only)
        self.reds = [r for r, _ in items]
        prs = [p for _, p in items]
        self.L = len(items)
        self.b, self.n, self.s = prs[0].shape
        self.consensus = prs[0].consensus
        self.pts = list(prs[0].names)
        whole = self._whole(prs)
        stack = lambda k: whole[k] if whole else torch.stack([getattr(pr, k) for pr in prs])  # noqa: E731
        g0 = prs[0].grid
        same = all(pr.grid is g0 for pr in prs)  # the layers of a forward share one grid
        m0 = g0.mask.bool()
        self.mask = m0.expand(self.L, *m0.shape) if same else torch.stack([pr.grid.mask for pr in prs]).bool()
        # the null subsample: flat (b*M,) positions and ok (b, M); the same for every layer stacked here
        # (it depends only on the mask and the tokens' indices in their sequences)
        if same:
            self.flat, self.ok = g0.sub(self.s)
        else:  # layers with grids of their own: (L, b*M), (L, b, M)
            subs = [pr.grid.sub(self.s) for pr in prs]
            self.flat = None if subs[0][0] is None else torch.stack([f for f, _ in subs])
            self.ok = torch.stack([o for _, o in subs])
        self.M = self.ok.shape[-1]
        self.okf = self.ok.reshape(1 if same else self.L, self.b * self.M)  # (1 or L, N)
        norms = stack("norms").view(self.L, len(self.pts), self.b, self.n)
        self.finite = (norms < float("inf")).all(1)  # a norm is >= 0, inf or NaN: finite iff < inf
        self.valid = self.mask & self.finite  # (L, b, n): the tokens that count
        self.bad = self.mask & ~self.finite  # valid tokens with a non-finite reading at some point
        self.dev = self.valid.device
        self.inv = torch.where(self.valid[:, None], norms.clamp_min(1e-30), float("inf")).reciprocal()  # (L, P, b, n)
        fold = (lambda t: t) if prs[0].halves == 1 else (lambda t: torch.add(*t.chunk(2, -1)))  # noqa: E731  hi + lo
        self.Pn = fold(stack("Pn"))  # (L, P_null * N, C)
        self.Pt = fold(stack("Pt")).view(self.L, len(self.pts), self.b, self.n, -1)  # (L, P, b, n, target columns)
        self.sv = None  # (L, P_c, b, d): the sums of unit vectors at the points other than 'base', in order
        if prs[0].sv_parts is not None:  # half path: (L * P_c) results of (b, 2, d), stacked in one op
            sv = torch.stack([t for pr in prs for t in pr.sv_parts]).view(self.L, -1, self.b, 2, self.red.d)
            self.sv = sv.sum(-2)  # hi + lo
        elif prs[0].sv is not None:
            self.sv = stack("sv")[..., 0, :]
        gc = group_constants(self.reds, self.dev)
        self.consts, self.picks = gc.tensors, gc.picks
        # (L, eig columns, T*eig_slots): which eigen-columns make each (target, j); (L, T, eig_slots) valid
        self.S, self.eig_valid = self.consts.get("S"), self.consts.get("valid")

    def _whole(self, prs: list[Projection]) -> dict | None:
        """The arena's buffers, when these projections are its rows 0..G-1 in order (no copy needed)."""
        rows = [pr.slot for pr in prs]
        if not all(rows) or [r.row for r in rows] != list(range(rows[0].arena.size)):
            return None
        if len({(id(r.arena), r.key) for r in rows}) != 1:
            return None
        return rows[0].arena.bufs[rows[0].key]

    def sub(self, t: torch.Tensor) -> torch.Tensor:
        """(L, b, n, ...) -> (L, N, ...): the null's tokens (N = b*M), zero (False) in empty slots."""
        t = t.reshape(self.L, self.b * self.n, *t.shape[3:])
        if self.flat is not None and self.flat.dim() == 1:
            t = t.index_select(1, self.flat)
        elif self.flat is not None:  # layers whose grids are not one object: each its own positions
            t = t.gather(1, self.flat.view(self.L, -1, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))
        ok = self.okf.view(*self.okf.shape, *([1] * (t.dim() - 2)))
        return t & ok if t.dtype == torch.bool else torch.where(ok, t, 0.0)

    def sub_points(self, t: torch.Tensor) -> torch.Tensor:
        """``sub`` for every reading point at once: (L, P, b, n, ...) -> (L, P, N, ...)."""
        if self.flat is not None and self.flat.dim() != 1:  # layers with grids of their own
            return torch.stack([self.sub(t[:, j]) for j in range(t.shape[1])], 1)
        t = t.reshape(self.L, t.shape[1], self.b * self.n, *t.shape[4:])
        if self.flat is not None:
            t = t.index_select(2, self.flat)
        ok = self.okf.view(self.okf.shape[0], 1, self.okf.shape[1], *([1] * (t.dim() - 3)))
        return t & ok if t.dtype == torch.bool else torch.where(ok, t, 0.0)

    def run(self) -> list[tuple[dict, torch.Tensor]]:
        A, Z = self._align()
        ms = self._ms
        L, T = self.L, self.red.T
        f32 = torch.float32  # sums of 0/1 straight in float32: exact below 2**24, as int64 then float was
        cols = {"n": self.valid.sum((1, 2), dtype=f32)[:, None].expand(L, T)}
        cols["n_nonfinite"] = self.bad.sum((1, 2), dtype=f32)[:, None].expand(L, T)
        cols["n_pre_sub"] = ms.sum(1, dtype=f32)[:, None].expand(L, T)
        cols["sum_pre_sub"] = Z["pre"]["tgt"].sum(1)
        # every reading point at once: (L, P, T) sums of alignments and of cosines with v_1
        sums = self._tgt.sum((2, 3))
        zero = torch.zeros(L, len(self.pts), device=self.dev)
        cos = [zero] * T
        for ti in sorted({ti for r in self.reds for ti in r.cos_targets}):  # a unit target's cosine: its one
            cos[ti] = (self._Pt[..., self.red.g_slices[ti].start] * self.inv).sum((2, 3))  # column over ||x||
        cos = torch.stack(cos, -1)
        if "cos" in self.consts:  # layers where that target is 2-dimensional have no cosine: 0 there
            cos = cos * self.consts["cos"]
        for j, p in enumerate(self.pts):
            if p == "base":
                continue
            cols[f"sum_{p}"] = sums[:, j]
            if p != "pre":
                cols[f"n_{p}"] = cols["n"]
            cols[f"cos_sum_{p}"] = cos[:, j]
        st = {"null_pre": Z["pre"]["haar_sum"]}
        if "mid" in A:
            rows = self._mid_sums(A, Z, ms, cols, st)
        else:
            red = self.red
            rows = torch.zeros(L, self.b, len(_ROW), T, dtype=torch.float64, device=self.dev)
            st["null_up"] = st["null_mid"] = torch.zeros(L, len(red.g_ks), red.null_draws, device=self.dev)
            st["eig_up"] = torch.zeros(L, T, red.eig_slots, device=self.dev)
            st["fnull_up"] = torch.zeros(L, T, red.fnull_draws, device=self.dev)
        if self.consensus:
            self._consensus(cols)
        zero = torch.zeros(L, T, device=self.dev)
        st["tgt"] = torch.stack([cols.get(f, zero) for f in TGT_FIELDS], -1)  # (L, T, F)
        per = {k: v.double().unbind(0) for k, v in st.items()}  # one op per field, not one per layer
        return [({k: self._own(k, i, v[i]) for k, v in per.items()}, r) for i, r in enumerate(rows.unbind(0))]

    def _own(self, field: str, i: int, v: torch.Tensor) -> torch.Tensor:
        """Layer i's own rows of a per-k field (the group's ks may hold more than its own)."""
        own = self.picks["own"][i]
        if not field.startswith("null_") or own == list(range(v.shape[0])):
            return v
        if own == list(range(own[0], own[0] + len(own))):
            return v[own[0] : own[0] + len(own)]
        return torch.stack([v[j] for j in own])

    def _align(self):
        """Alignments: targets on every token (L, b, n, T); nulls on the subsample (L, N, ...)."""
        red, L = self.red, self.L
        valid = self.valid
        ms = self._ms = self.sub(valid)  # (L, N): the null's tokens
        Pt = torch.where(valid[:, None, ..., None], self.Pt, 0.0)  # (L, P, b, n, C); where() drops NaN rows
        tgt = torch.stack([torch.linalg.vector_norm(Pt[..., s], dim=-1) for s in red.g_slices], -1)
        tgt = tgt * self.inv[..., None]  # (L, P, b, n, T)
        self._tgt, self._Pt = tgt, Pt
        A = {p: {"tgt": tgt[:, j], "inv": self.inv[:, j], "P": Pt[:, j]} for j, p in enumerate(self.pts)}
        nulls = [j for j, p in enumerate(self.pts) if p != "post"]
        N = ms.shape[1]
        # The null alignments are 0 off the valid tokens (inv is 0) except on non-finite tokens, where they
        # are NaN: no such token is ever "up", and the sums are nansums, so no where() over the big tensor.
        inv_all = self.sub_points(self.inv)  # (L, P, N), 0 in empty slots
        inv_s = inv_all if len(nulls) == len(self.pts) else torch.stack([inv_all[:, j] for j in nulls], 1)
        tgt_s = self.sub_points(tgt)  # (L, P, N, T): the targets on the null's tokens
        Zall = self._null_align(self.Pn, inv_s.reshape(L, -1))  # every null point at once
        haar_sum = Zall["haar"].reshape(L, len(nulls), N, *Zall["haar"].shape[2:]).nansum(2)  # (L, P_null, n_k, K)
        Z = {}
        for i, j in enumerate(nulls):
            p = self.pts[j]
            Z[p] = {k: v[:, i * N : (i + 1) * N] for k, v in Zall.items()}
            Z[p]["tgt"] = tgt_s[:, j]
            Z[p]["haar_sum"] = haar_sum[:, i]
        return A, Z

    def _null_align(self, P: torch.Tensor, inv: torch.Tensor) -> dict[str, torch.Tensor]:
        """Null alignments from the subsample's projections P (L, N, C) and 1/||x|| (L, N)."""
        red = self.red
        L, N = P.shape[:2]
        out = {}
        if red.eig_slots:
            E = P[..., : red.haar_start]
            out["eig"] = torch.sqrt(torch.bmm(E * E, self.S)) * inv[..., None]  # (L, N, T*eig_slots)
        kw = red.frame_width
        H = P[..., red.haar_start : red.haar_start + red.null_draws * kw].reshape(L, N, red.null_draws, kw)
        cum = prefix_norms(H, red.g_ks).transpose(2, 3)  # (L, N, n_k, K) at the group's ks
        out["haar"] = cum * inv[..., None, None]  # (L, N, n_k, K)
        for key in red.fkeys:
            s = red.f_start[key]
            Fp = P[..., s : s + red.fnull_draws * kw].reshape(L, N, red.fnull_draws, kw)
            out["f:" + key] = prefix_norms(Fp, red.g_fks) * inv[..., None, None]  # (L, N, Kf, len(fks))
        return out

    def _mid_sums(self, A, Z, ms, cols, st) -> torch.Tensor:
        """Up-counts of mid against its baseline: targets on every token, nulls on the subsample; rows."""
        red, L = self.red, self.L
        # off the valid tokens both alignments are 0 (inv is 0), or NaN on a non-finite token: never "up"
        up = lambda a, b: (a - b) > GROWTH_EPS  # noqa: E731
        ref, zref = (A["base"], Z["base"]) if "base" in A else (A["pre"], Z["pre"])
        mid, zmid = A["mid"], Z["mid"]
        u_t = up(mid["tgt"], ref["tgt"])  # (L, b, n, T)
        f32 = torch.float32
        cols["n_up"] = u_t.sum((1, 2), dtype=f32)
        cols["sum_delta"] = (mid["tgt"] - ref["tgt"]).sum((1, 2))
        if "base" in A:
            cols["n_norm_up"] = up(A["base"]["tgt"], A["pre"]["tgt"]).sum((1, 2), dtype=f32)
        msf = ms.float()
        u_s = up(zmid["tgt"], zref["tgt"])  # (L, N, T): the targets on the null's tokens
        cols["n_sub"] = msf.sum(1)[:, None].expand(L, red.T)
        cols["n_up_sub"] = u_s.sum(1, dtype=f32)
        cols["sum_mid_sub"] = zmid["tgt"].sum(1)
        u_h = up(zmid["haar"], zref["haar"])  # (L, N, n_k, K)
        st["null_up"] = u_h.sum(1, dtype=f32)
        st["null_mid"] = zmid["haar_sum"]
        if red.eig_slots:
            e = up(zmid["eig"], zref["eig"]).sum(1, dtype=f32).reshape(L, red.T, red.eig_slots)
            st["eig_up"] = torch.where(self.eig_valid, e, float("nan"))
        else:
            st["eig_up"] = torch.zeros(L, red.T, 0, device=self.dev)
        st["fnull_up"] = self._fnull_up(zmid, zref, up)
        return self._rows(u_t, msf, u_s, u_h)

    def _fnull_up(self, zmid, zref, up) -> torch.Tensor:
        """(L, T, fnull_draws): up-counts of the F-null directions, each layer at its own target's k."""
        red, L = self.red, self.L
        out = torch.zeros(L, red.T, red.fnull_draws, device=self.dev)
        f_hot, f0 = self.consts.get("f_hot"), self.picks["f"][0]
        for i, (ti, fkey, _) in enumerate(red.fnull_targets):
            key = "f:" + fkey
            if f_hot is None:  # every layer reads the same k: that column alone
                j = f0[i]
                out[:, ti] = up(zmid[key][..., j], zref[key][..., j]).sum(1, dtype=torch.float32)
            else:  # each layer its own k: up-counts at every k, each layer's picked by its one-hot
                ups = up(zmid[key], zref[key]).sum(1, dtype=torch.float32)  # (L, Kf, n_fk)
                out[:, ti] = (ups * f_hot[:, None, :, i]).sum(-1)
        return out

    def _rows(self, u_t, msf, u_s, u_h) -> torch.Tensor:
        """(L, b, len(_ROW), T) float64: per-row counters for the cluster-robust intervals."""
        red, L = self.red, self.L
        f64 = torch.float64
        per_row = lambda v: v.reshape(L, self.b, self.M, *v.shape[2:]).sum(2, dtype=f64)  # noqa: E731  (L, b, ...)
        rows = torch.zeros(L, self.b, len(_ROW), red.T, dtype=f64, device=self.dev)
        rows[:, :, 0, :] = self.valid.sum(2, dtype=f64)[..., None]
        rows[:, :, 1, :] = u_t.sum(2, dtype=f64)
        rows[:, :, 2, :] = per_row(msf)[..., None]
        rows[:, :, 3, :] = per_row(u_s)
        ubar = per_row(u_h.sum(-1)) / red.null_draws  # (L, b, n_k): mean over draws, per k
        k0 = self.picks["k"][0]
        if "k_hot" in self.consts:  # each layer its targets' own k
            rows[:, :, 4, :] = torch.bmm(ubar, self.consts["k_hot"])
        else:
            whole = k0 == list(range(ubar.shape[-1]))  # target ti reads the ti-th k, and there are T of them
            rows[:, :, 4, :] = ubar if whole else torch.stack([ubar[..., j] for j in k0], -1)
        return rows

    def _consensus(self, cols) -> None:
        """Within-sequence consensus: mean pairwise cosine of valid tokens, per reading point.

        A sequence with a valid token that is non-finite at any of the layer's reading points is
        left out at all of them (where that reading is non-finite its sum of unit vectors is NaN;
        elsewhere ``bad`` says so); so is one with fewer than 2 valid tokens.
        """
        n_s = self.valid.sum(2, dtype=torch.float32)[:, None]  # (L, 1, b)
        clean = ~self.bad.any(2)[:, None]  # (L, 1, b)
        q = (self.sv * self.sv).sum(-1)  # (L, P_c, b): every point at once
        defined = (n_s >= 2) & torch.isfinite(q) & clean
        c = torch.where(defined, (q - n_s) / (n_s * (n_s - 1)).clamp_min(1), 0.0).sum(2)  # (L, P_c)
        T = self.red.T
        for j, p in enumerate(name for name in self.pts if name != "base"):
            cols[f"cons_sum_{p}"] = c[:, j, None].expand(self.L, T)
            if p == "pre":
                cols["n_seq"] = defined[:, j].sum(1, dtype=torch.float32)[:, None].expand(self.L, T)
