"""Stage 1 for a flush of buffered decoding steps: every layer's projections at once, ``project_layers``.

A flush holds each reading slot's steps as one (b, n, d) tensor, all slots side by side in one
(S, b, n, d) tensor. Layer by layer, ``projection.project`` spends about ten ops on each layer:
its norms, its null subsample's gathers and five matmuls, each written into a buffer of its own
that the reduction then stacks. Here the norms of every slot are one op, the subsample of every
slot one gather, and the matmuls write straight into the stacked buffers.

On CUDA each reading point's matmuls are one bmm over the layers of a layout: about ten launches
a flush instead of ten a layer. On the CPU they stay one mm a layer and point: a CPU bmm's bits
are not its matrices' mms (a small bmm takes a plain loop of its own, and two threads split a bmm
by matrices but an mm inside it), and the CPU states are pinned bit for bit
(``benchmarks/reference_states.py``). So the CPU path gives ``project``'s numbers bit for bit
(``tests/monitor/test_lean_steps.py``), and the bmm path the same to float32 rounding
(``tests/monitor/test_batched_projection.py``, which forces it on the CPU).
"""

from __future__ import annotations

import torch

from . import kernels
from .bases import LayerBases
from .grid import Grid
from .projection import Projection

BMM_DEVICES = {"cuda"}  # where a point's matmuls are one bmm over the layers (tests add "cpu")


class Stacks:
    """Each layout's bases stacked over its layers, made once per (layers, device, dtype). Each layer's
    own bases then become views into the stack (``LayerBases.on``), so they are held once."""

    def __init__(self):
        self._made: dict[tuple, tuple] = {}  # key -> (Bt stack, Bn stack, the layers' float64 bases made from)

    def get(self, group: list[LayerBases], device: torch.device, dtype: torch.dtype):
        key = (tuple(map(id, group)), device, dtype)
        made = self._made.get(key)
        if made is None or not all([b.Bt64 is t and b.Bn64 is n for b, (t, n) in zip(group, made[2])]):
            pairs = [b.on(device, dtype) for b in group]  # (a layer laid out again has new bases)
            made = self._made[key] = (_stack(pairs, 0), _stack(pairs, 1), [(b.Bt64, b.Bn64) for b in group])
            for b, Bt, Bn in zip(group, made[0], made[1]):
                b.share(device, dtype, Bt, Bn)
        return made[0], made[1]


def _stack(pairs, k: int) -> torch.Tensor:
    """(L, d, C) of the layers' (d, C) bases in their own layout: a float32 basis is the transposed view
    of a row-major (C, d), and its stack keeps that, (L, C, d) transposed (the bits of the mm)."""
    Bs = [p[k] for p in pairs]
    if Bs[0].stride(0) == 1:
        return torch.stack([B.T for B in Bs]).transpose(1, 2)
    return torch.stack(Bs)


def project_layers(
    layers: list[tuple[LayerBases, dict[str, int | None]]], X: torch.Tensor, grid: Grid, stacks: Stacks
) -> list[Projection]:
    """``project(bases, points, grid, consensus=False)`` of every layer, from one tensor of readings.

    Args:
        layers: (bases, {'pre': slot, 'mid': slot or None, 'post': slot or None}) a layer, each slot a
            row of X; a parallel block's mid is (pre slot, attention slot), their sum.
        X: (S, b, n, d) every reading slot's buffered steps.
        grid: the steps' grid, one for every layer.
        stacks: the bases stacked over the layers (made once).
    Returns the projections in the order of ``layers``; a layout's share one stack of each field, which
    ``reduce_many`` reduces without stacking them again.
    """
    S, b, n, d = X.shape
    rows = X.view(S, b * n, d)
    out: list = [None] * len(layers)
    norms = X.new_empty(S, b * n, dtype=torch.float32)
    kernels.norms(rows, norms)  # every slot's norms, each once (layer t's post is layer t+1's pre)
    groups: dict[tuple, list[int]] = {}
    for i, (bases, slots) in enumerate(layers):
        names = tuple(p for p in ("pre", "mid", "post") if slots.get(p) is not None)
        Bt, Bn = bases.on(X.device, X.dtype)
        key = (bases.layout, names, bases.null_stride, Bt.shape, Bn.shape, Bt.dtype, isinstance(slots["mid"], tuple))
        groups.setdefault(key, []).append(i)
    subs: dict[int, torch.Tensor] = {}
    for (_, names, null_stride, Btshape, Bnshape, Btdtype, _), idx in groups.items():
        flat, _ = grid.sub(null_stride)
        if null_stride not in subs:
            subs[null_stride] = (
                rows if flat is None else rows.index_select(1, flat)
            )  # every slot's subsample, one gather
        bmm = X.device.type in BMM_DEVICES and Btshape[1] > 1  # (one column: a gemv, another kernel)
        src = {
            p: _source(rows, subs[null_stride], norms, [layers[i][1][p] for i in idx], flat, p != "post", bmm)
            for p in names
        }
        G, nulls = len(idx), [p for p in names if p != "post"]
        whole = {"norms": torch.stack([src[p][2] for p in names], 1)}  # (L, P, b*n)
        if bmm:
            Bt, Bn = stacks.get([layers[i][0] for i in idx], X.device, X.dtype)
            whole["Pt"] = torch.stack([kernels.bmm_layers(src[p][0], Bt) for p in names], 1)  # (L, P, b*n, C)
            Pn = torch.stack([kernels.bmm_layers(src[p][1], Bn) for p in nulls], 1)  # (L, P_null, N, Cn)
        else:  # one mm a layer and point, each written into its place in the stack
            whole["Pt"] = X.new_empty(G, len(names), b * n, Btshape[1], dtype=torch.float32)
            Pn = X.new_empty(G, len(nulls), subs[null_stride].shape[1], Bnshape[1], dtype=torch.float32)
            for g, i in enumerate(idx):
                Bt, Bn = layers[i][0].on(X.device, X.dtype)
                for j, p in enumerate(names):
                    kernels.mm(src[p][0][g], Bt, whole["Pt"][g, j])
                for j, p in enumerate(nulls):
                    kernels.mm(src[p][1][g], Bn, Pn[g, j])
        whole["Pn"] = Pn.view(G, -1, Bnshape[1])  # (L, P_null * N, Cn)
        h = 1 if Btdtype == torch.float32 else 2
        for g, i in enumerate(idx):
            out[i] = Projection(
                grid, names, (b, n, null_stride), False, h, whole["norms"][g], whole["Pt"][g], whole["Pn"][g],
                batch=(whole, g, G),
            )  # fmt: skip
    return out


def _at(X: torch.Tensor, k: int | tuple | None) -> torch.Tensor | None:
    return None if k is None else X[k[0]] + X[k[1]] if isinstance(k, tuple) else X[k]


def _source(rows: torch.Tensor, sub: torch.Tensor, norms: torch.Tensor, ks: list, flat, null: bool, stacked: bool):
    """One point's readings for a layout's layers: (rows (L, b*n, d), their null subsample (L, N, d), or None
    when the point has no null, their norms (L, b*n)); not ``stacked`` (one mm a layer), the rows and
    subsamples as a list of each layer's views, no copy. A parallel block's mid, ks of (pre, attention)
    slots, is the sum pre + attn made once for all of them (elementwise: the bits of each layer's own
    sum), its norms and subsample its own."""
    if not isinstance(ks[0], tuple):
        pick = _pick if stacked else lambda t, ks: [t[k] for k in ks]  # noqa: E731
        return pick(rows, ks), pick(sub, ks) if null else None, _pick(norms, ks)
    M = _pick(rows, [k[0] for k in ks]) + _pick(rows, [k[1] for k in ks])
    own = M.new_empty(M.shape[:2], dtype=torch.float32)
    kernels.norms(M, own)
    return M, (M if flat is None else M.index_select(1, flat)) if null else None, own


def _pick(t: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """t's rows ks along its first dimension: a view when they are evenly spaced (a layer's pre, mid
    and post slots usually are), else one copy."""
    if len(ks) == 1:
        return t[ks[0] : ks[0] + 1]
    step = ks[1] - ks[0]
    if step > 0 and ks == list(range(ks[0], ks[0] + step * len(ks), step)):
        return t[ks[0] : ks[-1] + 1 : step]
    return torch.stack([t[k] for k in ks])
