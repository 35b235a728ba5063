"""Stage 2 of the reduction, once the forward ends: ``reduce_many``, every layer at once.

Layers of the same layout and shapes are reduced together (alignments, up-counts, null draws,
per-row counters) straight from their arena's buffers, so the many small element-wise steps cost
one op per forward instead of one per layer. Its output is per layer, in the layout
``measures.zero_state`` describes. ``monitor/reference.py`` computes the same sums with plain loops.
"""

from __future__ import annotations

import torch

from ..stats import GROWTH_EPS
from .arena import group_constants
from .bases import LayerBases
from .projection import Projection


def reduce_many(items: list[tuple[LayerBases, Projection]]) -> list[tuple[dict, torch.Tensor]]:
    """``(bases, projection)`` pairs to ``(sums, rows)``, in the same order.

    Pairs of the same layout, shapes, points and device are stacked and reduced together;
    the rows of an Arena they were projected into are given back.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (bases, pr) in enumerate(items):
        key = (bases.layout, pr.shape, pr.names, pr.consensus, pr.halves, pr.grid.mask.device)
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


class Stacked:
    """The stacked reduction of L layers of one layout: every tensor has a leading L."""

    def __init__(self, items: list[tuple[LayerBases, Projection]]):
        self.bases = items[0][0]  # the layout's representative (shared fields only)
        self.layer_bases = [r for r, _ in items]
        prs = [p for _, p in items]
        self.L = len(items)
        self.b, self.n, self.null_stride = prs[0].shape
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
            self.flat, self.ok = g0.sub(self.null_stride)
        else:  # layers with grids of their own: (L, b*M), (L, b, M)
            subs = [pr.grid.sub(self.null_stride) for pr in prs]
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
            sv = torch.stack([t for pr in prs for t in pr.sv_parts]).view(self.L, -1, self.b, 2, self.bases.d)
            self.sv = sv.sum(-2)  # hi + lo
        elif prs[0].sv is not None:
            self.sv = stack("sv")[..., 0, :]
        gc = group_constants(self.layer_bases, self.dev)
        self.consts, self.picks = gc.tensors, gc.picks
        # (L, eig columns, T*eig_slots): which eigen-columns make each (target, j); (L, T, eig_slots) valid
        self.measures = self.bases.measures
        self.row_fields = tuple(f for m in self.measures for f in m.row_fields)
        self.per_k = {f for m in self.measures for f in m.per_k}

    def _whole(self, prs: list[Projection]) -> dict | None:
        """The arena's buffers, when these projections are its rows 0..G-1 in order, or ``project_layers``'
        stacks, when they are its layers in order (no copy needed)."""
        b0 = prs[0].batch
        if b0 is not None and b0[2] == len(prs) and all([p.batch and p.batch[0] is b0[0] for p in prs]):
            if [p.batch[1] for p in prs] == list(range(len(prs))):
                return b0[0]
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

    def grew(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Which tokens are "up": a - b > GROWTH_EPS."""
        return (a - b) > GROWTH_EPS

    def per_row(self, v: torch.Tensor) -> torch.Tensor:
        """(L, N, ...) on the null's tokens -> (L, b, ...) float64 sums per row."""
        return v.reshape(self.L, self.b, self.M, *v.shape[2:]).sum(2, dtype=torch.float64)

    def run(self) -> list[tuple[dict, torch.Tensor]]:
        measures = self.measures
        aligned, on_null = self._align()
        L, T = self.L, self.bases.T
        cols: dict = {}
        st: dict = {}
        for m in measures:
            m.sums(self, aligned, on_null, cols, st)
        if "mid" in aligned:
            scratch = {"zref": on_null["base"] if "base" in aligned else on_null["pre"]}
            for m in measures:
                m.up(self, aligned, on_null, cols, st, scratch)
            rows = torch.zeros(L, self.b, len(self.row_fields), T, dtype=torch.float64, device=self.dev)
            at = 0
            for m in measures:  # per-row counters for the cluster-robust intervals
                for v in m.rows(self, scratch):
                    rows[:, :, at, :] = v
                    at += 1
        else:
            rows = torch.zeros(L, self.b, len(self.row_fields), T, dtype=torch.float64, device=self.dev)
            for m in measures:
                m.no_mid(self, st)
        for m in measures:
            m.finish(self, cols, st)
        per = {k: v.double().unbind(0) for k, v in st.items()}  # one op per field, not one per layer
        return [({k: self._own(k, i, v[i]) for k, v in per.items()}, r) for i, r in enumerate(rows.unbind(0))]

    def _own(self, field: str, i: int, v: torch.Tensor) -> torch.Tensor:
        """Layer i's own rows of a per-k field (the group's ks may hold more than its own)."""
        own = self.picks["ks_index"][i]
        if field not in self.per_k or own == list(range(v.shape[0])):
            return v
        if own == list(range(own[0], own[0] + len(own))):
            return v[own[0] : own[0] + len(own)]
        return torch.stack([v[j] for j in own])

    def _align(self):
        """Per-token alignments of every point (``Measure.tokens``); the null measures' on the subsample."""
        L = self.L
        null_valid = self.null_valid = self.sub(self.valid)  # (L, N): the null's tokens
        aligned = {p: {"inv": self.inv[:, j]} for j, p in enumerate(self.pts)}
        for m in self.measures:
            m.tokens(self, aligned)
        nulls = [j for j, p in enumerate(self.pts) if p != "post"]
        N = null_valid.shape[1]
        # The null alignments are 0 off the valid tokens (inv is 0) except on non-finite tokens, where they
        # are NaN: no such token is ever "up", and the sums are nansums, so no where() over the big tensor.
        inv_all = self.sub_points(self.inv)  # (L, P, N), 0 in empty slots
        inv_s = inv_all if len(nulls) == len(self.pts) else torch.stack([inv_all[:, j] for j in nulls], 1)
        inv_s = inv_s.reshape(L, -1)
        null_all: dict = {}
        for m in self.measures:  # every null point at once, each measure its own columns
            if m.name in self.bases.cols:
                a, b = self.bases.cols[m.name]
                null_all.update(m.align(self, self.Pn[..., a:b], inv_s))
        per_point: dict = {}
        for m in self.measures:
            per_point.update(m.point_sums(self, null_all, len(nulls), N))
        on_null = {}
        for i, j in enumerate(nulls):
            on_null[self.pts[j]] = {k: v[:, i * N : (i + 1) * N] for k, v in null_all.items()}
            on_null[self.pts[j]].update({k: v[:, i] for k, v in per_point.items()})
        for m in self.measures:
            m.null_tokens(self, on_null, nulls)
        return aligned, on_null
